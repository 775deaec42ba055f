"""Salus lanes and Gimbal thread caps against exclusive GPUs, MAGM and free-competition collocation.

    python benchmarks/salus_gimbal.py [--seeds 0 1 2] [--sweep-jobs 60] [--data-dir DIR]

Two workloads on 1 node x 3 A100-40GB (CARMA's setting): the Philly 60-job trace (arrivals over hours,
workloads drawn from the table per seed) and a hyper-parameter sweep of small CIFAR models submitted at
once (``gpushare.simulator.sweep``, seeded). Prints a Markdown table of the mean over seeds of makespan,
mean JCT and energy (the simulated backend's counters), and each one's change against Exclusive on the
same seed, then the runtime-recalibration policies' thread-cap switches. Gimbal "live" sets caps as the
node agent can with stock MPS (a starting job's share only); "runtime" re-coordinates running jobs too,
which needs Gimbal's CUDA context pool (simulator only). Models and assumptions: docs/simulator.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpushare.simulator import report, trace  # noqa: E402
from gpushare.simulator.cli import THROUGHPUTS_NAME, TRACE_NAME, data_dir  # noqa: E402
from gpushare.simulator.engine import SimConfig  # noqa: E402
from gpushare.simulator.runner import simulation  # noqa: E402
from gpushare.simulator.sweep import hyperparameter_sweep  # noqa: E402

RUNS = [  # (policy, label)
    ("exclusive", "Exclusive"),
    ("magm", "MAGM (CARMA, risk filter)"),
    ("gimbal-free", "Free-competition collocation (2/GPU)"),
    ("salus-pack", "Salus PACK"),
    ("salus-srtf", "Salus SRTF"),
    ("salus-fair", "Salus FAIR"),
    ("gimbal-jct", "Gimbal JCT, live (starting job's share)"),
    ("gimbal-makespan", "Gimbal makespan, live"),
    ("gimbal-jct-runtime", "Gimbal JCT, runtime recalibration"),
    ("gimbal-makespan-runtime", "Gimbal makespan, runtime recalibration"),
]
METRICS = (("makespan_s", 3600, "makespan h"), ("jct_mean_s", 60, "mean JCT min"), ("energy_mj", 1, "energy MJ"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sweep-jobs", type=int, default=60)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    data = data_dir(args.data_dir)
    started = time.monotonic()
    for workload in ("philly", "sweep"):
        rows: dict[str, list[dict]] = {policy: [] for policy, _ in RUNS}
        for seed in args.seeds:
            jobs = (trace.read(data / TRACE_NAME, seed=seed) if workload == "philly"
                    else hyperparameter_sweep(args.sweep_jobs, seed))
            for policy, _ in RUNS:
                config = SimConfig(policy=policy, seed=seed, throughputs=data / THROUGHPUTS_NAME,
                                   util="classes")  # as recorded in docs/benchmarks.md
                sim = simulation(jobs, config).run()
                rows[policy].append({**report.summarise(sim), "switches": getattr(sim, "reconfigurations", 0)})
        title = ("Philly 60-job trace" if workload == "philly"
                 else f"hyper-parameter sweep, {args.sweep_jobs} small-model jobs at t=0")
        print(f"\n### {title} (1 x 3 A100-40GB, seeds {' '.join(map(str, args.seeds))}, mean)\n")
        print("| policy | " + " | ".join(f"{label} | vs excl." for _, _, label in METRICS) + " | failed | OOMs |")
        print("|---|" + "---:|---:|" * len(METRICS) + "---:|---:|")
        base = rows["exclusive"]
        for policy, label in RUNS:
            cells = []
            for key, scale, _ in METRICS:
                value = statistics.mean(r[key] for r in rows[policy]) / scale
                change = statistics.mean(r[key] / b[key] - 1 for r, b in zip(rows[policy], base)) * 100
                cells += [f"{value:.2f}" if key != "jct_mean_s" else f"{value:.1f}", f"{change:+.0f} %"]
            failed = sum(r["failed"] for r in rows[policy])
            ooms = sum(r["ooms"] for r in rows[policy])
            print(f"| {label} (`{policy}`) | " + " | ".join(cells) + f" | {failed} | {ooms} |")
        switches = {policy: statistics.mean(r["switches"] for r in rows[policy]) for policy, _ in RUNS
                    if policy.endswith("-runtime")}
        print("\nthread-cap switches of running jobs per run (mean, 3.6 s each): "
              + ", ".join(f"`{p}` {n:.0f}" for p, n in switches.items()))
    print(f"\n({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
