"""``--policy live`` on a synthetic multi-node trace gives the results recorded here.

Why: the live stack's placement has fast paths (a GPU order kept sorted between events, walked only as far
as the answer needs); they must give exactly the placements of the plain scan. Recorded from the plain scan
(each GPU filtered, then sorted) before the fast path existed; ``python tests/simulator/test_live_results_pinned.py``
prints the current values. Recorded again (fast path and plain scan agreeing) when ``--policy live`` began to
keep jobs of several GPUs whole, as the submit decision does, and to gate sharing on the queue.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from typing import Any

import pytest

from gpushare.config import parse_config
from gpushare.simulator import report, trace
from gpushare.simulator.cli import THROUGHPUTS_NAME, data_dir
from gpushare.simulator.engine import SimConfig
from gpushare.simulator.live import setup
from gpushare.simulator.runner import simulation

# shared whatever the queue, as many jobs per GPU as memory allows: the placement paths at work
ALWAYS = {"policy": {"share_when": "always", "max_jobs_per_gpu": 0}}
VARIANTS = {"22.05": ("22.05", ALWAYS), "24.11": ("24.11", ALWAYS),
            "22.05-withheld": ("22.05", {**ALWAYS, "agent": {"withhold": "feature"}}),
            "22.05-queued": ("22.05", {"policy": {"share_when": "queued", "max_jobs_per_gpu": 0}})}
PINNED: dict[str, dict[str, Any]] = {
    "22.05": {"makespan_s": 187480.28, "jct_mean_s": 4158.872, "ooms": 3,
             "placements_sha256": "5d3b8d5530024240315a702b003d7d05298ca6ad1431c05af346bbd90e6eb63c"},
    "22.05-queued": {"makespan_s": 185092.2, "jct_mean_s": 3003.01, "ooms": 1,
                    "placements_sha256": "ba41b4b08ad4ae704984804d2624aab66532d7fd271a3f00576e97812394134b"},
    "22.05-withheld": {"makespan_s": 200489.198, "jct_mean_s": 7604.819, "ooms": 3,
                      "placements_sha256": "489c00e99f2d8fc437a0fe7556ac09c8a41c2ecb849c42c61675cf0bccd2d4b6"},
    "24.11": {"makespan_s": 186401.684, "jct_mean_s": 3090.92, "ooms": 3,
             "placements_sha256": "db1874e18fb365c0dfa142f48b790922f8a3d66c42a8829fb53798cf64ee4941"},
}


def synthetic(jobs: int = 600, gpus: int = 32, load: float = 0.9, seed: int = 3) -> str:
    """Philly-format arrivals (as benchmarks/simulator_scale.py): exponential gaps, 1-8 GPUs per job."""
    rng = random.Random(seed)
    tasks = [rng.choice((1, 1, 1, 1, 2, 2, 4, 8)) for _ in range(jobs)]
    return "".join(f"{rng.expovariate(gpus * load / 9000.0):.1f},{t}\n" for t in tasks)


def run(variant: str) -> dict[str, Any]:
    release, settings = VARIANTS[variant]
    live = setup(parse_config(settings), release)
    config = SimConfig(nodes=4, gpus_per_node=8, gpu="a100-80gb", policy="live", estimator="measured",
                       caps=live.caps, recovery=live.recovery, live=live,
                       throughputs=data_dir(None) / THROUGHPUTS_NAME, util="classes")
    sim = simulation(trace.parse(synthetic(), "synthetic", 0), config).run()
    summary = report.summarise(sim)
    placements = sorted((j.spec.job_id, list(j.gpus), round(j.first_start or -1.0, 6)) for j in sim.jobs.values())
    return {"makespan_s": round(summary["makespan_s"], 3), "jct_mean_s": round(summary["jct_mean_s"], 3),
            "ooms": summary["ooms"], "placements_sha256": hashlib.sha256(json.dumps(placements).encode()).hexdigest()}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_live_results_are_as_recorded(variant):
    assert run(variant) == PINNED[variant]


if __name__ == "__main__":
    json.dump({v: run(v) for v in sorted(VARIANTS)}, sys.stdout, indent=1)
