"""CPU cost of the node agent's sampling loop: 8 simulated GPUs, 16 running jobs, 1 Hz.

The agent must not steal CPU from jobs on the node it watches (goal: ≤ 1 % of one core). Measured as
process CPU time (user + system, ``time.process_time``) per sampling tick, which at 1 Hz *is* the CPU
fraction. Three ways:

- ``memory``: the simulated backend in memory — the agent's own work per tick (window, CARMA score,
  TTFK, attribution, timeline) plus a trivial backend;
- ``file``: the simulated backend on a shared state file, as in the integration tests (every read
  parses the JSON state: an upper bound, a real NVML query is a few µs);
- ``realtime``: ``Agent.run`` for ``--seconds`` of wall time at 1 Hz (the daemon loop itself, sleeping
  between ticks), CPU over wall time.

    python benchmarks/agent_overhead.py [--ticks 600] [--seconds 20]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from gpushare.config import parse_config
from gpushare.gres.sim_backend import SimBackend
from gpushare.agent.daemon import Agent

GPUS, JOBS_PER_GPU = 8, 2


class FakeClock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def scenario() -> dict:
    processes = [{"pid": 10_000 + g * 10 + k, "gpu": g, "memory_mib": 4096, "smact": 0.3, "smocc": 0.2,
                  "drama": 0.1} for g in range(GPUS) for k in range(JOBS_PER_GPU)]
    return {"version": 1, "name": "bench", "gpus": [{"model": "a100-40gb"} for _ in range(GPUS)],
            "processes": processes}


def build(tmp: Path, clock, state_file: bool) -> Agent:
    backend = SimBackend.from_scenario(scenario(), tmp / "sim.json" if state_file else None, clock=clock,
                                       overwrite=True)
    cfg = parse_config({"agent": {"state_dir": str(tmp / "state"), "run_dir": str(tmp / "run"),
                                  "collocation": "fraction"}}).agent
    pids = {10_000 + g * 10 + k: str(100 + g * 10 + k) for g in range(GPUS) for k in range(JOBS_PER_GPU)}
    agent = Agent(cfg, backend, clock=clock, pid_job=pids.get, pid_uid=lambda pid: 1000)
    for pid, job in pids.items():
        agent.register({"job": job, "uid": 1000, "user": "u", "gpus": [(pid - 10_000) // 10], "shared": True,
                        "est_gib": 4.0, "margin_gib": 1.0, "shards": 5})
    return agent


def per_tick(agent: Agent, clock, ticks: int) -> float:
    for _ in range(10):  # warm up: windows full, caches filled
        agent.tick()
        clock.t += 1.0
    started = time.process_time()
    for _ in range(ticks):
        agent.tick()
        clock.t += 1.0
    return (time.process_time() - started) / ticks


def realtime(agent: Agent, seconds: float) -> float:
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    cpu, wall = time.process_time(), time.monotonic()
    timer.start()
    agent.run(stop)
    return (time.process_time() - cpu) / (time.monotonic() - wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=600)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    print(f"{GPUS} simulated A100-40GB, {GPUS * JOBS_PER_GPU} running jobs, 30-sample window, 1 Hz")
    for label, state_file in (("memory", False), ("file", True)):
        with tempfile.TemporaryDirectory() as tmp:
            clock = FakeClock()
            cpu = per_tick(build(Path(tmp), clock, state_file), clock, args.ticks)
            print(f"{label:>8}: {cpu * 1e3:7.3f} ms CPU per tick = {cpu * 100:6.3f} % of one core at 1 Hz "
                  f"({args.ticks} ticks)")
    with tempfile.TemporaryDirectory() as tmp:
        fraction = realtime(build(Path(tmp), time.time, True), args.seconds)
        print(f"realtime: {fraction * 100:6.3f} % of one core (Agent.run, file-backed sim, {args.seconds:.0f} s wall)")


if __name__ == "__main__":
    main()
