"""GPU allocation ratio and fragmentation of a finished run, as the GPU-sharing scheduling literature counts them.

Why after the run, from the job records: both are functions of which job held what share of which GPU
when, which every placed job's record has (``JobRun.gpus``, dispatch and end times, its shards), so the
engine's hot path carries no extra bookkeeping. An OOM-recovered job's first, failed attempt is not in its
record and is not counted (a few seconds of a few jobs).

* **Allocation ratio**: the time-mean of what the scheduler has handed out, per GPU the allocated share
  (a shared job's shards over the GPU's; a job kept whole, or any job under ``exclusive``, the whole GPU),
  over all GPUs. **Demand served**: the same with each job's own ask (``share`` of the job: what the task
  needs, e.g. ``gpu_milli``), so that Exclusive's whole GPUs for half-GPU tasks count as half used.
* **Fragmentation** (after FGD, "Beware of Fragmentation", USENIX ATC '23, §3): the free GPU capacity of a
  node that a task drawn from the trace's own mix of (GPUs, share) could not use, averaged over that mix:
  for a task of a fraction ``s`` of one GPU, the free parts smaller than ``s`` (all of the node's free
  capacity if no GPU has ``s`` free); for a task of ``g`` whole GPUs, the free parts of partly used GPUs
  (all of it if fewer than ``g`` GPUs are wholly free). GPU dimension only: the simulator has no CPU or
  host memory to run out of. Sampled at ``samples`` evenly spaced times of the window; reported as a share
  of the free capacity and as a share of all GPUs.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Callable

from gpushare.simulator.engine import JobRun, Simulation

EPS = 1e-9


def _allocated(sim: Simulation, job: JobRun) -> float:
    """The share of each of its GPUs the scheduler handed this job (the engine's ``_try_place``)."""
    if job.recovered or job.whole or not sim.policy.collocates:
        return 1.0
    return min(1.0, job.shards / sim.gpus[0].shards_total)


def measure(sim: Simulation, share: Callable[[JobRun], float], window_s: float | None = None,
            samples: int = 100) -> dict[str, float]:
    """Allocation ratio, demand served, busy GPUs and fragmentation of ``sim`` over ``[0, window_s]``
    (default: up to the last arrival), with ``share(job)`` the fraction of a GPU each job asked for."""
    jobs = list(sim.jobs.values())
    end_of_window = window_s if window_s is not None else max(j.spec.submit_s for j in jobs)
    end_of_window = max(end_of_window, 1.0)
    gpus, per_node = len(sim.gpus), sim.config.gpus_per_node
    events: list[tuple[float, int, int, float]] = []  # (time, +1 start / -1 end, GPU, allocated share)
    allocated_s = demand_s = 0.0
    for job in jobs:
        if not job.gpus or job.end is None:
            continue
        start, stop = job.dispatched_t, min(job.end, end_of_window)
        if stop <= start:
            continue
        a = _allocated(sim, job)
        allocated_s += a * len(job.gpus) * (stop - start)
        demand_s += min(1.0, share(job)) * len(job.gpus) * (stop - start)
        for g in job.gpus:
            events.append((start, 1, g, a))
            events.append((stop, -1, g, a))
    heapq.heapify(events)
    used = [0.0] * gpus
    holders = [0] * gpus
    busy = 0
    busy_s = 0.0
    last = 0.0
    mix = Counter((j.spec.gpus, round(min(1.0, share(j)), 3)) for j in jobs)
    total = sum(mix.values())
    weights = [(g, s, n / total) for (g, s), n in sorted(mix.items())]
    fragmented = free_total = 0.0
    times = [end_of_window * (k + 1) / samples for k in range(samples)]
    for t in times:
        while events and events[0][0] <= t:
            when, sign, g, a = heapq.heappop(events)
            busy_s += busy * (when - last)
            last = when
            was = holders[g] > 0
            holders[g] += sign
            used[g] = max(0.0, used[g] + sign * a) if holders[g] else 0.0
            busy += (holders[g] > 0) - was
        busy_s += busy * (t - last)
        last = t
        frag, free = _fragmentation(used, per_node, weights)
        fragmented += frag
        free_total += free
    return {
        "allocation_ratio": allocated_s / (gpus * end_of_window),
        "demand_served": demand_s / (gpus * end_of_window),
        "busy_gpus": busy_s / (gpus * end_of_window),
        "fragmented_of_free": fragmented / free_total if free_total else 0.0,
        "fragmented_of_all": fragmented / (gpus * samples),
    }


def _fragmentation(used: list[float], per_node: int, weights: list[tuple[int, float, float]]) -> tuple[float, float]:
    """(fragmented capacity, free capacity) of the cluster now, in GPUs, against the task mix ``weights``."""
    fragmented = free_total = 0.0
    for first in range(0, len(used), per_node):
        node = used[first:first + per_node]
        free = sorted(max(0.0, 1.0 - u) for u in node)
        node_free = sum(free)
        free_total += node_free
        if node_free < EPS or all(f > 1.0 - EPS for f in free):
            continue  # nothing free, or nothing used: no fragment for any task
        whole = len(free) - bisect.bisect_left(free, 1.0 - EPS)
        partial_free = node_free - whole  # free parts of GPUs partly used
        for g, s, p in weights:
            if s < 1.0 and g == 1:
                if free[-1] < s - EPS:
                    fragmented += p * node_free
                else:
                    fragmented += p * sum(f for f in free if f < s - EPS)
            else:
                fragmented += p * (node_free if whole < g else partial_free)
    return fragmented, free_total
