"""MIG planner benchmark: table build time, planning decisions per second, Scheme A vs B reconfigurations.

Run: ``python benchmarks/mig_planner.py [--seed 0] [--decisions 20000] [--jobs 200] [--runs 5]``

Job mixes follow MIGM's evaluation: batches of jobs whose memory needs fall into the 5/10/20/40 GB classes
of an A100-40GB, in three proportions (small-heavy as in MIGM's Rodinia mixes, uniform, large-heavy),
durations uniform in [1, 10) time units, arrival order shuffled. Everything is seeded.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time

from gpushare.gpus import BUILTIN_GPUS, GiB
from gpushare.policy.fsm import MigSpace, build_table, fsm_table
from gpushare.policy.layout import Instance
from gpushare.policy.planner import plan
from gpushare.policy.profiles import all_profiles, select_profiles
from gpushare.policy.schemes import Job, scheme_a, scheme_b

MIXES = {  # GiB need -> weight: one need per A100-40GB class (1g, 2g, 3g, 7g; sized without margin)
    "small-heavy": {3: 6, 8: 2, 17: 1, 35: 1},
    "uniform": {3: 1, 8: 1, 17: 1, 35: 1},
    "large-heavy": {3: 1, 8: 1, 17: 2, 35: 2},
}


def bench_tables() -> list[str]:
    lines = []
    for name in ("a100-40gb", "h100-80gb", "a30-24gb"):
        model = BUILTIN_GPUS[name]
        sets = {"classic": select_profiles(model), "+1g double": select_profiles(model, extra_memory=True),
                "all (+me)": all_profiles(model)}
        for label, names in sets.items():
            t0 = time.perf_counter()
            table = build_table(MigSpace.of(model, names))
            ms = (time.perf_counter() - t0) * 1000
            lines.append(f"| {name} | {label} | {len(table.states) - 1} | {len(table.maximal)} | {ms:.1f} |")
    return lines


def bench_decisions(seed: int, count: int) -> tuple[float, float]:
    """plan() calls per second on random (layout, busy flags, 1-3 wants) scenarios; and the p50 in µs."""
    model = BUILTIN_GPUS["a100-40gb"]
    table = fsm_table(model, select_profiles(model))
    rng = random.Random(seed)
    names = [p.name for p in table.space.profiles]
    scenarios = []
    for _ in range(count):
        layout = sorted(rng.choice(table.maximal))
        kept = rng.sample(layout, rng.randint(0, len(layout)))
        current = tuple(Instance(n, s, rng.random() < 0.5) for n, s in kept)
        scenarios.append((current, [rng.choice(names) for _ in range(rng.randint(1, 3))]))
    samples = []
    t0 = time.perf_counter()
    for current, wants in scenarios:
        t = time.perf_counter()
        plan(model, current, wants)
        samples.append(time.perf_counter() - t)
    total = time.perf_counter() - t0
    return count / total, statistics.median(samples) * 1e6


def mix(seed: int, name: str, n: int) -> list[Job]:
    rng = random.Random(seed)
    sizes, weights = zip(*MIXES[name].items())
    needs = rng.choices(sizes, weights=weights, k=n)
    order = list(range(n))
    rng.shuffle(order)
    return [Job(f"j{i}", int(need * GiB), float(order[i]), rng.uniform(1, 10)) for i, need in enumerate(needs)]


def bench_schemes(seed: int, jobs: int, runs: int) -> list[str]:
    model = BUILTIN_GPUS["a100-40gb"]
    lines = []
    for name in MIXES:
        for gpus in (1, 4):
            a_rows, b_rows = [], []
            for run in range(runs):
                queue = mix(seed + run, name, jobs)
                a_rows.append(scheme_a(model, queue, gpus))
                b_rows.append(scheme_b(model, queue, gpus))

            def mean(rows: list, attr: str) -> float:
                return statistics.mean(getattr(r, attr) for r in rows)

            ops_a = statistics.mean(r.creates + r.destroys for r in a_rows)
            ops_b = statistics.mean(r.creates + r.destroys for r in b_rows)
            lines.append(f"| {name} | {gpus} | {mean(a_rows, 'reconfigurations'):.1f} | "
                         f"{mean(b_rows, 'reconfigurations'):.1f} | {ops_a:.1f} | {ops_b:.1f} | "
                         f"{mean(a_rows, 'makespan'):.1f} | {mean(b_rows, 'makespan'):.1f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decisions", type=int, default=20000)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"python {platform.python_version()} on {platform.machine()}, {platform.processor() or 'cpu'}")
    print("\nState-machine tables (cold build, one process):\n")
    print("| GPU | profiles | non-empty placement sets | maximal layouts | build ms |\n|---|---|---|---|---|")
    print("\n".join(bench_tables()))
    rate, p50 = bench_decisions(args.seed, args.decisions)
    print(f"\nPlanning decisions (A100-40GB, classic profiles, random layouts with busy flags, 1-3 wants): "
          f"{rate:,.0f} plan() calls/s, median {p50:.0f} µs per call ({args.decisions} calls)\n")
    print(f"Scheme A vs B, A100-40GB, {args.jobs} jobs per queue, mean over {args.runs} seeded queues "
          f"(reconfigurations = planner calls that changed a GPU's layout; ops = creates + destroys):\n")
    print("| mix | GPUs | reconf A | reconf B | ops A | ops B | makespan A | makespan B |\n"
          "|---|---|---|---|---|---|---|---|")
    print("\n".join(bench_schemes(args.seed, args.jobs, args.runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
