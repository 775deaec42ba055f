"""Giving cached memory back to the driver: ``empty_cache``, the OOM retry path and the garbage collector.

The ``release_*`` and ``garbage_collect_cached_blocks`` parts of ``DeviceCachingAllocator``
(``c10/cuda/CUDACachingAllocator.cpp``), as a mixin of :class:`gpushare.estimator_cli.allocator.CachingAllocatorSim`:
the methods use the simulator's pools, statistics and trace.
"""

from __future__ import annotations

from bisect import bisect_left

from gpushare.estimator_cli.allocator_blocks import _SHIFT, _STREAM_SHIFT, _Block, _Pool
from gpushare.estimator_cli.allocator_state import _AllocatorState


class _CacheReleaseMixin(_AllocatorState):
    """Releasing cached segments and pages; part of :class:`~gpushare.estimator_cli.allocator.CachingAllocatorSim`."""

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
