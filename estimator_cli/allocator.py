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

Layout: this module holds the simulator's core (:class:`CachingAllocatorSim`: statistics, ``malloc``,
``free``) and re-exports the rest, so ``from gpushare.estimator_cli.allocator import ...`` covers everything:
``allocator_config`` (``PYTORCH_CUDA_ALLOC_CONF``, constants, rounding), ``allocator_blocks`` (blocks, pools,
expandable segments), ``allocator_release`` (empty_cache, the OOM retry path, garbage collection),
``allocator_expandable`` (the expandable-segment paths), ``allocator_snapshot`` (``_snapshot()`` export) and
``allocator_replay`` (:func:`replay`, :func:`replay_many`, :class:`ReplayResult`). The mixins share a typed
base, ``allocator_state``, that declares the attributes and methods they use of one another.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any, NoReturn

from gpushare.estimator_cli.allocator_blocks import (
    _ADDRESS_GAP,
    _BASE_ADDRESS,
    _MASK,
    _SHIFT,
    _STREAM_SHIFT,
    _Block,
    _ExpandableSegment,
    _Pool,
)
from gpushare.estimator_cli.allocator_config import (  # noqa: F401 - constants and helpers are re-exported
    _IGNORED_KEYS,
    _LOG2_1MIB,
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_ROUNDUP_INTERVALS,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    AllocatorConfig,
    _is_pow2,
    _tokenize,
    allocation_size,
    round_size,
    roundup_power2_next_division,
)
from gpushare.estimator_cli.allocator_expandable import _ExpandableSegmentsMixin
from gpushare.estimator_cli.allocator_release import _CacheReleaseMixin
from gpushare.estimator_cli.allocator_replay import ReplayResult, replay, replay_many
from gpushare.estimator_cli.allocator_snapshot import _SnapshotMixin


class SimulatedOOM(RuntimeError):
    """Raised by :meth:`CachingAllocatorSim.malloc` when PyTorch would raise ``torch.OutOfMemoryError``."""

    def __init__(self, message: str, requested_bytes: int) -> None:
        super().__init__(message)
        self.requested_bytes = requested_bytes


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
# The allocator
# ---------------------------------------------------------------------------------------------------------


class CachingAllocatorSim(_CacheReleaseMixin, _ExpandableSegmentsMixin, _SnapshotMixin):
    """DeviceCachingAllocator for one device of ``capacity_bytes``, of which ``reserved_elsewhere`` is taken
    by something other than this allocator (CUDA context, cuBLAS handles, other tenants).

    ``memory_fraction`` mirrors ``torch.cuda.set_per_process_memory_fraction``: it caps reserved memory and
    is what enables ``garbage_collection_threshold`` (PyTorch only collects under a fraction). Without it,
    a ``per_process_memory_fraction`` below 1.0 in the configuration does the same.

    ``empty_cache`` and the cache-release paths come from ``allocator_release``, the expandable-segment
    paths from ``allocator_expandable`` and ``snapshot`` from ``allocator_snapshot``.
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

    def _raise_oom(self, size: int, alloc_size: int, stream: int) -> NoReturn:
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
