"""What sharing gains with the utilisation fitted to CARMA's measured runs, against the assumed classes.

    python benchmarks/calibrated_gains.py [--jobs 2000] [--gpus 64] [--loads 0.5 1.0] [--workers N]

First table: CARMA's own two traces (simulator/data/carma_trace{1,2}.csv, 1 node x 3 A100-40GB) under
``--util carma-fit``, each run's change against Exclusive beside CARMA's measured change
(simulator/data/carma_targets.json) -- the calibration, as tests/simulator/test_carma_calibration.py pins it.
Second table: with that model fixed (not tuned to it), the deployed stack (``--policy live``, shipped
defaults, Slurm 22.05 first-fit and 24.11+ least-loaded) against Exclusive on benchmarks/simulator_scale.py's
synthetic trace (1-8 GPUs per job, nodes of 8 x A100-80GB, seed 0) at each offered load, under the assumed
classes and under the fit.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpushare.config import parse_config  # noqa: E402
from gpushare.simulator import batch  # noqa: E402
from gpushare.simulator.cli import THROUGHPUTS_NAME, data_dir  # noqa: E402
from gpushare.simulator.engine import SimConfig  # noqa: E402
from gpushare.simulator.live import setup  # noqa: E402
from simulator_scale import synthetic_trace  # noqa: E402

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


def synthetic(jobs: int, gpus: int, loads: list[float], workers: int | None) -> None:
    data = data_dir(None)
    print(f"\nsynthetic trace, {jobs:,} jobs, {gpus // 8} x 8 A100-80GB, seed 0: --policy live (shipped defaults) "
          "against Exclusive\n")
    print("| load | util | run | makespan h | vs excl. | mean JCT min | vs excl. | OOMs | failed |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for load in loads:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "synthetic.csv"
            path.write_text(synthetic_trace(jobs, gpus, load))
            for util in ("classes", "carma-fit"):
                common = {"nodes": gpus // 8, "gpus_per_node": 8, "gpu": "a100-80gb", "util": util,
                          "throughputs": data / THROUGHPUTS_NAME}
                configs, labels = [SimConfig(policy="exclusive", estimator="none", **common)], ["Exclusive"]
                for release, label in (("22.05", "live, 22.05"), ("24.11", "live, 24.11+")):
                    # 24.11+ as recorded in docs/benchmarks.md: LL_SHARED_GRES
                    live = setup(parse_config({}), release, "first-fit" if release == "22.05" else "least-loaded")
                    configs.append(SimConfig(policy="live", estimator="measured", caps=live.caps,
                                             recovery=live.recovery, live=live, **common))
                    labels.append(label)
                runs = batch.run_all(batch.Source(str(path)), configs, workers)
                base = runs[0]
                for label, r in zip(labels, runs):
                    print(f"| {load} | {util} | {label} | {r['makespan_s'] / 3600:.2f} | "
                          f"{r['makespan_s'] / base['makespan_s'] - 1:+.1%} | {r['jct_mean_s'] / 60:.1f} | "
                          f"{r['jct_mean_s'] / base['jct_mean_s'] - 1:+.1%} | {r['ooms']} | {r['failed']} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--loads", type=float, nargs="+", default=[0.5, 1.0])
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args(argv)
    calibration()
    synthetic(args.jobs, args.gpus, args.loads, args.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
