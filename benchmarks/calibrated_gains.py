"""What sharing gains with the utilisation fitted to CARMA's measured runs, against the assumed classes.

    python benchmarks/calibrated_gains.py [--jobs 2000] [--gpus 64] [--loads 0.5 1.0] [--seeds 0 1 2 3 4] [--workers N]

First table: CARMA's own two traces (simulator/data/carma_trace{1,2}.csv, 1 node x 3 A100-40GB) under
``--util carma-fit``, each run's change against Exclusive beside CARMA's measured change
(simulator/data/carma_targets.json) -- the calibration, as tests/simulator/test_carma_calibration.py pins it.
Second table: with that model fixed (not tuned to it), the deployed stack (``--policy live``, shipped
defaults with the advised shard placement, and 24.11+ with LL_SHARED_GRES) against Exclusive on
benchmarks/simulator_scale.py's synthetic trace (1-8 GPUs per job, nodes of 8 x A100-80GB) at each offered load,
under the assumed classes and under the fit, as the mean change over the trace seeds and its range.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpushare.config import parse_config  # noqa: E402
from gpushare.simulator.cli import THROUGHPUTS_NAME, data_dir  # noqa: E402
from gpushare.simulator.engine import SimConfig  # noqa: E402
from gpushare.simulator.live import setup  # noqa: E402
from simulator_scale import replay_synthetic  # noqa: E402

CARMA_MEASURED = {(1, "rr/none"): "-30.6", (1, "lug/none"): "-35.2", (1, "magm/none"): "close to LUG",
                  (1, "magm/oracle"): "up to -36"}


def calibration() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "simulator"))
    from test_carma_calibration import calibrated_table

    for util in ("classes", "carma-fit"):
        table = calibrated_table(util)
        print(f"\nCARMA's traces, --util {util}: change against Exclusive, %\n")
        print("| trace | run | makespan | CARMA measured | p95 JCT | mean JCT | energy (linear) | energy (SMACT^0.7) |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for number, rows in table.items():
            ex = rows["exclusive"]
            print(f"| T{number} | Exclusive (absolute) | {ex[0] / 3600:.2f} h | | {ex[1] / 60:.0f} min | "
                  f"{ex[2] / 60:.0f} min | {ex[3]:.1f} MJ | {ex[4]:.1f} MJ |")
            for run, v in rows.items():
                if run != "exclusive":
                    print(f"| T{number} | {run} | {v[0]:+.1f} | {CARMA_MEASURED.get((number, run), '')} | {v[1]:+.1f} | "
                          f"{v[2]:+.1f} | {v[3]:+.1f} | {v[4]:+.1f} |")


def _cell(changes: list[float]) -> str:
    """Mean change and its range over the seeds."""
    if len(changes) == 1:
        return f"{changes[0]:+.1%}"
    return f"{mean(changes):+.1%} ({min(changes):+.1%} to {max(changes):+.1%})"


def synthetic(jobs: int, gpus: int, loads: list[float], workers: int | None, seeds: list[int]) -> None:
    data = data_dir(None)
    print(f"\nsynthetic trace, {jobs:,} jobs, {gpus // 8} x 8 A100-80GB, trace seeds {seeds}: --policy live "
          "(shipped defaults) against Exclusive, change as mean over the seeds (range in brackets)\n")
    print("| load | util | run | makespan | mean JCT | OOMs | failed |")
    print("|---:|---|---|---:|---:|---:|---:|")
    # the shipped defaults with the advised shard placement (first-fit with share_when = "queued" on every
    # release, so 22.05's run is 24.11+'s too), and 24.11+ at a site that keeps LL_SHARED_GRES
    lives = (("live, shipped (22.05 and 24.11+, first-fit)", setup(parse_config({}), "22.05")),
             ("live, 24.11+ with LL_SHARED_GRES", setup(parse_config({}), "24.11", "least-loaded")))
    for load in loads:
        for util in ("classes", "carma-fit"):
            common = {"nodes": gpus // 8, "gpus_per_node": 8, "gpu": "a100-80gb", "util": util,
                      "throughputs": data / THROUGHPUTS_NAME}
            configs = [SimConfig(policy="exclusive", estimator="none", **common)]
            configs += [SimConfig(policy="live", estimator="measured", caps=live.caps, recovery=live.recovery,
                                  live=live, **common) for _, live in lives]
            per_seed = []
            for seed in seeds:
                per_seed.append(replay_synthetic(configs, jobs, gpus, load, seed, workers))
            base = [runs[0] for runs in per_seed]
            print(f"| {load} | {util} | Exclusive | {mean(b['makespan_s'] for b in base) / 3600:.2f} h | "
                  f"{mean(b['jct_mean_s'] for b in base) / 60:.1f} min | | |", flush=True)
            for k, (label, _) in enumerate(lives, start=1):
                span = [runs[k]["makespan_s"] / runs[0]["makespan_s"] - 1 for runs in per_seed]
                jct = [runs[k]["jct_mean_s"] / runs[0]["jct_mean_s"] - 1 for runs in per_seed]
                print(f"| {load} | {util} | {label} | {_cell(span)} | {_cell(jct)} | "
                      f"{sum(runs[k]['ooms'] for runs in per_seed)} | {sum(runs[k]['failed'] for runs in per_seed)} |",
                      flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--loads", type=float, nargs="+", default=[0.5, 1.0])
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="trace seeds of the synthetic trace")
    parser.add_argument("--no-calibration", action="store_true", help="skip the table on CARMA's traces")
    args = parser.parse_args(argv)
    if not args.no_calibration:
        calibration()
    synthetic(args.jobs, args.gpus, args.loads, args.workers, args.seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
