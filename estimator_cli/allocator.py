"""A model of PyTorch's CUDA caching allocator, for replaying a captured allocation sequence.

Why: the bytes a training script keeps alive are not what a GPU shows. PyTorch's caching allocator
(``c10/cuda/CUDACachingAllocator.cpp``, torch 2.4-2.13) rounds every request, packs small ones into 2 MiB
segments, carves 1-10 MiB ones out of 20 MiB segments, splits and coalesces blocks, and only returns memory to
the driver when an allocation would otherwise fail. The estimator replays the captured storage allocations
through this model to get *reserved* memory (what ``nvidia-smi`` sees, less the CUDA context), its peak, and
whether the run would hit an OOM on a given capacity.

What is modelled, each named after the C++ function it follows:
``round_size`` / ``roundup_power2_next_division``, ``get_pool``, ``get_allocation_size``, ``get_free_block``
(best fit by (stream, size) with the max_split_size / max_non_split_rounding rules and the expandable-size
look-ahead), ``should_split``, ``alloc_found_block``, ``free_block`` / ``try_merge_blocks``, ``alloc_block``
with the OOM path (``release_available_cached_blocks`` then ``release_cached_blocks`` and a retry),
``garbage_collect_cached_blocks`` (only active under a memory fraction, as in PyTorch), expandable segments
(``find_expandable_block``, ``map_block``, ``try_allocate_expandable_block``, ``unmap_block``,
``release_blocks``), the statistics and the out-of-memory message.

Known limitations: a single device; no cross-stream ``record_stream`` events (blocks are reusable as soon as
they are freed); no CUDA-graph private pools; no ``cudaMallocAsync`` backend; the OOM message omits the NVML
per-process line unless ``process_overhead_bytes`` is given.

Configuration parsing follows ``c10/core/AllocatorConfig.{h,cpp}`` (``AcceleratorAllocatorConfig``) and
``c10/cuda/CUDAAllocatorConfig.cpp``.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

try:  # numpy is only used to hand back compact timelines
    import numpy as _np
except ImportError:  # pragma: no cover - numpy is an estimator dependency
    _np = None

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

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

# Key layout of the free-block sets: one int per block, ordered like BlockComparatorSize
# (stream, size, address). 56 bits per field keep the comparison a plain int compare.
_SHIFT = 56
_MASK = (1 << _SHIFT) - 1
_STREAM_SHIFT = 2 * _SHIFT
_BASE_ADDRESS = 0x7F00_0000_0000  # where simulated device addresses start (looks like a CUDA VA)
_ADDRESS_GAP = K_SMALL_BUFFER  # a hole between cudaMalloc'd segments, so they never look contiguous


class SimulatedOOM(RuntimeError):
    """Raised by :meth:`CachingAllocatorSim.malloc` when PyTorch would raise ``torch.OutOfMemoryError``."""

    def __init__(self, message: str, requested_bytes: int) -> None:
        super().__init__(message)
        self.requested_bytes = requested_bytes


# ---------------------------------------------------------------------------------------------------------
# Configuration: PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF
# ---------------------------------------------------------------------------------------------------------

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


def format_size(size: int) -> str:
    """c10::CachingAllocator::format_size, as used in the OOM message."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024.0:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576.0:.2f} MiB"
    return f"{size / 1073741824.0:.2f} GiB"


# ---------------------------------------------------------------------------------------------------------
# Blocks, pools, expandable segments
# ---------------------------------------------------------------------------------------------------------


class _Pool:
    """BlockPool: free mapped blocks ordered by (stream, size, address); unmapped ones by (stream, address)."""

    __slots__ = ("small", "keys", "by_key", "unmapped", "unmapped_by_key", "calls")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[int] = []
        self.by_key: dict[int, _Block] = {}
        self.unmapped: list[int] = []
        self.unmapped_by_key: dict[int, _Block] = {}
        self.calls = 0  # get_free_blocks_call_count, the garbage collector's clock

    def insert(self, b: "_Block") -> None:
        """BlockPool::insert_into_blocks."""
        k = (b.stream << _STREAM_SHIFT) | (b.size << _SHIFT) | b.addr
        insort(self.keys, k)
        self.by_key[k] = b
        b.gc_base = self.calls

    def remove(self, b: "_Block") -> None:
        k = (b.stream << _STREAM_SHIFT) | (b.size << _SHIFT) | b.addr
        del self.keys[bisect_left(self.keys, k)]
        del self.by_key[k]

    def insert_unmapped(self, b: "_Block") -> None:
        k = (b.stream << _SHIFT) | b.addr
        insort(self.unmapped, k)
        self.unmapped_by_key[k] = b

    def remove_unmapped(self, b: "_Block") -> None:
        k = (b.stream << _SHIFT) | b.addr
        del self.unmapped[bisect_left(self.unmapped, k)]
        del self.unmapped_by_key[k]


class _Block:
    """Block: a piece of a segment, free or allocated, linked to its neighbours in the segment."""

    __slots__ = ("addr", "size", "requested", "stream", "pool", "allocated", "prev", "next", "es", "mapped", "gc_base")

    def __init__(self, addr: int, size: int, stream: int, pool: _Pool, es: "_ExpandableSegment | None" = None) -> None:
        self.addr = addr
        self.size = size
        self.requested = 0
        self.stream = stream
        self.pool = pool
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.es = es
        self.mapped = True
        self.gc_base = 0

    def splice(self, before: "_Block | None", after: "_Block | None") -> None:
        """Block::splice: insert self between two neighbours."""
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after


class _ExpandableSegment:
    """ExpandableSegment: a reserved virtual range mapped page by page (2 MiB small pool, 20 MiB large)."""

    __slots__ = ("base", "page", "pages", "stream", "small")

    def __init__(self, base: int, page: int, n_pages: int, stream: int, small: bool) -> None:
        self.base = base
        self.page = page
        self.pages = bytearray(n_pages)  # 1 = mapped
        self.stream = stream
        self.small = small

    @property
    def size(self) -> int:
        return self.page * len(self.pages)

    def map_pages(self, ptr: int, size: int, free_physical: int) -> int:
        """ExpandableSegment::map: map the pages covering [ptr, ptr+size); 0 when out of memory."""
        begin = (ptr - self.base) // self.page
        end = -(-(ptr + size - self.base) // self.page)
        nbytes = (end - begin) * self.page
        if begin == end or nbytes > free_physical:
            return 0  # cuMemCreate failed: the pages created so far are released again
        for i in range(begin, end):
            self.pages[i] = 1
        return nbytes

    def unmap_pages(self, ptr: int, size: int) -> tuple[int, int]:
        """ExpandableSegment::unmap: unmap the whole pages inside [ptr, ptr+size); returns (start, bytes)."""
        begin = -(-(ptr - self.base) // self.page)
        end = (ptr + size - self.base) // self.page
        if begin >= end:
            return ptr, 0
        for i in range(begin, end):
            self.pages[i] = 0
        return self.base + begin * self.page, (end - begin) * self.page


# ---------------------------------------------------------------------------------------------------------
# The allocator
# ---------------------------------------------------------------------------------------------------------


class CachingAllocatorSim:
    """DeviceCachingAllocator for one device of ``capacity_bytes``, of which ``reserved_elsewhere`` is taken
    by something other than this allocator (CUDA context, cuBLAS handles, other tenants).

    ``memory_fraction`` mirrors ``torch.cuda.set_per_process_memory_fraction``: it caps reserved memory and
    is what enables ``garbage_collection_threshold`` (PyTorch only collects under a fraction). Without it,
    a ``per_process_memory_fraction`` below 1.0 in the configuration does the same.
    """

    def __init__(
        self,
        capacity_bytes: int,
        config: AllocatorConfig = AllocatorConfig(),
        reserved_elsewhere: int = 0,
        *,
        memory_fraction: float | None = None,
        keep_trace: bool = False,
        process_overhead_bytes: int | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if reserved_elsewhere < 0:
            raise ValueError(f"reserved_elsewhere must be >= 0, got {reserved_elsewhere}")
        if memory_fraction is not None and not 0.0 <= memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be within [0, 1], got {memory_fraction}")
        self.capacity_bytes = capacity_bytes
        self.config = config
        self.reserved_elsewhere = reserved_elsewhere
        self.process_overhead_bytes = process_overhead_bytes
        if memory_fraction is None and (config.per_process_memory_fraction or 1.0) < 1.0:
            memory_fraction = config.per_process_memory_fraction
        self._mss = config.max_split_size if config.max_split_size is not None else 1 << 62
        self._expandable = config.expandable_segments
        self._set_fraction = memory_fraction is not None
        self._allowed = int(memory_fraction * capacity_bytes) if memory_fraction is not None else capacity_bytes
        self._gc = self._set_fraction and (config.garbage_collection_threshold or 0.0) > 0.0
        self._plain_rounding = not any(config.roundup_power2_divisions)
        self._plain_search = not (self._gc or self._expandable)
        self._non_split_rounding = config.max_non_split_rounding_size
        self._small = _Pool(True)
        self._large = _Pool(False)
        self._live: dict[int, _Block] = {}
        self._segments: dict[int, tuple[int, int, bool]] = {}  # cudaMalloc base -> (size, stream, small pool)
        self._expandables: list[_ExpandableSegment] = []
        self._next_addr = _BASE_ADDRESS
        self._allocated = 0
        self._reserved = 0
        self._peak_allocated = 0
        self._peak_reserved = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self.oom = False
        self.oom_message: str | None = None
        self._trace: list[dict[str, Any]] | None = [] if keep_trace else None
        self._clock = 0

    # -- statistics --------------------------------------------------------------------------------------

    @property
    def allocated_bytes(self) -> int:
        """Bytes in blocks handed out (rounded sizes): torch.cuda.memory_allocated()."""
        return self._allocated

    @property
    def reserved_bytes(self) -> int:
        """Bytes of segments held from the driver: torch.cuda.memory_reserved()."""
        return self._reserved

    @property
    def peak_allocated_bytes(self) -> int:
        return self._peak_allocated

    @property
    def peak_reserved_bytes(self) -> int:
        return self._peak_reserved

    @property
    def num_segments(self) -> int:
        """cudaMalloc'd segments plus expandable segments with at least one mapped page.

        (An expandable segment whose first mapping failed keeps its address range reserved, as in PyTorch,
        and is reused by the next request on its stream; it holds no memory and is not counted.)"""
        return len(self._segments) + sum(1 for es in self._expandables if 1 in es.pages)

    @property
    def device_free_bytes(self) -> int:
        """What cudaMemGetInfo would report free."""
        return max(self.capacity_bytes - self.reserved_elsewhere - self._reserved, 0)

    def _reserve(self, nbytes: int) -> None:
        self._reserved += nbytes
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved

    def _record(self, action: str, addr: int, size: int, stream: int, **extra: Any) -> None:
        if self._trace is not None:
            self._clock += 1
            entry = {"action": action, "addr": addr, "size": size, "stream": stream,
                     "time_us": self._clock, "frames": []}
            entry.update(extra)
            self._trace.append(entry)

    # -- malloc ------------------------------------------------------------------------------------------

    def malloc(self, size: int, stream: int = 0) -> int:
        """DeviceCachingAllocator::malloc. Returns the block address as the handle (0 for a 0-byte request,
        which PyTorch serves with a null pointer). Raises SimulatedOOM when PyTorch would raise."""
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        if size == 0:
            return 0
        orig = size
        if self._plain_rounding:  # round_size without roundup_power2_divisions, inlined for speed
            size = K_MIN_BLOCK_SIZE if size < K_MIN_BLOCK_SIZE else (size + K_MIN_BLOCK_SIZE - 1) & -K_MIN_BLOCK_SIZE
        else:
            size = round_size(size, self.config)
        small = size <= K_SMALL_SIZE
        pool = self._small if small else self._large
        if self._plain_search:  # get_free_block without expandable segments or GC, inlined for speed
            block = None
            keys = pool.keys
            i = bisect_left(keys, (stream << _STREAM_SHIFT) | (size << _SHIFT))
            if i < len(keys):
                k = keys[i]
                if k >> _STREAM_SHIFT == stream:
                    bsize = (k >> _SHIFT) & _MASK
                    mss = self._mss
                    if (bsize < mss or size >= mss) and (size < mss or bsize < size + self._non_split_rounding):
                        del keys[i]
                        block = pool.by_key.pop(k)
        else:
            block = self._get_free_block(pool, size, stream)
        if block is None:
            alloc_size = allocation_size(size, self.config)
            if self._gc:
                self._garbage_collect_cached_blocks()
            block = self._alloc_block(pool, size, alloc_size, stream)
            if block is None and self._release_available_cached_blocks(pool, size, stream):
                block = self._alloc_block(pool, size, alloc_size, stream)
            if block is None:
                self._release_cached_blocks()
                self.num_alloc_retries += 1
                block = self._alloc_block(pool, size, alloc_size, stream)
            if block is None:
                self._raise_oom(size, alloc_size, stream)
        remaining = block.size - size
        if small or self._expandable:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            split = size < self._mss and remaining > K_SMALL_SIZE
        if split:  # alloc_found_block: the front becomes the allocation, the rest goes back to the pool
            rest = block
            block = _Block(rest.addr, size, stream, pool, rest.es)
            prev = rest.prev
            block.prev = prev
            if prev is not None:
                prev.next = block
            block.next = rest
            rest.prev = block
            rest.addr += size
            rest.size = remaining
            k = (stream << _STREAM_SHIFT) | (remaining << _SHIFT) | rest.addr  # BlockPool::insert_into_blocks
            insort(pool.keys, k)
            pool.by_key[k] = rest
            rest.gc_base = pool.calls
        block.allocated = True
        block.requested = orig
        self._allocated += block.size
        if self._allocated > self._peak_allocated:
            self._peak_allocated = self._allocated
        self._live[block.addr] = block
        if self._trace is not None:
            self._record("alloc", block.addr, orig, stream)
        return block.addr

    def _get_free_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """get_free_block: the smallest cached block of this stream that fits, within the oversize rules."""
        if self._gc:
            pool.calls += 1
        keys = pool.keys
        i = bisect_left(keys, (stream << _STREAM_SHIFT) | (size << _SHIFT))
        if i == len(keys):
            return None
        k = keys[i]
        if k >> _STREAM_SHIFT != stream:
            return None
        b = pool.by_key[k]
        if b.es is not None:
            if self._expandable:
                # Best fit counts the unmapped space after a block as part of its size.
                def expandable_size(x: _Block) -> int:
                    nxt = x.next
                    return x.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

                j = i + 1
                while b.es is not None and j < len(keys):
                    nk = keys[j]
                    if nk >> _STREAM_SHIFT != stream:
                        break
                    nb = pool.by_key[nk]
                    if expandable_size(nb) >= expandable_size(b):
                        break
                    i, k, b = j, nk, nb
                    j += 1
            else:  # expandable segments switched off later: only plain blocks qualify
                j = i + 1
                while j < len(keys) and (keys[j] >> _STREAM_SHIFT) == stream and pool.by_key[keys[j]].es is not None:
                    j += 1
                if j == len(keys) or (keys[j] >> _STREAM_SHIFT) != stream:
                    return None
                i, k, b = j, keys[j], pool.by_key[keys[j]]
        bsize = b.size
        mss = self._mss
        if size < mss and bsize >= mss:
            return None  # do not return an oversized block for a smaller request
        if size >= mss and bsize >= size + self.config.max_non_split_rounding_size:
            return None  # oversized blocks are only rounded up within max_non_split_rounding
        del keys[i]
        del pool.by_key[k]
        return b

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int, stream: int) -> _Block | None:
        """alloc_block: a new cudaMalloc'd segment (or mapped expandable pages), None when the device is full."""
        if self._set_fraction and self._reserved + alloc_size > self._allowed:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size, stream)
        if alloc_size > self.device_free_bytes:
            return None
        addr = self._next_addr
        self._next_addr += alloc_size + _ADDRESS_GAP
        block = _Block(addr, alloc_size, stream, pool)
        self._segments[addr] = (alloc_size, stream, pool.small)
        self._reserve(alloc_size)
        self.num_device_alloc += 1
        if self._trace is not None:
            self._record("segment_alloc", addr, alloc_size, stream)
        return block

    def _raise_oom(self, size: int, alloc_size: int, stream: int) -> None:
        """The TORCH_CHECK_WITH(OutOfMemoryError, ...) at the end of malloc."""
        device_free = self.device_free_bytes
        self.num_ooms += 1
        self._record("oom", 0, size, stream, device_free=device_free)
        proc = ""
        if self.process_overhead_bytes is not None:
            used = self._reserved + self.process_overhead_bytes
            proc = f"Including non-PyTorch memory, this process has {format_size(used)} memory in use. "
        allowed = f"{format_size(self._allowed)} allowed; " if self._set_fraction else ""
        message = (
            f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU 0 has a total capacity of "
            f"{format_size(self.capacity_bytes)} of which {format_size(device_free)} is free. {proc}{allowed}"
            f"Of the allocated memory {format_size(self._allocated)} is allocated by PyTorch, and "
            f"{format_size(self._reserved - self._allocated)} is reserved by PyTorch but unallocated. "
            "If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
            "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )
        self.oom = True
        self.oom_message = message
        raise SimulatedOOM(message, alloc_size)

    # -- free --------------------------------------------------------------------------------------------

    def free(self, handle: int) -> None:
        """DeviceCachingAllocator::free followed by free_block (no outstanding stream events)."""
        if handle == 0:
            return
        try:
            block = self._live.pop(handle)
        except KeyError:
            raise ValueError(f"invalid device pointer: {handle:#x} (not allocated or already freed)") from None
        block.allocated = False
        self._allocated -= block.size
        if self._trace is not None:
            self._record("free_requested", block.addr, block.requested, block.stream)
            self._record("free_completed", block.addr, block.requested, block.stream)
        pool = block.pool
        prev = block.prev
        if prev is not None and not prev.allocated and prev.mapped == block.mapped:
            self._merge(block, prev, pool)
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.mapped == block.mapped:
            self._merge(block, nxt, pool)
        k = (block.stream << _STREAM_SHIFT) | (block.size << _SHIFT) | block.addr  # BlockPool::insert_into_blocks
        insort(pool.keys, k)
        pool.by_key[k] = block
        block.gc_base = pool.calls

    def _try_merge(self, dst: _Block, src: _Block | None, pool: _Pool) -> int:
        """try_merge_blocks: absorb a free neighbour in the same mapping state; returns its size or 0."""
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        return self._merge(dst, src, pool)

    @staticmethod
    def _merge(dst: _Block, src: _Block, pool: _Pool) -> int:
        if src.mapped:
            k = (src.stream << _STREAM_SHIFT) | (src.size << _SHIFT) | src.addr
            keys = pool.keys
            del keys[bisect_left(keys, k)]
            del pool.by_key[k]
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # -- releasing cached memory -------------------------------------------------------------------------

    def empty_cache(self) -> None:
        """emptyCache -> release_cached_blocks: return every unsplit cached segment (and free pages)."""
        self._release_cached_blocks()

    def _release_cached_blocks(self) -> bool:
        self._release_blocks(self._large)
        self._release_blocks(self._small)
        return True

    def _release_blocks(self, pool: _Pool) -> None:
        """release_blocks: cudaFree unsplit free segments; unmap free pages of expandable ones."""
        to_unmap = []
        for k in list(pool.keys):
            b = pool.by_key.get(k)
            if b is None:
                continue
            if b.es is not None:
                to_unmap.append(b)
            elif b.prev is None and b.next is None:
                self._release_block(b)
        for b in to_unmap:
            self._unmap_block(b)
            if b.prev is None and b.next is None and not b.mapped:
                self._release_expandable_segment(b)

    def _release_block(self, b: _Block) -> None:
        """release_block: cudaFree one whole cached segment."""
        self.num_device_free += 1
        self._record("segment_free", b.addr, b.size, b.stream)
        self._reserved -= b.size
        b.pool.remove(b)
        del self._segments[b.addr]

    def _release_available_cached_blocks(self, pool: _Pool, size: int, stream: int) -> bool:
        """release_available_cached_blocks: free oversize (>= max_split_size) cached blocks, just enough."""
        if self.config.max_split_size is None:
            return False
        mss = self._mss
        key_size = mss if size < mss else size
        keys = pool.keys
        i = bisect_left(keys, (stream << _STREAM_SHIFT) | (key_size << _SHIFT))
        if i == len(keys) or keys[i] >> _STREAM_SHIFT != stream:
            if i == 0:
                return False
            released = 0
            i -= 1
            while released < key_size and i >= 0:
                b = pool.by_key[keys[i]]
                if b.size < mss or b.stream != stream or b.es is not None:
                    break
                released += b.size
                self._release_block(b)
                i -= 1
            return released >= key_size
        b = pool.by_key[keys[i]]
        if b.es is not None or b.prev is not None or b.next is not None:
            return False
        self._release_block(b)
        return True

    def _garbage_collect_cached_blocks(self) -> None:
        """garbage_collect_cached_blocks: free the oldest unsplit large blocks above the threshold."""
        threshold = int((self.config.garbage_collection_threshold or 0.0) * self._allowed)
        if self._reserved <= threshold:
            return
        target = self._reserved - threshold
        pool = self._large
        freeable = [pool.by_key[k] for k in pool.keys]
        freeable = [b for b in freeable if b.prev is None and b.next is None and b.es is None]
        if not freeable:
            return
        total_age = sum(pool.calls - b.gc_base for b in freeable)
        count = len(freeable)
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            threshold_age = total_age / count
            freed = False
            for b in [pool.by_key[k] for k in list(pool.keys)]:
                if b.prev is None and b.next is None and b.es is None:
                    age = pool.calls - b.gc_base
                    if age >= threshold_age:
                        freed = True
                        reclaimed += b.size
                        total_age -= age
                        count -= 1
                        self._release_block(b)

    # -- expandable segments -----------------------------------------------------------------------------

    def _page_size(self, pool: _Pool) -> int:
        return K_SMALL_BUFFER if pool.small else self.config.large_segment_size

    def _find_expandable_block(self, pool: _Pool, size: int, stream: int) -> _Block:
        """find_expandable_block: the lowest address with enough free+unmapped room, else a new segment."""

        def allocatable(b: _Block | None) -> bool:
            return b is not None and not b.allocated

        def has_room(b: _Block | None) -> bool:
            total = 0
            while total < size and allocatable(b):
                total += b.size  # type: ignore[union-attr]
                b = b.next  # type: ignore[union-attr]
            return total >= size

        keys = pool.unmapped
        i = bisect_left(keys, stream << _SHIFT)
        while i < len(keys) and keys[i] >> _SHIFT == stream:
            c = pool.unmapped_by_key[keys[i]]
            if allocatable(c.prev):
                c = c.prev  # type: ignore[assignment]
            if has_room(c):
                return c
            i += 1
        page = self._page_size(pool)
        address_space = self.capacity_bytes + self.capacity_bytes // 8
        es = _ExpandableSegment(self._next_addr, page, -(-address_space // page), stream, pool.small)
        self._next_addr += es.size + _ADDRESS_GAP
        self._expandables.append(es)
        candidate = _Block(es.base, es.size, stream, pool, es)
        candidate.mapped = False
        pool.insert_unmapped(candidate)
        return candidate

    def _map_block(self, to_map: _Block, size: int) -> bool:
        """map_block: back the start of an unmapped block with physical pages."""
        es = to_map.es
        assert es is not None and not to_map.mapped
        mapped = es.map_pages(to_map.addr, size, self.device_free_bytes)
        if mapped == 0:
            return False
        pool = to_map.pool
        start = to_map.addr
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = _Block(to_map.addr + mapped, to_map.size - mapped, to_map.stream, pool, es)
            rest.mapped = False
            rest.splice(to_map, to_map.next)
            pool.insert_unmapped(rest)
            to_map.size = mapped
        self._try_merge(to_map, to_map.prev, pool)
        self._try_merge(to_map, to_map.next, pool)
        pool.insert(to_map)
        self._reserve(mapped)
        self.num_device_alloc += 1
        self._record("segment_map", start, mapped, to_map.stream)
        return True

    def _try_allocate_expandable_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """try_allocate_expandable_block: grow a segment until a free run of ``size`` bytes exists."""
        c = self._find_expandable_block(pool, size, stream)
        if not c.mapped and not self._map_block(c, min(c.size, size)):
            return None
        while c.size < size:
            nxt = c.next
            assert nxt is not None
            if not self._map_block(nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt
        pool.remove(c)
        return c

    def _unmap_block(self, block: _Block) -> None:
        """unmap_block: give back the whole pages of a free expandable block."""
        es = block.es
        assert es is not None
        start, nbytes = es.unmap_pages(block.addr, block.size)
        if nbytes == 0:
            return
        pool = block.pool
        pool.remove(block)
        before = start - block.addr
        if before > 0:
            bf = _Block(block.addr, before, block.stream, pool, es)
            bf.splice(block.prev, block)
            pool.insert(bf)
        after = block.size - (before + nbytes)
        if after > 0:
            af = _Block(start + nbytes, after, block.stream, pool, es)
            af.splice(block, block.next)
            pool.insert(af)
        block.addr = start
        block.size = nbytes
        block.mapped = False
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.insert_unmapped(block)
        self._reserved -= nbytes
        self.num_device_free += 1
        self._record("segment_unmap", start, nbytes, block.stream)

    def _release_expandable_segment(self, block: _Block) -> None:
        """release_expandable_segment: drop a segment that has no mapped page left."""
        es = block.es
        assert es is not None and block.size == es.size
        block.pool.remove_unmapped(block)
        self._expandables.remove(es)

    # -- snapshot ----------------------------------------------------------------------------------------

    def _all_blocks(self) -> list[_Block]:
        blocks = list(self._live.values())
        for pool in (self._small, self._large):
            blocks.extend(pool.by_key.values())
        return blocks

    def snapshot(self) -> dict[str, Any]:
        """The state in the format of ``torch.cuda.memory._snapshot()``, renderable by ``_memory_viz``.

        One segment per cudaMalloc'd segment, and one per contiguous mapped range of an expandable segment
        (as DeviceCachingAllocator::snapshot reports them). ``device_traces`` holds the recorded actions when
        the simulator was created with ``keep_trace=True``.
        """
        by_segment: dict[int, list[_Block]] = {}
        seg_starts = sorted(self._segments)
        expandable: dict[int, list[_Block]] = {}
        for b in self._all_blocks():
            if b.es is not None:
                expandable.setdefault(id(b.es), []).append(b)
            else:
                base = seg_starts[bisect_left(seg_starts, b.addr + 1) - 1]
                by_segment.setdefault(base, []).append(b)
        segments: list[dict[str, Any]] = []
        for base, blocks in by_segment.items():
            _size, stream, small = self._segments[base]
            blocks.sort(key=lambda x: x.addr)
            segments.append(self._segment_info(base, blocks, stream, small, False))
        es_by_id = {id(es): es for es in self._expandables}
        for es_id, blocks in expandable.items():
            es = es_by_id[es_id]
            blocks.sort(key=lambda x: x.addr)
            run: list[_Block] = []
            for b in blocks:
                if run and run[-1].addr + run[-1].size != b.addr:
                    segments.append(self._segment_info(run[0].addr, run, es.stream, es.small, True))
                    run = []
                run.append(b)
            if run:
                segments.append(self._segment_info(run[0].addr, run, es.stream, es.small, True))
        segments.sort(key=lambda s: s["address"])
        return {
            "segments": segments,
            "device_traces": [list(self._trace) if self._trace is not None else []],
            "allocator_settings": {
                "PYTORCH_CUDA_ALLOC_CONF": self.config.to_env_string(),
                "max_split_size": self.config.max_split_size if self.config.max_split_size is not None else -1,
                "garbage_collection_threshold": self.config.garbage_collection_threshold or 0.0,
                "expandable_segments": self.config.expandable_segments,
                "release_lock_on_cudamalloc": False,
                "pinned_num_register_threads": 1,
                "pinned_use_cuda_host_register": False,
                "roundup_power2_divisions": {
                    str(1 << i): d for i, d in enumerate(self.config.roundup_power2_divisions) if d
                },
            },
        }

    @staticmethod
    def _segment_info(address: int, blocks: list[_Block], stream: int, small: bool, expandable: bool) -> dict[str, Any]:
        out_blocks = []
        total = allocated = requested = 0
        for b in blocks:
            out_blocks.append(
                {
                    "address": b.addr,
                    "size": b.size,
                    "requested_size": b.requested if b.allocated else 0,
                    "state": "active_allocated" if b.allocated else "inactive",
                    "frames": [],
                }
            )
            total += b.size
            if b.allocated:
                allocated += b.size
                requested += b.requested
        return {
            "device": 0,
            "address": address,
            "total_size": total,
            "allocated_size": allocated,
            "active_size": allocated,
            "requested_size": requested,
            "stream": stream,
            "segment_type": "small" if small else "large",
            "segment_pool_id": (0, 0),
            "is_expandable": expandable,
            "frames": [],
            "blocks": out_blocks,
        }


# ---------------------------------------------------------------------------------------------------------
# Replay of a captured sequence
# ---------------------------------------------------------------------------------------------------------


@dataclass
class ReplayResult:
    """What a replay found. ``timeline_allocated``/``timeline_reserved`` hold the value after each event
    (numpy int64 arrays when numpy is available); ``peak_event_index`` is the first event at which reserved
    memory reached its peak. On OOM the replay stops at the failing event (a real run would crash there)."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    oom: bool
    oom_message: str | None
    timeline_allocated: Any
    timeline_reserved: Any
    peak_event_index: int
    peak_allocated_event_index: int = -1
    oom_event_index: int | None = None
    num_segments_at_end: int = 0
    unmatched_frees: int = 0
    snapshot: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def timeline(self) -> tuple[Any, Any]:
        """(allocated, reserved) per event index."""
        return self.timeline_allocated, self.timeline_reserved


def replay(
    events: Iterable[tuple[str, int, int, int]],
    capacity_bytes: int,
    config: AllocatorConfig = AllocatorConfig(),
    reserved_elsewhere: int = 0,
    keep_trace: bool = False,
    *,
    memory_fraction: float | None = None,
) -> ReplayResult:
    """Replay ``("alloc", key, size, stream)`` / ``("free", key, 0, stream)`` events through the allocator.

    ``key`` names a storage; a free of a key that was never allocated (or a 0-byte allocation) is counted in
    ``unmatched_frees`` and otherwise ignored, because captures can start after some storages exist.
    ``("empty_cache", 0, 0, 0)`` events call ``torch.cuda.empty_cache()``. With ``keep_trace`` the result
    carries a ``_snapshot()``-format dict with the full action trace.
    """
    sim = CachingAllocatorSim(
        capacity_bytes, config, reserved_elsewhere, memory_fraction=memory_fraction, keep_trace=keep_trace
    )
    handles: dict[int, int] = {}
    alloc_tl: list[int] = []
    reserved_tl: list[int] = []
    push_a = alloc_tl.append
    push_r = reserved_tl.append
    malloc = sim.malloc
    free = sim.free
    pop = handles.pop
    unmatched = 0
    oom_at: int | None = None
    for kind, key, size, stream in events:
        if kind == "alloc":
            try:
                handles[key] = malloc(size, stream)
            except SimulatedOOM:
                oom_at = len(alloc_tl)
                break
        elif kind == "free":
            h = pop(key, None)
            if h is None:
                unmatched += 1
            elif h:
                free(h)
        elif kind == "empty_cache":
            sim.empty_cache()
        else:
            raise ValueError(
                f"event {len(alloc_tl)}: unknown kind {kind!r} (expected 'alloc', 'free' or 'empty_cache')"
            )
        push_a(sim._allocated)
        push_r(sim._reserved)
    # The first index of each maximum, found after the loop to keep the loop lean.
    if _np is not None:
        timeline_a: Any = _np.asarray(alloc_tl, dtype=_np.int64)
        timeline_r: Any = _np.asarray(reserved_tl, dtype=_np.int64)
        peak_r_at = int(_np.argmax(timeline_r)) if len(reserved_tl) else -1
        peak_a_at = int(_np.argmax(timeline_a)) if len(alloc_tl) else -1
    else:  # pragma: no cover
        timeline_a, timeline_r = alloc_tl, reserved_tl
        peak_r_at = reserved_tl.index(max(reserved_tl)) if reserved_tl else -1
        peak_a_at = alloc_tl.index(max(alloc_tl)) if alloc_tl else -1
    return ReplayResult(
        peak_allocated_bytes=sim.peak_allocated_bytes,
        peak_reserved_bytes=sim.peak_reserved_bytes,
        oom=sim.oom,
        oom_message=sim.oom_message,
        timeline_allocated=timeline_a,
        timeline_reserved=timeline_r,
        peak_event_index=peak_r_at,
        peak_allocated_event_index=peak_a_at,
        oom_event_index=oom_at,
        num_segments_at_end=sim.num_segments,
        unmatched_frees=unmatched,
        snapshot=sim.snapshot() if keep_trace else None,
    )


def replay_many(
    events: Iterable[tuple[str, int, int, int]],
    targets: Sequence[tuple[int, int]],
    config: AllocatorConfig = AllocatorConfig(),
    keep_trace: bool = False,
) -> list[ReplayResult]:
    """:func:`replay` for several ``(capacity_bytes, reserved_elsewhere)`` targets, sharing the work.

    Why it is exact: the allocator only looks at the device size when a cudaMalloc (or page mapping) fails.
    A replay on the roomiest target whose peak reserved memory fits every other target's room therefore
    makes the same decisions there, so its result is reused; only targets too small for that peak (where
    free-and-retry or an OOM changes the story) get their own replay. A per-process memory fraction ties
    the garbage collector to the capacity, so with one configured every target is replayed on its own.
    """
    seq = events if isinstance(events, (list, tuple)) else list(events)
    rooms = [capacity - elsewhere for capacity, elsewhere in targets]
    if not targets:
        return []
    if (config.per_process_memory_fraction or 1.0) < 1.0:
        return [replay(seq, c, config, e, keep_trace) for c, e in targets]
    roomiest = max(range(len(targets)), key=rooms.__getitem__)
    capacity, elsewhere = targets[roomiest]
    base = replay(seq, capacity, config, elsewhere, keep_trace)
    results = []
    for i, (capacity, elsewhere) in enumerate(targets):
        if i == roomiest or (not base.oom and base.peak_reserved_bytes <= rooms[i]):
            results.append(base)
        else:
            results.append(replay(seq, capacity, config, elsewhere, keep_trace))
    return results


__all__ = [
    "AllocatorConfig",
    "CachingAllocatorSim",
    "ReplayResult",
    "SimulatedOOM",
    "allocation_size",
    "format_size",
    "replay",
    "replay_many",
    "round_size",
    "roundup_power2_next_division",
]

