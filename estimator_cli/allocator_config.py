"""Allocator settings: ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` parsing and the size rules.

The constants, :class:`AllocatorConfig` and the rounding helpers the caching-allocator model
(:mod:`gpushare.estimator_cli.allocator`) is built on. Parsing follows ``c10/core/AllocatorConfig.{h,cpp}``
(``AcceleratorAllocatorConfig``) and ``c10/cuda/CUDAAllocatorConfig.cpp``; the rounding helpers follow the
functions of the same name in ``c10/cuda/CUDACachingAllocator.cpp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpushare.gpus import MiB

# Constants of c10/core/AllocatorConfig.h (formerly the top of CUDACachingAllocator.cpp).
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes (round_size)
K_SMALL_SIZE = 1 * MiB  # kSmallSize: largest "small" allocation (get_pool)
K_SMALL_BUFFER = 2 * MiB  # kSmallBuffer: small requests are packed in 2 MiB segments (get_allocation_size)
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: 1-10 MiB requests use a kLargeBuffer segment
K_ROUND_LARGE = 2 * MiB  # kRoundLarge: larger requests are rounded up to 2 MiB
K_LARGE_BUFFER = 20 * MiB  # kLargeBuffer / large_segment_size() default (large_segment_size_mb)
# roundup_power2_divisions has one entry per power-of-two interval from 1 MiB to 64 GiB
# (kRoundUpPowerOfTwoIntervals, kRoundUpPowerOfTwoStart/End in AllocatorConfig.cpp).
K_ROUNDUP_INTERVALS = 16
_LOG2_1MIB = 20

# Keys PyTorch accepts that do not change device-memory placement; accepted and ignored.
_IGNORED_KEYS = frozenset(
    {
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "pinned_num_register_threads",
        "pinned_use_background_threads",
        "pinned_reserve_segment_size_mb",
        "pinned_max_round_threshold",
        "pinned_max_cached_size",
        "graph_capture_record_stream_reuse",
        "pinned_free_catch_all",
        "throw_on_cudamalloc_oom",
    }
)


def _tokenize(text: str) -> list[str]:
    """ConfigTokenizer: split on ``, : [ ]`` (kept as tokens), drop whitespace."""
    tokens: list[str] = []
    buf: list[str] = []
    for ch in text:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf.clear()
            tokens.append(ch)
        elif not ch.isspace():
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator settings that change where bytes go (``PYTORCH_CUDA_ALLOC_CONF``).

    Sizes are bytes (the environment string uses MiB). ``roundup_power2_divisions`` has one entry per
    power-of-two size interval starting at 1 MiB (index 0 also covers smaller sizes), as in
    ``AcceleratorAllocatorConfig::roundup_power2_divisions``; 0 or 1 means plain 512 B rounding.
    """

    max_split_size: int | None = None  # max_split_size_mb; None = unlimited (PyTorch: SIZE_MAX)
    roundup_power2_divisions: tuple[int, ...] = (0,) * K_ROUNDUP_INTERVALS
    expandable_segments: bool = False
    garbage_collection_threshold: float | None = None  # only acts under a per-process memory fraction
    max_non_split_rounding_size: int = K_LARGE_BUFFER  # max_non_split_rounding_mb
    large_segment_size: int = K_LARGE_BUFFER  # large_segment_size_mb (recent torch); kLargeBuffer before
    # per_process_memory_fraction (recent torch): below 1.0 it acts like set_per_process_memory_fraction.
    per_process_memory_fraction: float | None = None

    def __post_init__(self) -> None:
        if len(self.roundup_power2_divisions) != K_ROUNDUP_INTERVALS:
            raise ValueError(
                f"roundup_power2_divisions needs {K_ROUNDUP_INTERVALS} entries (1 MiB .. 64 GiB intervals)"
            )
        fraction = self.per_process_memory_fraction
        if fraction is not None and not 0.0 <= fraction <= 1.0:
            raise ValueError("per_process_memory_fraction is invalid, set it in [0.0, 1.0]")
        if self.max_split_size is not None and self.max_split_size < self.large_segment_size:
            raise ValueError(
                f"max_split_size_mb too small, must be >= {self.large_segment_size // MiB} "
                "(CachingAllocator option max_split_size_mb)"
            )

    def divisions_for(self, size: int) -> int:
        """AcceleratorAllocatorConfig::roundup_power2_divisions(size)."""
        index = size.bit_length() - 1 - _LOG2_1MIB
        if index < 0:
            index = 0
        elif index >= K_ROUNDUP_INTERVALS:
            index = K_ROUNDUP_INTERVALS - 1
        return self.roundup_power2_divisions[index]

    def to_env_string(self) -> str:
        """The canonical ``PYTORCH_CUDA_ALLOC_CONF`` text for this configuration."""
        parts = []
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size // MiB}")
        if self.max_non_split_rounding_size != K_LARGE_BUFFER:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_size // MiB}")
        if self.large_segment_size != K_LARGE_BUFFER:
            parts.append(f"large_segment_size_mb:{self.large_segment_size // MiB}")
        if self.garbage_collection_threshold is not None:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        if self.per_process_memory_fraction is not None:
            parts.append(f"per_process_memory_fraction:{self.per_process_memory_fraction}")
        if any(self.roundup_power2_divisions):
            items = ",".join(f"{1 << i}:{d}" for i, d in enumerate(self.roundup_power2_divisions))
            parts.append(f"roundup_power2_divisions:[{items}]")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        return ",".join(parts)

    @classmethod
    def from_env_string(cls, text: str) -> "AllocatorConfig":
        """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` value the way PyTorch does, raising ValueError on bad input.

        Follows ``AcceleratorAllocatorConfig::parseArgs`` and ``CUDAAllocatorConfig::parseArgs``: keys
        separated by ``,``, ``key:value``, lists in ``[]``, booleans spelled ``True``/``False``.
        """
        tokens = _tokenize(text or "")
        n = len(tokens)
        values: dict[str, Any] = {}
        divisions = [0] * K_ROUNDUP_INTERVALS

        def need(i: int, what: str) -> str:
            if i >= n:
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: expected {what} at the end of {text!r}")
            return tokens[i]

        def colon(i: int, key: str) -> None:
            if need(i, f"':' after {key}") != ":":
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: expected ':' after {key!r}, got {tokens[i]!r}")

        def size_t(tok: str, key: str) -> int:
            if not tok.isdigit():
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} needs a non-negative integer, got {tok!r}")
            return int(tok)

        def boolean(tok: str, key: str) -> bool:
            if tok not in ("True", "False"):
                raise ValueError(
                    f"PYTORCH_CUDA_ALLOC_CONF: expected a single True/False argument for {key}, got {tok!r}"
                )
            return tok == "True"

        i = 0
        while i < n:
            key = tokens[i]
            if key in ",:[]":
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: expected a key, got {key!r} in {text!r}")
            colon(i + 1, key)
            i += 2
            if key in ("max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb"):
                values[key] = size_t(need(i, f"{key} value"), key)
            elif key in ("garbage_collection_threshold", "per_process_memory_fraction"):
                tok = need(i, f"{key} value")
                try:
                    value = float(tok)
                except ValueError:
                    raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} needs a number, got {tok!r}") from None
                if key == "garbage_collection_threshold" and not 0.0 < value < 1.0:
                    raise ValueError("garbage_collect_threshold is invalid, set it in (0.0, 1.0)")
                if key == "per_process_memory_fraction" and not 0.0 <= value <= 1.0:
                    raise ValueError("per_process_memory_fraction is invalid, set it in [0.0, 1.0]")
                values[key] = value
            elif key == "roundup_power2_divisions":
                i = cls._parse_divisions(tokens, i, divisions, size_t, text)
                values[key] = True
            elif key == "expandable_segments":
                values[key] = boolean(need(i, "True/False"), key)
            elif key == "backend":
                tok = need(i, "backend value")
                if tok == "cudaMallocAsync":
                    raise ValueError(
                        "PYTORCH_CUDA_ALLOC_CONF: backend:cudaMallocAsync is not modelled; "
                        "estimate with backend:native (the default)"
                    )
                if tok != "native":
                    raise ValueError("Unknown allocator backend, options are native and cudaMallocAsync")
            elif key in _IGNORED_KEYS:
                if need(i, f"{key} value") == "[":
                    while i < n and tokens[i] != "]":
                        i += 1
                    need(i, "']'")
            else:
                raise ValueError(f"Unrecognized key {key!r} in CUDA allocator config (PYTORCH_CUDA_ALLOC_CONF)")
            i += 1
            if i < n:
                if tokens[i] != ",":
                    raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: expected ',' before {tokens[i]!r} in {text!r}")
                i += 1
                if i == n:
                    raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: trailing ',' in {text!r}")

        large = values.get("large_segment_size_mb")
        if large is not None and large <= K_MIN_LARGE_ALLOC // MiB:
            raise ValueError(
                f"CachingAllocator option large_segment_size_mb must be > {K_MIN_LARGE_ALLOC // MiB} MB"
            )
        large_bytes = K_LARGE_BUFFER if large is None else large * MiB
        mss = values.get("max_split_size_mb")
        if mss is not None and mss * MiB < K_LARGE_BUFFER:
            raise ValueError(f"CachingAllocator option max_split_size_mb too small, must be >= {K_LARGE_BUFFER // MiB}")
        rounding = values.get("max_non_split_rounding_mb")
        if rounding is not None and rounding * MiB < K_LARGE_BUFFER:
            raise ValueError(
                f"CachingAllocator option max_non_split_rounding_mb too small, must be >= {K_LARGE_BUFFER // MiB}"
            )
        return cls(
            max_split_size=None if mss is None else mss * MiB,
            roundup_power2_divisions=tuple(divisions),
            expandable_segments=values.get("expandable_segments", False),
            garbage_collection_threshold=values.get("garbage_collection_threshold"),
            max_non_split_rounding_size=K_LARGE_BUFFER if rounding is None else rounding * MiB,
            large_segment_size=large_bytes,
            per_process_memory_fraction=values.get("per_process_memory_fraction"),
        )

    @staticmethod
    def _parse_divisions(tokens: list[str], i: int, divisions: list[int], size_t: Any, text: str) -> int:
        """parseRoundUpPower2Divisions: ``N`` for every interval, or ``[64:8,256:4,>:1]`` (MiB:divisions)."""
        n = len(tokens)
        if i >= n:
            raise ValueError("Error, expecting roundup_power2_divisions value")
        if tokens[i] != "[":
            value = size_t(tokens[i], "roundup_power2_divisions")
            if not _is_pow2(value):
                raise ValueError("For roundups, the divisions has to be power of 2")
            divisions[:] = [value] * K_ROUNDUP_INTERVALS
            return i
        first = True
        last_index = 0
        i += 1
        while i < n and tokens[i] != "]":
            bound = tokens[i]
            if i + 2 >= n or tokens[i + 1] != ":":
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: expected 'MiB:divisions' in roundup list of {text!r}")
            value = size_t(tokens[i + 2], "roundup_power2_divisions")
            if value != 0 and not _is_pow2(value):
                raise ValueError("For roundups, the divisions has to be power of 2 or 0 to disable roundup")
            if bound == ">":
                for j in range(last_index + 1, K_ROUNDUP_INTERVALS):
                    divisions[j] = value
            else:
                boundary = size_t(bound, "roundup_power2_divisions interval")
                if not _is_pow2(boundary):
                    raise ValueError("For roundups, the intervals have to be power of 2")
                index = min(max(boundary.bit_length() - 1, 0), K_ROUNDUP_INTERVALS - 1)
                if first:
                    for j in range(index):
                        divisions[j] = value
                    first = False
                divisions[index] = value
                last_index = index
            i += 3
            if i < n and tokens[i] == ",":
                i += 1
        if i >= n:
            raise ValueError("Expected closing bracket ']' in roundup_power2_divisions")
        return i


def round_size(size: int, config: AllocatorConfig) -> int:
    """DeviceCachingAllocator::round_size: 512 B multiples, or the power-of-two division when configured."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = config.divisions_for(size)
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return roundup_power2_next_division(size, divisions)
    return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """DeviceCachingAllocator::roundup_power2_next_division: e.g. 1200 with 4 divisions -> 1280."""
    if _is_pow2(size):
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def allocation_size(size: int, config: AllocatorConfig) -> int:
    """DeviceCachingAllocator::get_allocation_size: the cudaMalloc size for a new segment."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return config.large_segment_size
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE
