"""The deployed stack (``--policy live``) in its variants, against Exclusive and the SM-work bound.

    python benchmarks/live_stack.py [--seeds 0 1 2 3 4] [--workers N] [--synthetic 2000 64]

CARMA's setting (Philly 60-job trace, 1 node x 3 A100-40GB, default interference), as in
benchmarks/collocation_gain.py. Each row is a gpushare.toml choice on a Slurm release
(``gpushare.simulator.live``): the shipped defaults (etc/gpushare.toml: no withholding, fixed thread share,
framework caps and backstop, OOM recovery, 10 % / 1 GiB margin, whole GPU above 90 %), then one setting
changed at a time. Estimates carry gpu-estimate's measured error (``--estimator measured``). Printed: the
5-seed means, each seed's change against Exclusive on the same seed averaged, OOMs, recoveries, failed
jobs, and the share of the SM-work bound's makespan gain each row reaches.

``--synthetic JOBS GPUS``: the same variants on benchmarks/simulator_scale.py's synthetic trace (1-8 GPUs per
job, offered load 0.8) on nodes of 8 x A100-80GB, seed 0, where a node has more GPUs to withhold or not.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpushare.config import parse_config  # noqa: E402
from gpushare.simulator import batch, trace  # noqa: E402
from gpushare.simulator.cli import THROUGHPUTS_NAME, TRACE_NAME, data_dir  # noqa: E402
from gpushare.simulator.engine import SimConfig  # noqa: E402
from gpushare.simulator.live import setup  # noqa: E402
from gpushare.simulator.workload import UTIL_CLASSES  # noqa: E402

DEFAULTS = setup(parse_config({}), "22.05")
# the 24.11+ rows are LL_SHARED_GRES, as recorded in docs/benchmarks.md (not what slurm-config now advises)
_PLACEMENT = {"22.05": "first-fit", "24.11": "least-loaded"}
VARIANTS = [  # (label, release, changes to the shipped defaults)
    ("shipped defaults, 22.05 (first-fit)", "22.05", {}),
    ("shipped defaults, 24.11+ (LL_SHARED_GRES)", "24.11", {}),
    ("22.05, withhold = feature (any)", "22.05", {"withhold": "feature"}),
    ("22.05, withhold = feature, withhold_node_when = all", "22.05", {"withhold": "feature", "withhold_when": "all"}),
    ("24.11+, withhold = feature (any)", "24.11", {"withhold": "feature"}),
    ("22.05, thread_policy = gimbal-jct", "22.05", {"thread_policy": "gimbal-jct"}),
    ("24.11+, thread_policy = gimbal-jct", "24.11", {"thread_policy": "gimbal-jct"}),
    ("24.11+, gimbal-jct, withhold = feature (any)", "24.11", {"thread_policy": "gimbal-jct", "withhold": "feature"}),
    ("22.05, caps off (framework_caps = no, backstop = none)", "22.05", {"caps": False}),
]


def sm_work_bound(jobs: list[trace.JobSpec], gpus: int = 3) -> float:
    """Makespan if all the SM time the jobs need were packed perfectly onto the GPUs (5 % sharing overhead)."""
    return sum(j.solo_s * j.gpus * UTIL_CLASSES[j.util][0] for j in jobs) / (gpus * 0.95)


def synthetic(jobs: int, gpus: int, workers: int | None, data: Path) -> None:
    """The variants on a synthetic multi-node trace, one seed, against Exclusive."""
    import tempfile

    from simulator_scale import synthetic_trace

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "synthetic.csv"
        path.write_text(synthetic_trace(jobs, gpus, 0.8))
        common = {"nodes": gpus // 8, "gpus_per_node": 8, "gpu": "a100-80gb", "throughputs": data / THROUGHPUTS_NAME,
                  "util": "classes"}  # as recorded in docs/benchmarks.md
        configs = [SimConfig(policy="exclusive", estimator="none", **common)]
        for _, release, changes in VARIANTS:
            live = dataclasses.replace(setup(parse_config({}), release, _PLACEMENT[release]), **changes)
            configs.append(SimConfig(policy="live", estimator="measured", caps=live.caps, recovery=live.recovery,
                                     live=live, **common))
        runs = batch.run_all(batch.Source(str(path)), configs, workers)
    base = runs[0]
    print(f"synthetic trace, {jobs:,} jobs, {gpus // 8} x 8 A100-80GB, offered load 0.8, seed 0\n")
    print("| stack | makespan h | vs excl. | mean JCT min | vs excl. | energy MJ | vs excl. | OOMs | recovered | failed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, r in zip(["Exclusive"] + [v[0] for v in VARIANTS], runs):
        cells = []
        for key, scale in (("makespan_s", 3600), ("jct_mean_s", 60), ("energy_mj", 1)):
            cells += [f"{r[key] / scale:.2f}", f"{r[key] / base[key] - 1:+.1%}"]
        cells += [str(r[k]) for k in ("ooms", "recoveries", "failed")]
        print(f"| {label} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--synthetic", type=int, nargs=2, metavar=("JOBS", "GPUS"), default=None)
    args = parser.parse_args(argv)
    data = data_dir(None)
    started = time.perf_counter()
    if args.synthetic:
        synthetic(*args.synthetic, args.workers, data)
        print(f"\n({time.perf_counter() - started:.0f} s)")
        return 0
    common = {"nodes": 1, "gpus_per_node": 3, "gpu": "a100-40gb", "throughputs": data / THROUGHPUTS_NAME,
              "util": "classes"}  # as recorded in docs/benchmarks.md
    configs = [SimConfig(policy="exclusive", estimator="none", seed=s, **common) for s in args.seeds]
    for _, release, changes in VARIANTS:
        live = dataclasses.replace(setup(parse_config({}), release, _PLACEMENT[release]), **changes)
        configs += [SimConfig(policy="live", estimator="measured", seed=s, caps=live.caps, recovery=live.recovery,
                              live=live, **common) for s in args.seeds]
    runs = batch.run_all(batch.Source(str(data / TRACE_NAME)), configs, args.workers)
    n = len(args.seeds)
    base = runs[:n]
    bound = statistics.mean(sm_work_bound(trace.read(data / TRACE_NAME, seed=s)) / b["makespan_s"] - 1
                            for s, b in zip(args.seeds, base))
    print(f"Philly 60-job trace, 1 x 3 A100-40GB, seeds {args.seeds}; SM-work bound {bound:+.1%} makespan vs Exclusive\n")
    print("| stack | makespan h | vs excl. | share of bound | mean JCT min | vs excl. | energy MJ | vs excl. "
          "| OOMs | recovered | failed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = [("Exclusive", base)] + [(label, runs[n * (k + 1):n * (k + 2)]) for k, (label, _, _) in enumerate(VARIANTS)]
    for label, rs in rows:
        cells = []
        for key, scale in (("makespan_s", 3600), ("jct_mean_s", 60), ("energy_mj", 1)):
            change = statistics.mean(r[key] / b[key] - 1 for r, b in zip(rs, base))
            cells += [f"{statistics.mean(r[key] for r in rs) / scale:.2f}", f"{change:+.1%}"]
            if key == "makespan_s":
                cells.append(f"{change / bound:.0%}")
        cells += [f"{statistics.mean(r[k] for r in rs):.1f}" for k in ("ooms", "recoveries", "failed")]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"\n({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
