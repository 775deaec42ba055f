"""Estimator modes: what memory request a job carries into placement, given its true peak.

* ``oracle``: the true peak plus CARMA's 2 GB safety margin (CARMA §3.2, "Oracle").
* ``none``: no estimate; telemetry policies fall back to the 2 GB free-memory precondition and OOM
  recovery (CARMA §3.3, "Only Recovery"); Slurm's shard request is then that same 2 GiB.
* ``noisy:σ``: the true peak times ``1 + N(0, σ)`` (σ as a fraction, e.g. ``noisy:0.15``), plus
  gpushare's default margin (10 %, at least 1 GiB; ``[policy] margin_*`` in gpushare.toml).
* ``gpu-estimate``: ``noisy`` with σ = 0.08, a stand-in for the project's estimator until its measured
  error is recorded in docs/benchmarks.md; the margin is what absorbs under-estimates.

* ``measured``: ``noisy`` with gpu-estimate's measured error on CARMA's workloads (docs/benchmarks.md,
  *Estimator accuracy (cuDNN workspace model)*: median error +0.6 %, median |error| 3.3 %, 15 runs): a
  bias of +0.6 % and σ = 3.3 % / 0.6745 = 4.9 % (the median |error| of a normal error is 0.6745 σ).

Draws are seeded per (seed, job), so a job gets the same estimate on every run and on its retry.
"""

from __future__ import annotations

import math
import random

from gpushare.gpus import GiB

ORACLE_MARGIN_GIB = 2.0
NO_ESTIMATE_SHARDS = 2
GPU_ESTIMATE_SIGMA = 0.08
MEASURED_BIAS, MEASURED_SIGMA = 0.006, 0.033 / 0.6745


def parse(mode: str) -> tuple[str, float]:
    """Validate a mode string; returns (kind, sigma)."""
    mode = mode.strip().lower()
    if mode in ("oracle", "none"):
        return mode, 0.0
    if mode == "gpu-estimate":
        return "noisy", GPU_ESTIMATE_SIGMA
    if mode == "measured":
        return "measured", MEASURED_SIGMA
    if mode.startswith("noisy:"):
        try:
            sigma = float(mode.partition(":")[2])
        except ValueError:
            sigma = -1.0
        if 0.0 <= sigma <= 1.0:
            return "noisy", sigma
    raise ValueError(f"unknown estimator {mode!r}; use oracle, none, gpu-estimate, measured or noisy:SIGMA (0..1)")


def request_bytes(mode: str, peak_gib: float, job_id: str, seed: int,
                  margin: tuple[float, float] = (0.10, 1.0)) -> int | None:
    """Per-GPU memory request (estimate + margin) in bytes, or None for ``none``; ``margin``: the
    fraction and the least GiB added to a noisy estimate (``[policy] margin_*``)."""
    kind, sigma = parse(mode)
    if kind == "none":
        return None
    if kind == "oracle":
        return int((peak_gib + ORACLE_MARGIN_GIB) * GiB)
    rng = random.Random(f"{seed}:{job_id}")
    bias = MEASURED_BIAS if kind == "measured" else 0.0
    estimate = max(0.1, peak_gib * (1.0 + bias + rng.gauss(0.0, sigma)))
    return int((estimate + max(margin[0] * estimate, margin[1])) * GiB)


def shards_for(request: int | None, total_shards: int) -> int:
    """Slurm shard count (GiB, rounded up) for a request, capped at the GPU's shards."""
    if request is None:
        return min(NO_ESTIMATE_SHARDS, total_shards)
    return max(1, min(total_shards, math.ceil(request / GiB)))
