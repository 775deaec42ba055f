"""MIG mixes in the style of MIGM §5.2: a batch on MIG via the planner's Scheme A and B vs whole GPUs.

Why a separate driver: MIG jobs do not share SMs, so there is no interference or risk to model; what
matters is the tightest profile (``gpushare.policy.profiles``), the planner's reconfigurations and how much
slower a job runs on a fraction of the GPU. The schemes themselves (``gpushare.policy.schemes``) are the
ones the node agent uses; this module only prepares their jobs and scores their results.

Slowdown on a slice: a job whose solo SMACT on the whole GPU is ``a`` needs ``a`` of the SMs; on a
profile with ``c`` of ``C`` compute slices it gets ``c/C`` and runs ``max(1, a·C/c)`` times longer
(compute-proportional; MIGM §5.2 notes data-transfer-bound jobs lose more, which this does not model).
Baseline: the batch run one job at a time per whole GPU, in queue order (MIGM §5's baseline).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpushare.gpus import GiB, GpuModel
from gpushare.policy import schemes
from gpushare.policy.profiles import tightest_profile
from gpushare.simulator.trace import JobSpec
from gpushare.simulator.workload import UTIL_CLASSES

MARGIN_FRACTION, MARGIN_MIN = 0.10, GiB  # gpushare's default sizing margin


def _full_slices(model: GpuModel) -> int:
    return max(p.compute_slices for p in model.mig_profiles)


def _energy(model: GpuModel, intervals: Sequence[tuple[int, float, float, float]], gpus: int, end: float) -> float:
    """Joules over [0, end] for all GPUs; intervals are (gpu, start, stop, SMACT contribution)."""
    lo, hi = model.power_w
    total = 0.0
    for gpu in range(gpus):
        mine = [i for i in intervals if i[0] == gpu]
        cuts = sorted({0.0, end, *(i[1] for i in mine), *(i[2] for i in mine)})
        for a, b in zip(cuts, cuts[1:]):
            load = min(1.0, sum(i[3] for i in mine if i[1] <= a and i[2] >= b))
            total += (lo + (hi - lo) * load) * (b - a)  # gpushare.gres.sim_timeline's power model
    return total


def run_mix(model: GpuModel, jobs: Sequence[JobSpec], gpus: int = 1) -> dict[str, Any]:
    """Scheme A, Scheme B and the sequential whole-GPU baseline on one batch (all jobs queued at t=0)."""
    full = _full_slices(model)
    specs, mig_jobs = {}, []
    for order, spec in enumerate(jobs):
        profile = tightest_profile(model, int(spec.mem_gib * GiB), margin_fraction=MARGIN_FRACTION,
                                   margin_min_bytes=MARGIN_MIN)
        smact = UTIL_CLASSES[spec.util][0]
        slow = 1.0 if profile is None else max(1.0, smact * full / profile.compute_slices)
        specs[spec.job_id] = (spec, profile, smact)
        mig_jobs.append(schemes.Job(spec.job_id, int(spec.mem_gib * GiB), float(order), spec.solo_s * slow))
    out: dict[str, Any] = {"gpu": model.name, "gpus": gpus, "jobs": len(jobs)}
    # baseline: whole GPUs, one job each, in queue order
    free_at = [0.0] * gpus
    intervals = []
    for spec in jobs:
        gpu = min(range(gpus), key=lambda g: (free_at[g], g))
        intervals.append((gpu, free_at[gpu], free_at[gpu] + spec.solo_s, UTIL_CLASSES[spec.util][0]))
        free_at[gpu] += spec.solo_s
    base_end = max(free_at)
    out["baseline"] = {"makespan_s": base_end, "throughput_jobs_per_h": len(jobs) / base_end * 3600,
                       "energy_mj": _energy(model, intervals, gpus, base_end) / 1e6}
    durations = {j.job_id: j.duration for j in mig_jobs}
    for name, run in (("A", schemes.scheme_a), ("B", schemes.scheme_b)):
        result = run(model, mig_jobs, gpus, margin_fraction=MARGIN_FRACTION, margin_min_bytes=MARGIN_MIN)
        intervals = []
        for start in result.starts:
            spec, profile, smact = specs[start.job_id]
            share = profile.compute_slices / full if profile else 1.0
            intervals.append((start.gpu, start.time, start.time + durations[start.job_id], min(share, smact)))
        done = len(result.starts)
        out[f"scheme_{name}"] = {
            "makespan_s": result.makespan,
            "throughput_jobs_per_h": done / result.makespan * 3600 if result.makespan else 0.0,
            "energy_mj": _energy(model, intervals, gpus, result.makespan) / 1e6,
            "reconfigurations": result.reconfigurations, "creates": result.creates, "destroys": result.destroys,
            "unschedulable": list(result.unschedulable),
        }
    return out
