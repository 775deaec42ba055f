"""OOMs that hit a neighbour, with and without per-job memory caps, in the trace simulator.

Run: ``python benchmarks/neighbour_ooms.py [--seeds 0,1,2]``

Replays the built-in 60-job trace (``gpushare simulate``'s default) with the growth model: a job whose
true peak exceeds its share (estimate + margin) runs within it first and outgrows it after 20 % of its
work. Without caps it takes whatever memory is free (room reserved for neighbours still starting); with
caps (the agent's framework caps + backstop) it OOMs alone. Counted: every OOM, and those of jobs that
stayed within their own share (a neighbour's fault). Placement: Slurm's shard accounting
(``slurm-shards``), where the damage shows; estimates with 30 % noise and none at all.
"""

from __future__ import annotations

import argparse

from gpushare.simulator.cli import TRACE_NAME, data_dir
from gpushare.simulator.engine import SimConfig, Simulation
from gpushare.simulator.report import summarise
from gpushare.simulator.trace import read

SETUPS = [("a30-24gb", "noisy:0.3"), ("rtx3060-12gb", "noisy:0.3"), ("a100-40gb", "none"), ("a30-24gb", "none")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    print("| GPU | estimator | caps | OOMs | OOMs that hit a neighbour | completed | makespan h |")
    print("|---|---|---|---|---|---|---|")
    for gpu, estimator in SETUPS:
        for caps in (False, True):
            ooms = hit = done = 0
            makespan = 0.0
            for seed in seeds:
                jobs = read(data_dir(None) / TRACE_NAME, seed=seed)
                cfg = SimConfig(gpu=gpu, policy="slurm-shards", estimator=estimator, seed=seed, caps=caps,
                                interference="share", util="classes")  # as recorded in docs/benchmarks.md
                s = summarise(Simulation(jobs, cfg).run())
                ooms, hit, done = ooms + s["ooms"], hit + s["neighbour_ooms"], done + s["completed"]
                makespan += s["makespan_s"] / 3600 / len(seeds)
            print(f"| {gpu} | {estimator} | {'on' if caps else 'off'} | {ooms} | {hit} | {done}/{60 * len(seeds)} "
                  f"| {makespan:.2f} |")


if __name__ == "__main__":
    main()
