"""Time from a job's GPU memory overrun to the backstop's SIGKILL, on the agent's real sampling loop.

Each of 8 simulated GPUs carries a neighbour job (6 GiB on an 8 GiB cap) and an offender job (5 GiB cap)
whose process (a real sleeping process, so the SIGKILL is real) jumps from 3 GiB to far past its 5 GiB cap at a random moment, unaligned
with the agent's samples. Measured per jump: wall time from the jump to the process's death. Two cases:

- ``room``: the jump leaves memory free on the GPU (to 24 GiB): the backstop waits its grace period
  (``backstop_grace_s``, default 10 s), sparing spikes nobody else pays for;
- ``full``: the jump takes the rest of the GPU (to 34 GiB: 6 + 34 = 40): the overrun is the neighbour's
  memory, so the job is stopped at the first sample that sees it (no grace).

``Agent.run`` at the shipped ``sample_period_s`` (1 s), in-memory simulated backend, real clock.

    python benchmarks/overrun_stop.py [--rounds 3] [--grace 10]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from gpushare.agent.daemon import Agent
from gpushare.config import parse_config
from gpushare.gpus import GiB
from gpushare.gres.sim_backend import SimBackend

GPUS = 8


def one_round(tmp: Path, jump_gib: int, grace_s: float, rng: random.Random) -> list[float]:
    """Latencies (s) of GPUS simultaneous offenders, each jumping at its own random moment."""
    backend = SimBackend.from_scenario({"version": 1, "name": "overrun", "processes": [],
                                        "gpus": [{"model": "a100-40gb"} for _ in range(GPUS)]}, clock=time.time)
    cfg = parse_config({"agent": {"state_dir": str(tmp / "state"), "run_dir": str(tmp / "run"),
                                  "collocation": "fraction", "backstop_grace_s": grace_s,
                                  "forecast_action": "none"}}).agent
    # every GPU process is a real process of ours: the agent signals only pids it finds on a GPU
    offenders = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(GPUS)]
    victims = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(GPUS)]
    pids = {proc.pid: f"{100 + gpu}" for gpu, proc in enumerate(offenders)}
    pids.update({proc.pid: f"{200 + gpu}" for gpu, proc in enumerate(victims)})
    agent = Agent(cfg, backend, pid_job=pids.get, pid_uid=lambda pid: os.geteuid() if pid in pids else None)
    for gpu in range(GPUS):
        for job, est in ((f"{100 + gpu}", 4.0), (f"{200 + gpu}", 7.0)):  # caps 5 and 8 GiB
            agent.register({"job": job, "uid": os.geteuid(), "user": "u", "gpus": [gpu], "shared": True,
                            "est_gib": est, "margin_gib": 1.0, "shards": int(est) + 1})
        backend.start_process(gpu, victims[gpu].pid, 6 * GiB)
        backend.start_process(gpu, offenders[gpu].pid, 3 * GiB)
    stop = threading.Event()
    loop = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    loop.start()
    latencies: list[float] = []
    try:
        jumps = sorted((rng.uniform(1.0, 3.0), gpu) for gpu in range(GPUS))
        started = time.monotonic()
        jumped: dict[int, float] = {}
        for delay, gpu in jumps:
            time.sleep(max(0.0, started + delay - time.monotonic()))
            backend.update_process(offenders[gpu].pid, memory_mib=jump_gib * 1024)
            jumped[gpu] = time.monotonic()
        for gpu, at in jumped.items():
            offenders[gpu].wait(grace_s + 30)
            latencies.append(time.monotonic() - at)
    finally:
        stop.set()
        loop.join(5)
        spared = all(proc.poll() is None for proc in victims)
        for proc in offenders + victims:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert spared, "a neighbour within its cap was stopped"
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--grace", type=float, default=10.0, help="backstop_grace_s (shipped default 10)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("gpushare").setLevel(logging.ERROR)  # every stop logs a warning: not the measurement
    rng = random.Random(args.seed)
    print(f"{GPUS} GPUs x {args.rounds} rounds, sample_period_s 1.0, backstop_grace_s {args.grace:g}")
    for case, jump in (("room", 24), ("full", 34)):
        values: list[float] = []
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as tmp:
                values += one_round(Path(tmp), jump, args.grace, rng)
        print(f"{case:<5} jump to {jump} GiB: overrun-to-stop p50 {statistics.median(values):.2f} s, "
              f"p99 {percentile(values, 0.99):.2f} s, max {max(values):.2f} s (n={len(values)})")


if __name__ == "__main__":
    main()
