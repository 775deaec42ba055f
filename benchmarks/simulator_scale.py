"""How the trace simulator's cost grows with the trace: wall time and peak RSS per run, growth exponent.

    python benchmarks/simulator_scale.py [--jobs 1000 10000 100000] [--gpus 64 256 1024] [--policy magm]
                                         [--release 22.05] [--repeat 1] [--load 0.8] [--json]

What an admin would run before deploying: a synthetic Philly-format trace (``wait_seconds,num_tasks``:
exponential gaps, 1-8 GPUs per job: 1, 1, 1, 1, 2, 2, 4 or 8 uniformly) read by the simulator's own trace
reader, on nodes of 8 x A100-80GB (``--nodes G/8 --gpus-per-node 8 --gpu a100-80gb``), MAGM with the oracle
estimator and the default interference model. The mean gap is set so that the offered load is ``--load``
(0.8) of the cluster's GPU-seconds run exclusively, whatever its size, so every cluster is about as busy.
Each run is a fresh process (its peak RSS is its own). The growth exponent is the least-squares slope of
log(wall time) against log(jobs) at each cluster size; n log n over 1k-100k jobs would read about 1.2.

``--policy live`` runs the stack that deploys, as ``gpushare simulate --policy live`` does: the shipped
defaults (or ``$GPUSHARE_CONFIG``), Slurm ``--release``, gpu-estimate's measured error as the estimator.
``--repeat N`` runs each case N times (each in a fresh process) and prints the median wall time, its range
and the median CPU time of the run's process (user + system, which other work on a shared machine moves
less than the wall time). ``--json``: the run also writes ``gpushare simulate --json``'s document (to
/dev/null), timed with it, as the command does.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpushare.simulator import batch, report, trace  # noqa: E402
from gpushare.simulator.cli import THROUGHPUTS_NAME, data_dir  # noqa: E402
from gpushare.simulator.engine import SimConfig  # noqa: E402
from gpushare.simulator.runner import simulation  # noqa: E402

GPUS_PER_JOB = (1, 1, 1, 1, 2, 2, 4, 8)
PER_NODE = 8


def synthetic_trace(jobs: int, gpus: int, load: float, seed: int = 0) -> str:
    """A Philly-format trace whose offered load is ``load`` of ``gpus`` GPUs (measured on a draft)."""
    rng = random.Random(seed)
    tasks = [rng.choice(GPUS_PER_JOB) for _ in range(jobs)]
    draft = trace.parse("".join(f"0,{t}\n" for t in tasks[:2000]), "draft", seed)
    gpu_seconds = statistics.mean(j.solo_s * j.gpus for j in draft)
    gap = gpu_seconds / (gpus * load)
    return "".join(f"{rng.expovariate(1.0 / gap):.1f},{t}\n" for t in tasks)


def replay_synthetic(configs: list[SimConfig], jobs: int, gpus: int, load: float, seed: int,
                     workers: int) -> list[dict[str, Any]]:
    """Each of ``configs`` replayed over one synthetic trace (``synthetic_trace``), written to a temporary file
    as a site's export would be, through the batch runner the CLI uses: one home for the loop the
    do-no-harm and calibrated-gains benchmarks run per load and seed."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "synthetic.csv"
        path.write_text(synthetic_trace(jobs, gpus, load, seed))
        return batch.run_all(batch.Source(str(path)), configs, workers)


def settings(policy: str, release: str) -> dict[str, Any]:
    """The run's estimator, caps, recovery and deployed stack, as ``gpushare simulate`` picks them."""
    if policy != "live":
        return {}
    from gpushare.config import load_config
    from gpushare.simulator.live import setup

    live = setup(load_config(None), release)
    return {"estimator": "measured", "caps": live.caps, "recovery": live.recovery, "live": live}


def run_one(jobs: int, gpus: int, policy: str, load: float, release: str = "22.05",
            as_json: bool = False) -> dict[str, float]:
    """One run in this (fresh) process: trace reading, simulation and (``as_json``) the JSON document timed
    together, peak RSS after."""
    started = time.perf_counter()
    specs = trace.parse(synthetic_trace(jobs, gpus, load), "synthetic", 0)
    config = SimConfig(nodes=gpus // PER_NODE, gpus_per_node=PER_NODE, gpu="a100-80gb", policy=policy,
                       throughputs=data_dir(None) / THROUGHPUTS_NAME, **settings(policy, release))
    sim = simulation(specs, config).run()
    if as_json:
        with open(os.devnull, "w") as out:
            report.write_json(sim, out)
    wall = time.perf_counter() - started
    done = sum(j.state == "done" for j in sim.jobs.values())
    end = max((j.end for j in sim.jobs.values() if j.end is not None), default=0.0)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"jobs": jobs, "gpus": gpus, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "rss_mib": usage.ru_maxrss / 1024,
            "done": done, "days": end / 86400}


def _isolated(args: tuple[int, int, str, float, str, bool]) -> dict[str, float]:
    with ProcessPoolExecutor(1) as pool:  # a process of its own, so that ru_maxrss is this run's
        return pool.submit(run_one, *args).result()


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of log(y) on log(x)."""
    xs, ys = [math.log(x) for x, _ in points], [math.log(y) for _, y in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--gpus", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--policy", default="magm")
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--release", default="22.05", help="--policy live: the Slurm release")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case; the table gives the median")
    parser.add_argument("--json", action="store_true", help="time writing the --json document too")
    args = parser.parse_args(argv)
    deployed = f", Slurm {args.release}, shipped defaults" if args.policy == "live" else ""
    print(f"policy {args.policy}{deployed}, a100-80gb x 8 per node, offered load {args.load}, Philly-format "
          f"synthetic trace{', --json document written' if args.json else ''}, median of {args.repeat} run(s) per "
          f"case, load average before {os.getloadavg()[0]:.1f}\n")
    print("| jobs | GPUs | wall s (median) | min-max s | CPU s (median) | peak RSS MiB | completed | simulated days |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    results = []
    for gpus in args.gpus:
        for jobs in args.jobs:
            runs = [_isolated((jobs, gpus, args.policy, args.load, args.release, args.json))
                    for _ in range(args.repeat)]
            walls = [x["wall_s"] for x in runs]
            r = dict(runs[0], wall_s=statistics.median(walls), cpu_s=statistics.median(x["cpu_s"] for x in runs),
                     rss_mib=max(x["rss_mib"] for x in runs))
            results.append(r)
            print(f"| {jobs:,} | {gpus:,} | {r['wall_s']:.1f} | {min(walls):.1f}-{max(walls):.1f} | {r['cpu_s']:.1f} | "
                  f"{r['rss_mib']:.0f} | "
                  f"{r['done']:,} | {r['days']:.1f} |", flush=True)
    if len(args.jobs) > 1:
        print()
        for gpus in args.gpus:
            points = [(r["jobs"], r["wall_s"]) for r in results if r["gpus"] == gpus]
            print(f"growth exponent on {gpus:,} GPUs (wall time ~ jobs^k): k = {slope(points):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
