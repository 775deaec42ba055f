"""A hyper-parameter sweep of small models: the workload where Salus reports its largest gain (§5.2).

Why a generator: the Philly trace has few small jobs and spreads arrivals over hours; a sweep submits
many short trials of small models at once, so GPUs are under-used by any one of them and packing pays.
Trials train the CIFAR models of the workload table (``workload.TABLE``, group "light") at a batch size
drawn from the table, for a number of epochs drawn from successive-halving rungs: most trials are
stopped early (Salus §5.2: "most of the generated models will be killed shortly after"), a few run long.
Seeded and deterministic: the same arguments give the same jobs.
"""

from __future__ import annotations

import random

from gpushare.simulator.trace import JobSpec, _ttfk
from gpushare.simulator.workload import TABLE

RUNGS: tuple[tuple[int, float], ...] = ((2, 0.67), (6, 0.22), (20, 0.11))  # (epochs, share of trials)
MODELS = ("resnet18", "resnet34", "mobilenetv3_small", "efficientnet_b0_cifar")


def _epochs(rng: random.Random) -> int:
    roll, acc = rng.random(), 0.0
    for epochs, share in RUNGS:
        acc += share
        if roll < acc:
            return epochs
    return RUNGS[-1][0]


def hyperparameter_sweep(jobs: int = 60, seed: int = 0, models: tuple[str, ...] = MODELS,
                         spacing_s: float = 0.0) -> list[JobSpec]:
    """``jobs`` single-GPU trials submitted ``spacing_s`` apart (all at once by default)."""
    if jobs < 1:
        raise ValueError("a sweep needs at least one job")
    rows = [w for w in TABLE.values() if w.model in models and w.gpus == 1]
    if not rows:
        raise ValueError(f"no workload rows for models {models}")
    rng = random.Random(seed)
    out = []
    for k in range(jobs):
        row = rows[rng.randrange(len(rows))]
        epochs = _epochs(rng)
        out.append(JobSpec(job_id=f"hp{k:03d}", submit_s=k * spacing_s, gpus=1, solo_s=row.solo_seconds(epochs),
                           mem_gib=row.mem_gib, util=row.util, ttfk_s=_ttfk(row.util, rng), model=row.model,
                           batch=row.batch, gavel=row.gavel))
    return out
