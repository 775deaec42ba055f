"""The state the caching-allocator model's mixins share: a typed base for them.

Why: :class:`gpushare.estimator_cli.allocator.CachingAllocatorSim` is split over mixins (``allocator_release``,
``allocator_expandable``, ``allocator_snapshot``) whose methods read the simulator's pools, statistics and
trace and call each other. This base declares those attributes and methods once, so each mixin type-checks
on its own and a renamed attribute is an error in every part. The declarations are annotations and
``TYPE_CHECKING``-only stubs: nothing here exists at run time, so the method resolution order and the
instances' attributes are exactly :class:`CachingAllocatorSim`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpushare.estimator_cli.allocator_blocks import _Block, _ExpandableSegment, _Pool
from gpushare.estimator_cli.allocator_config import AllocatorConfig


class _AllocatorState:
    """What CachingAllocatorSim sets in ``__init__`` and the mixins use (see CachingAllocatorSim for meaning)."""

    capacity_bytes: int
    config: AllocatorConfig
    _mss: int  # max_split_size, or 1 << 62 without one
    _allowed: int  # the memory-fraction cap on reserved bytes (capacity without a fraction)
    _small: _Pool
    _large: _Pool
    _live: dict[int, _Block]
    _segments: dict[int, tuple[int, int, bool]]  # cudaMalloc base -> (size, stream, small pool)
    _expandables: list[_ExpandableSegment]
    _next_addr: int
    _reserved: int
    num_device_alloc: int
    num_device_free: int
    _trace: list[dict[str, Any]] | None

    if TYPE_CHECKING:  # defined by CachingAllocatorSim or another mixin; stubs for the type checker only

        @property
        def device_free_bytes(self) -> int: ...

        def _reserve(self, nbytes: int) -> None: ...

        def _record(self, action: str, addr: int, size: int, stream: int, **extra: Any) -> None: ...

        def _try_merge(self, dst: _Block, src: _Block | None, pool: _Pool) -> int: ...

        def _unmap_block(self, block: _Block) -> None: ...

        def _release_expandable_segment(self, block: _Block) -> None: ...
