"""Replay of a captured allocation sequence through the caching-allocator model.

:func:`replay` drives one :class:`gpushare.estimator_cli.allocator.CachingAllocatorSim` over ``alloc`` / ``free`` /
``empty_cache`` events and reports peaks and timelines; :func:`replay_many` shares that work across targets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Iterable, Sequence

from gpushare.estimator_cli.allocator_config import AllocatorConfig

try:  # numpy is only used to hand back compact timelines
    import numpy

    _np: ModuleType | None = numpy
except ImportError:  # pragma: no cover - numpy is an estimator dependency
    _np = None


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
    # Imported here, not at the top: gpushare.estimator_cli.allocator re-exports this module's names.
    from gpushare.estimator_cli.allocator import CachingAllocatorSim, SimulatedOOM

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
