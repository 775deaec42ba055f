"""Alibaba's GPU-sharing production trace through the live stack and Exclusive: allocation, fragmentation, JCT.

    python benchmarks/alibaba_trace.py --trace PATH/openb_pod_list_default.csv [--nodes 777 8 4]

PATH is a checkout of github.com/alibaba/clusterdata, folder ``cluster-trace-gpu-v2023/csv`` (not shipped
here: docs/simulator.md, *Alibaba's GPU-sharing trace*). The tasks with GPUs (``gpushare.simulator.openb``)
run, at their recorded times, on nodes of 8 × V100-32GB, under Exclusive and under ``--policy live`` with
the shipped defaults on Slurm 22.05 and 24.11, and on 24.11 with ``[policy] share_when = "always"`` (shared
whatever the queue, the setting before the queue gate). 777 nodes (6,216 GPUs) is the trace's own cluster size (6,212
GPUs on 1,213 GPU nodes of 1-8 GPUs of several models, which the simulator cannot shape); the recorded
tasks are a sample that never holds more than 70 GPUs at once there, so smaller clusters (8 and 4 nodes)
give the same tasks the contention that FGD's evaluation creates by inflating the workload until the
cluster fills. Allocation ratio and fragmentation: ``gpushare.simulator.occupancy``, up to the last arrival.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpushare.config import load_config  # noqa: E402
from gpushare.simulator import occupancy, openb, trace  # noqa: E402
from gpushare.simulator.cli import THROUGHPUTS_NAME, data_dir  # noqa: E402
from gpushare.simulator.engine import SimConfig  # noqa: E402
from gpushare.simulator.live import setup  # noqa: E402
from gpushare.simulator.runner import simulation  # noqa: E402

NODES, PER_NODE, GPU = 777, 8, "v100-32gb"
# (policy, Slurm release, [policy] share_when: None = as shipped); the last row shares whatever the queue
VARIANTS = (("exclusive", "22.05", None), ("live", "22.05", None), ("live", "24.11", None), ("live", "24.11", "always"))


def run(jobs: list[trace.JobSpec], policy: str, release: str, nodes: int, share_when: str | None = None) -> dict[str, float]:
    extra: dict[str, object] = {"estimator": "oracle"}
    if policy == "live":
        cfg = load_config(None)
        if share_when is not None:  # through the settings, so that the shard placement is the one advised for it
            cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, share_when=share_when))
        live = setup(cfg, release)
        extra = {"estimator": "measured", "caps": live.caps, "recovery": live.recovery, "live": live}
    config = SimConfig(nodes=nodes, gpus_per_node=PER_NODE, gpu=GPU, policy=policy,
                       throughputs=data_dir(None) / THROUGHPUTS_NAME, util="classes",  # as recorded in docs/benchmarks.md
                       **extra)  # type: ignore[arg-type]
    started = time.perf_counter()
    sim = simulation(jobs, config).run()
    wall = time.perf_counter() - started
    done = [j for j in sim.jobs.values() if j.state == "done" and j.end is not None]
    jct = sorted(j.end - j.spec.submit_s for j in done)  # type: ignore[operator]
    out = occupancy.measure(sim, lambda j: openb.share_of(j.spec))
    out.update(jct_mean_s=statistics.mean(jct) if jct else float("nan"),
               jct_p95_s=jct[int(0.95 * (len(jct) - 1))] if jct else float("nan"),
               wait_mean_s=statistics.mean(j.wait_s for j in done) if done else float("nan"),
               done=len(done), jobs=len(sim.jobs), wall_s=wall, ooms=sum(j.ooms for j in sim.jobs.values()))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True, help="openb_pod_list_*.csv of cluster-trace-gpu-v2023")
    parser.add_argument("--nodes", type=int, nargs="+", default=[NODES, 8, 4], help="cluster sizes, nodes of 8 GPUs")
    args = parser.parse_args(argv)
    try:
        read = openb.parse(Path(args.trace).read_text(), args.trace)
    except (OSError, trace.TraceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.trace}: {len(read.jobs):,} tasks with GPUs ({read.cpu_only:,} CPU-only and "
          f"{read.never_scheduled:,} never-scheduled tasks left out); nodes of {PER_NODE} x {GPU}\n")
    print("| GPUs | policy | allocation ratio | demand served | busy GPUs | fragmented (of free) | "
          "fragmented (of all) | JCT mean s | JCT p95 s | wait mean s | OOMs | completed | wall s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for nodes in args.nodes:
        for policy, release, share_when in VARIANTS:
            r = run(read.jobs, policy, release, nodes, share_when)
            name = policy if policy == "exclusive" else f"live {release}" + (f", share {share_when}" if share_when else "")
            print(f"| {nodes * PER_NODE:,} | {name} | {r['allocation_ratio']:.3f} | {r['demand_served']:.3f} | "
                  f"{r['busy_gpus']:.3f} | {r['fragmented_of_free']:.3f} | {r['fragmented_of_all']:.3f} | "
                  f"{r['jct_mean_s']:,.0f} | {r['jct_p95_s']:,.0f} | {r['wait_mean_s']:,.0f} | {r['ooms']:,} | "
                  f"{r['done']:,}/{r['jobs']:,} | {r['wall_s']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
