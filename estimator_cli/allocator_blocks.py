"""Blocks, block pools and expandable segments: the data structures of the caching-allocator model.

``_Block``, ``_Pool`` and ``_ExpandableSegment`` follow ``Block``, ``BlockPool`` and ``ExpandableSegment``
of ``c10/cuda/CUDACachingAllocator.cpp``; :class:`gpushare.estimator_cli.allocator.CachingAllocatorSim` owns them.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from gpushare.estimator_cli.allocator_config import K_SMALL_BUFFER

# Key layout of the free-block sets: one int per block, ordered like BlockComparatorSize
# (stream, size, address). 56 bits per field keep the comparison a plain int compare.
_SHIFT = 56
_MASK = (1 << _SHIFT) - 1
_STREAM_SHIFT = 2 * _SHIFT
_BASE_ADDRESS = 0x7F00_0000_0000  # where simulated device addresses start (looks like a CUDA VA)
_ADDRESS_GAP = K_SMALL_BUFFER  # a hole between cudaMalloc'd segments, so they never look contiguous


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
