"""The simulator's state as ``torch.cuda.memory._snapshot()`` reports it, renderable by ``_memory_viz``.

Follows ``DeviceCachingAllocator::snapshot`` (``c10/cuda/CUDACachingAllocator.cpp``), as a mixin of
:class:`gpushare.estimator_cli.allocator.CachingAllocatorSim`.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from gpushare.estimator_cli.allocator_blocks import _Block
from gpushare.estimator_cli.allocator_state import _AllocatorState


class _SnapshotMixin(_AllocatorState):
    """``snapshot()``; part of :class:`~gpushare.estimator_cli.allocator.CachingAllocatorSim`."""

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
        out_blocks: list[dict[str, Any]] = []
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
