"""Does sharing do no harm at every load: the deployed stack against Exclusive, mean JCT and energy.

    python benchmarks/do_no_harm.py [--jobs 2000] [--gpus 64] [--loads 0.3 0.5 0.8 1.0 1.2] [--workers N]
    python benchmarks/do_no_harm.py --best-of [--loads 1.0 1.2] [--seeds 0 1 2]
    python benchmarks/do_no_harm.py --util classes --shipped-only     # the shipped defaults under the other model

benchmarks/simulator_scale.py's synthetic trace (1-8 GPUs per job, nodes of 8 x A100-80GB, trace seeds 0-2) at
each offered load, utilisation fitted to CARMA's measured runs (``--util carma-fit``), Slurm 22.05 and
24.11+. Shard placement is what ``gpushare slurm-config`` advises (``gpushare.simulator.live.advised_placement``):
first-fit on 22.05, and on 24.11+ ``LL_SHARED_GRES`` (least-loaded) with ``share_when = "always"``, first-fit
with ``queued``; one more 24.11+ row, ``queued`` with ``LL_SHARED_GRES`` all the same, shows what a site that
keeps it gets. Rows: ``--policy live`` with the shipped defaults except the settings compared,
``[policy] share_when`` (``always``: shared whatever the queue; ``queued``: shared only while the job would
wait, ``gpushare.policy.share_gate``) and ``[policy] compute_sizing``; each against Exclusive on the same
trace. The goal: at every load, mean JCT and energy no worse than Exclusive + 2 %; at load >= 1.0, a gain.

``--best-of``: the queue-bound goal instead. At each load, ``--policy live`` with the shipped defaults
(``share_when = "queued"``, ``compute_sizing`` off, the advised shard placement: first-fit on both releases;
``--placement least-loaded`` for 24.11+ with ``LL_SHARED_GRES``) against Exclusive and against the best
of CARMA's policies with the oracle estimator (``magm``, ``lug``, ``ff``, ``bf``; ``rr`` has no memory
precondition, so no estimator), the runs docs/simulator.md (*Calibration*) calibrates; "% of best" is live's
gain over Exclusive as a share of the best policy's gain, for makespan and for mean JCT (each metric's own
best). The goal: at least 90 % at load >= 1.0.
"""

from __future__ import annotations

import argparse
import sys
from statistics import mean
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpushare.config import parse_config  # noqa: E402
from gpushare.simulator.cli import THROUGHPUTS_NAME, data_dir  # noqa: E402
from gpushare.simulator.engine import SimConfig  # noqa: E402
from gpushare.simulator.live import PLACEMENTS, setup  # noqa: E402
from gpushare.slurm.version import SlurmVersion  # noqa: E402
from simulator_scale import replay_synthetic  # noqa: E402

VARIANTS = (("always", False, "advised"), ("queued", False, "advised"), ("queued", True, "advised"))
LL_VARIANT = ("queued", False, "least-loaded")  # 24.11+ only: a site that keeps LL_SHARED_GRES
CARMA_RUNS = (("magm", "oracle"), ("lug", "oracle"), ("rr", "none"), ("ff", "oracle"), ("bf", "oracle"))


def table(jobs: int, gpus: int, loads: list[float], releases: list[str], seeds: list[int],
          workers: int | None, util: str = "carma-fit", variants: tuple = VARIANTS) -> None:
    data = data_dir(None)
    print(f"synthetic trace, {jobs:,} jobs, {gpus // 8} x 8 A100-80GB, trace seeds {seeds}, --util {util}: "
          "--policy live against Exclusive (change in %, mean over the seeds; range over the seeds in brackets)\n")
    print("| load | Slurm | share_when | compute_sizing | shards | mean JCT | energy | makespan | OOMs |")
    print("|---:|---|---|---|---|---:|---:|---:|---:|")
    common = {"nodes": gpus // 8, "gpus_per_node": 8, "gpu": "a100-80gb", "util": util,
              "throughputs": data / THROUGHPUTS_NAME}
    labels = []
    configs = [SimConfig(policy="exclusive", estimator="none", **common)]
    for release in releases:
        extra = (LL_VARIANT,) if SlurmVersion.parse(release).least_loaded_shared_gres and variants == VARIANTS else ()
        for share_when, sizing, placement in variants + extra:
            cfg = parse_config({"policy": {"share_when": share_when, "compute_sizing": sizing}})
            live = setup(cfg, release, placement)
            labels.append((release if release == "22.05" else f"{release}+", share_when, "on" if sizing else "off",
                           "least-loaded" if live.least_loaded else "first-fit"))
            configs.append(SimConfig(policy="live", estimator="measured", caps=live.caps, recovery=live.recovery,
                                     live=live, **common))
    for load in loads:
        per_seed = []
        for seed in seeds:
            per_seed.append(replay_synthetic(configs, jobs, gpus, load, seed, workers))
        base = [runs[0] for runs in per_seed]
        print(f"| {load} | Exclusive | | | | {mean(b['jct_mean_s'] for b in base):.0f} s | "
              f"{mean(b['energy_mj'] for b in base):.0f} MJ | {mean(b['makespan_s'] for b in base) / 3600:.1f} h | |")
        for k, (release, share_when, sizing_label, shards) in enumerate(labels, start=1):
            cells = []
            for key in ("jct_mean_s", "energy_mj", "makespan_s"):
                changes = [runs[k][key] / runs[0][key] - 1 for runs in per_seed]
                cells.append(f"{mean(changes):+.1%}"
                             + (f" ({min(changes):+.1%} to {max(changes):+.1%})" if len(changes) > 1 else ""))
            ooms = sum(runs[k]["ooms"] for runs in per_seed)
            print(f"| {load} | {release} | {share_when} | {sizing_label} | {shards} | {' | '.join(cells)} | {ooms} |",
                  flush=True)


def best_of(jobs: int, gpus: int, loads: list[float], releases: list[str], seeds: list[int],
            workers: int | None, placement: str = "advised") -> None:
    """Live (shipped defaults) against Exclusive and against the best CARMA policy, per load and trace seed."""
    data = data_dir(None)
    print(f"synthetic trace, {jobs:,} jobs, {gpus // 8} x 8 A100-80GB, trace seeds {seeds}, --util carma-fit: "
          "change against Exclusive; '% of best': live's gain as a share of the best CARMA policy's\n")
    print("| load | seed | Exclusive makespan | Exclusive mean JCT | CARMA policies: makespan | best makespan "
          "| best mean JCT | Slurm | live makespan | % of best | live mean JCT | % of best |")
    print("|---:|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---:|")
    common = {"nodes": gpus // 8, "gpus_per_node": 8, "gpu": "a100-80gb", "util": "carma-fit",
              "throughputs": data / THROUGHPUTS_NAME}
    configs = [SimConfig(policy="exclusive", estimator="none", **common)]
    configs += [SimConfig(policy=policy, estimator=estimator, **common) for policy, estimator in CARMA_RUNS]
    live_ll = {}
    for release in releases:
        live = setup(parse_config({}), release,
                     placement if SlurmVersion.parse(release).least_loaded_shared_gres else "advised")
        live_ll[release] = live.least_loaded
        configs.append(SimConfig(policy="live", estimator="measured", caps=live.caps, recovery=live.recovery,
                                 live=live, **common))
    names = [p for p, _ in CARMA_RUNS]
    for load in loads:
        for seed in seeds:
            runs = replay_synthetic(configs, jobs, gpus, load, seed, workers)
            base, carma, lives = runs[0], runs[1:1 + len(CARMA_RUNS)], runs[1 + len(CARMA_RUNS):]

            def change(run: dict, key: str) -> float:
                return run[key] / base[key] - 1

            spans = ", ".join(f"{n} {change(r, 'makespan_s'):+.1%}" for n, r in zip(names, carma))
            best = {key: min(zip(names, carma), key=lambda nr: nr[1][key]) for key in ("makespan_s", "jct_mean_s")}
            for release, run in zip(releases, lives):
                cells = []
                for key in ("makespan_s", "jct_mean_s"):
                    gain, best_gain = -change(run, key), -change(best[key][1], key)
                    share = f"{gain / best_gain:.0%}" if best_gain > 0 else "no gain to share"
                    cells += [f"{change(run, key):+.1%}", share]
                label = (release if release == "22.05" else f"{release}+") + (
                    " LL_SHARED_GRES" if live_ll[release] else "")
                print(f"| {load} | {seed} | {base['makespan_s'] / 3600:.1f} h | {base['jct_mean_s']:.0f} s | {spans} "
                      f"| {change(best['makespan_s'][1], 'makespan_s'):+.1%} ({best['makespan_s'][0]}) "
                      f"| {change(best['jct_mean_s'][1], 'jct_mean_s'):+.1%} ({best['jct_mean_s'][0]}) | {label} "
                      f"| {' | '.join(cells)} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--loads", type=float, nargs="+", default=[0.3, 0.5, 0.8, 1.0, 1.2])
    parser.add_argument("--releases", nargs="+", default=["22.05", "24.11"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--placement", choices=PLACEMENTS, default="advised",
                        help="--best-of: 24.11+'s shard placement (default: what gpushare slurm-config advises)")
    parser.add_argument("--util", choices=("carma-fit", "classes"), default="carma-fit",
                        help="the simulator's utilisation model (docs/simulator.md)")
    parser.add_argument("--shipped-only", action="store_true",
                        help="only the shipped defaults (share_when = queued, compute_sizing off, advised placement)")
    parser.add_argument("--best-of", action="store_true",
                        help="live (shipped defaults) against the best CARMA policy instead of the share_when table")
    args = parser.parse_args(argv)
    if args.best_of:
        best_of(args.jobs, args.gpus, args.loads, args.releases, args.seeds, args.workers, args.placement)
        return 0
    table(args.jobs, args.gpus, args.loads, args.releases, args.seeds, args.workers, args.util,
          (VARIANTS[1],) if args.shipped_only else VARIANTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
