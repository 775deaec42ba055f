"""Expandable segments (``expandable_segments:True``): growing and shrinking a segment page by page.

The ``find_expandable_block`` / ``map_block`` / ``try_allocate_expandable_block`` / ``unmap_block`` /
``release_expandable_segment`` parts of ``DeviceCachingAllocator`` (``c10/cuda/CUDACachingAllocator.cpp``),
as a mixin of :class:`gpushare.estimator_cli.allocator.CachingAllocatorSim`: the methods use the simulator's pools,
statistics and trace.
"""

from __future__ import annotations

from bisect import bisect_left

from gpushare.estimator_cli.allocator_blocks import _ADDRESS_GAP, _SHIFT, _Block, _ExpandableSegment, _Pool
from gpushare.estimator_cli.allocator_config import K_SMALL_BUFFER
from gpushare.estimator_cli.allocator_state import _AllocatorState


class _ExpandableSegmentsMixin(_AllocatorState):
    """Expandable-segment paths; part of :class:`~gpushare.estimator_cli.allocator.CachingAllocatorSim`."""

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
