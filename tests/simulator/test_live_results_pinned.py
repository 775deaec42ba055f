"""``--policy live`` on a synthetic multi-node trace gives the results recorded here.

Why: the live stack's placement has fast paths (a GPU order kept sorted between events, walked only as far
as the answer needs); they must give exactly the placements of the plain scan. Recorded from the plain scan
(each GPU filtered, then sorted) before the fast path existed; ``python tests/simulator/test_live_results_pinned.py``
prints the current values.
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

VARIANTS = {"22.05": ("22.05", {}), "24.11": ("24.11", {}),
            "22.05-withheld": ("22.05", {"agent": {"withhold": "feature"}})}
PINNED: dict[str, dict[str, Any]] = {
    "22.05": {"makespan_s": 189331.574, "jct_mean_s": 7849.663, "ooms": 6,
              "placements_sha256": "7274782fd699931c339c480d193b6e17d1fbdcd8d828d5c014258fd5b7086ab8"},
    "22.05-withheld": {"makespan_s": 286336.231, "jct_mean_s": 51526.82, "ooms": 6,
                       "placements_sha256": "a6363b61d85cbab8d9e90faaeb027b7d8fed3aad0c8e054a6fc06969a035781c"},
    "24.11": {"makespan_s": 185458.382, "jct_mean_s": 3042.835, "ooms": 6,
              "placements_sha256": "58713bb78c537fc0535afcd3a0e8237a5759378eba00a0d89474a2e4e4d7d453"},
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
                       throughputs=data_dir(None) / THROUGHPUTS_NAME)
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
