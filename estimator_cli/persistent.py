"""Persistent and ephemeral memory: the split of the reserved peak that Salus-style admission needs.

Why: a GPU shared by time slices at iteration boundaries must keep, for every job on it, what that job
holds *between* iterations (parameters, buffers, optimizer state, gradients kept by
``zero_grad(set_to_none=False)``, the cuBLAS workspaces, any cache the script keeps), while the rest of
its peak is needed only while one of its iterations runs and can be shared with the other jobs' iterations
(Salus, §3-4). docs/estimator.md defines the quantities; this module computes them from the replayed
allocation sequence.

Definitions (per target):
- An *iteration boundary* is the point after an optimizer step (a backward pass for scripts without an
  optimizer, estimator_cli/phases.py) and after whatever the script frees before its next iteration
  allocates: the state just before the first allocation made with that step count, or the end of the
  capture for the last step. The *steady state* is the boundaries after steps 1..N (optimizer state
  exists from step 1 on).
- A block is *persistent* when the same block is alive at every steady-state boundary. A batch, a loss
  or a set of gradients is alive at each boundary too, but a different one each time, so it is not.
- ``persistent_allocated_bytes``: the allocator model's allocated bytes of the persistent blocks.
- ``persistent_bytes``: what the allocator model still reserves at the first steady-state boundary once
  every other block is freed and the cache emptied — the segments (or mapped pages) holding persistent
  blocks. Blocks never move, so the value is the same at every boundary. This is the admission number:
  what must stay on the device between iterations, in the same units as the peak.
- ``ephemeral_bytes``: ``peak_reserved_bytes - persistent_bytes``, so the two add up to the peak.

With one captured step there is one boundary, and everything alive at it counts as persistent; with none
(a forward-only script) nothing is known to be released between iterations and the whole peak counts as
persistent, the safe side for admission.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpushare.estimator_cli.allocator_config import AllocatorConfig
from gpushare.estimator_cli.allocator_replay import replay
from gpushare.estimator_cli.orchestrate import Orchestrated

# Capacity for the split's own replay when the target's replay ran out of memory: the allocator looks at the
# device size only when a cudaMalloc fails, so a roomy device gives the decisions of a run that fits.
ROOMY_CAPACITY = 1 << 50


@dataclass(frozen=True)
class MemorySplit:
    """Bytes of one target's reserved peak that stay between iterations, and the rest."""

    persistent_allocated_bytes: int  # allocated bytes of the blocks alive at every steady-state boundary
    persistent_bytes: int  # reserved bytes the allocator keeps for those blocks (segments, mapped pages)
    ephemeral_bytes: int  # peak_reserved_bytes - persistent_bytes


def iteration_boundaries(orch: Orchestrated, steps: int) -> list[int]:
    """Event index (state right after it) of the boundary after each step 1..``steps``.

    The boundary after step k is just before the first allocation recorded with ``iteration >= k``; frees
    made between the step and that allocation (``zero_grad`` after ``step``, ``del loss``) are behind it.
    """
    first_alloc: dict[int, int] = {}
    for index, (op, key, _size, _stream) in enumerate(orch.events):
        if op == "alloc":
            first_alloc.setdefault(orch.allocs[key].iteration, index)
    last = len(orch.events) - 1
    boundaries = []
    for k in range(1, steps + 1):
        later = [index for iteration, index in first_alloc.items() if iteration >= k]
        boundaries.append(min(later) - 1 if later else last)
    return boundaries


def persistent_keys(orch: Orchestrated, boundaries: list[int]) -> set[int]:
    """Keys of the blocks alive at every boundary: allocated by the first and not freed by the last."""
    if not boundaries:
        return set()
    first, last = min(boundaries), max(boundaries)
    born: dict[int, int] = {}
    keys: set[int] = set()
    for index, (op, key, _size, _stream) in enumerate(orch.events):
        if op == "alloc":
            born[key] = index
        elif op == "free" and key in born:
            if born.pop(key) <= first and index > last:
                keys.add(key)
    keys.update(key for key, index in born.items() if index <= first)
    return keys


def _reserved_after_release(orch: Orchestrated, keep: set[int], boundary: int, capacity_bytes: int,
                            config: AllocatorConfig, reserved_elsewhere: int) -> tuple[int, int]:
    """(allocated, reserved) of the allocator model when, at ``boundary``, every block but ``keep`` is freed
    and the cache emptied: replays the same prefix, so the kept blocks sit where they sat in the estimate."""
    prefix = orch.events[: boundary + 1]
    live: dict[int, None] = {}
    for op, key, _size, _stream in prefix:
        if op == "alloc":
            live[key] = None
        else:
            live.pop(key, None)
    release = [("free", key, 0, 0) for key in live if key not in keep]
    result = replay(prefix + release + [("empty_cache", 0, 0, 0)], capacity_bytes, config, reserved_elsewhere)
    if result.oom or not len(result.timeline_reserved):
        return 0, 0
    return int(result.timeline_allocated[-1]), int(result.timeline_reserved[-1])


def split_peak(orch: Orchestrated, steps: int, peak: tuple[int, int], capacity_bytes: int,
               config: AllocatorConfig, reserved_elsewhere: int, oom: bool) -> MemorySplit:
    """The persistent/ephemeral split of the reserved peak (module docstring for the definitions).

    ``peak`` is the estimate's (allocated, reserved) peak pair.
    """
    peak_allocated_bytes, peak_reserved_bytes = peak
    boundaries = [b for b in iteration_boundaries(orch, steps) if b >= 0]
    if not boundaries:
        return MemorySplit(peak_allocated_bytes, peak_reserved_bytes, 0)
    keep = persistent_keys(orch, boundaries)
    capacity = ROOMY_CAPACITY if oom else capacity_bytes
    allocated, reserved = _reserved_after_release(orch, keep, min(boundaries), capacity, config,
                                                  reserved_elsewhere)
    persistent = min(reserved, peak_reserved_bytes)  # an OOM target's peak stops at the failure
    return MemorySplit(min(allocated, persistent), persistent, peak_reserved_bytes - persistent)
