"""Other papers' published gains beside what the calibrated simulator gives for the closest setting it can run.

    python benchmarks/simulator_published.py [--seeds 0 1 2] [--jobs 150] [--load 1.0] [--workers N]

Reads simulator/data/published_gains.json (``gpushare.simulator.published``: each number with its paper, venue
and table or figure) and prints it. Then Gimbal's closest setting: a Philly-format synthetic trace
(benchmarks/simulator_scale.py: ``--jobs`` jobs of 1-8 GPUs, offered load ``--load``) on 32 GPUs, as Gimbal's
32-GPU testbed, but as 4 nodes x 8 A100-40GB (the catalogue has no A40, and the trace's 8-GPU jobs need
8-GPU nodes), ``--util carma-fit``. Gimbal measures "scheduler + Gimbal" against the same scheduler's own
packing; the nearest pairs here are free-competition packing (``gimbal-free``, two jobs per GPU, no caps)
against Gimbal's runtime recalibration for mean JCT (``gimbal-jct-runtime``) and for makespan
(``gimbal-makespan-runtime``); CARMA's MAGM (one job per GPU unless the risk filter admits a second, the
closest to Lucid's interference-averse packing) against the same; and Exclusive against ``gimbal-jct-runtime`` for Gimbal's "against Slurm".
Ratios as the paper gives them (baseline / system), mean over the trace seeds, per-seed range in brackets.
Nothing is fitted to the published numbers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpushare.simulator import batch, published  # noqa: E402
from gpushare.simulator.cli import THROUGHPUTS_NAME, data_dir  # noqa: E402
from gpushare.simulator.engine import SimConfig  # noqa: E402
from simulator_scale import synthetic_trace  # noqa: E402

POLICIES = ("exclusive", "magm", "gimbal-free", "gimbal-jct-runtime", "gimbal-makespan-runtime")
# (baseline, system, metric key, label, the published record's (system, baseline, metric) on Philly)
PAIRS = (
    ("gimbal-free", "gimbal-jct-runtime", "jct_mean_s", "mean JCT", ("Lucid + Gimbal", "Lucid", "mean JCT")),
    ("gimbal-free", "gimbal-jct-runtime", "wait_mean_s", "mean queuing time",
     ("Lucid + Gimbal", "Lucid", "mean queuing time")),
    ("gimbal-free", "gimbal-makespan-runtime", "makespan_s", "makespan", ("Gavel + Gimbal", "Gavel", "makespan")),
    ("magm", "gimbal-jct-runtime", "jct_mean_s", "mean JCT", ("Lucid + Gimbal", "Lucid", "mean JCT")),
    ("magm", "gimbal-makespan-runtime", "makespan_s", "makespan", ("Gavel + Gimbal", "Gavel", "makespan")),
    ("exclusive", "gimbal-jct-runtime", "jct_mean_s", "mean JCT", ("Lucid + Gimbal", "Slurm", "mean JCT")),
)


def print_published(records: list[published.Published]) -> None:
    print("| paper | where | system | baseline | setting | metric | published |")
    print("|---|---|---|---|---|---|---:|")
    for r in records:
        value = f"{r.value:g}x" if r.unit == "ratio" else f"{r.value:+g} %" if r.unit == "pct" else f"{r.value:g} {r.unit}"
        print(f"| {r.paper.split('(')[-1].rstrip(')')} ({r.venue.split(',')[0]}) | {r.where} | {r.system} | "
              f"{r.baseline} | {r.setting} | {r.metric} | {value} |")


def gimbal(records: list[published.Published], jobs: int, load: float, seeds: list[int],
           workers: int | None) -> None:
    data = data_dir(None)
    common = {"nodes": 4, "gpus_per_node": 8, "gpu": "a100-40gb", "util": "carma-fit",
              "throughputs": data / THROUGHPUTS_NAME}
    configs = [SimConfig(policy=p, estimator="oracle" if p != "exclusive" else "none", **common) for p in POLICIES]
    runs = []
    for seed in seeds:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "synthetic.csv"
            path.write_text(synthetic_trace(jobs, 32, load, seed))
            runs.append(dict(zip(POLICIES, batch.run_all(batch.Source(str(path)), configs, workers))))
    print(f"\nsimulated: {jobs} jobs, offered load {load}, 4 x 8 A100-40GB, --util carma-fit, trace seeds {seeds}\n")
    print("| comparison | metric | simulated (baseline / system) | published (Philly) | baseline mean | system mean |")
    print("|---|---|---:|---:|---:|---:|")
    by_key = {(r.system, r.baseline, r.metric): r for r in records if "Philly" in r.setting or r.baseline == "Slurm"}
    for base, system, key, label, ref in PAIRS:
        ratios = [run[base][key] / run[system][key] if run[system][key] > 0 else float("nan") for run in runs]
        paper = by_key.get(ref)
        shown = f"{paper.value:g}x ({ref[1]}{', Alibaba' if 'Alibaba' in paper.setting else ''})" if paper else ""
        unit = 3600 if key == "makespan_s" else 1
        print(f"| {base} -> {system} | {label} | {statistics.mean(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) "
              f"| {shown} | {statistics.mean(run[base][key] for run in runs) / unit:,.1f} "
              f"| {statistics.mean(run[system][key] for run in runs) / unit:,.1f} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=150)
    parser.add_argument("--load", type=float, default=1.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        records = published.load(data_dir(None) / published.NAME)
    except published.PublishedError as exc:
        print(exc, file=sys.stderr)
        return 2
    print_published(records)
    gimbal(records, args.jobs, args.load, args.seeds, args.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
