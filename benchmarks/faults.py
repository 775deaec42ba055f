"""Records lost and time to converge when the accounting database is away as jobs end (docs/reliability.md).

One real local cluster of the running Slurm release with MariaDB + slurmdbd (devcluster.accounting) and the
node agent on simulated GPUs (tests/agent/conftest.py's AgentCluster). Per fault (slurmdbd stopped, then
MariaDB stopped): ``--jobs`` shared jobs (``#GPUSHARE mem=2G``, two GPUs) end while the daemon is down; the
daemon is started again. Printed per fault: the jobs affected (their Epilog spooled the record), the records
lost (not in the database with the node's final summary ``fin`` within ``--limit-s`` of the daemon's return),
the time from the return until the last record was stored, and the longest time an Epilog spent on the
accounting step before spooling (what the outage cost the node).

    sudo GPUSHARE_TEST_SLURM=26.05 PYTHONPATH=. python benchmarks/faults.py --jobs 20
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from devcluster import accounting
from devcluster.local_cluster import missing_requirements
from gpushare.gres.sim_backend import SimBackend
from gpushare.slurm import record as record_format

from accounting_overhead import _agent_helpers  # the benchmarks' one loader of the agent test cluster

SCRIPT = "#!/bin/sh\n#GPUSHARE mem=2G\nsleep 1\n"
_SPOOLED = re.compile(r"job (\d+): record not stored in the accounting database yet .*?reachable \(([\d.]+) s\)", re.S)


def _final(cluster, job: str) -> bool:  # type: ignore[no-untyped-def]
    found = cluster.client.job(job)
    return found is not None and found.state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")


def _stored(cluster) -> set[str]:  # type: ignore[no-untyped-def]
    """Jobs whose newest database row holds the node's final summary."""
    out = subprocess.run(cluster.argv(["sacct", "-n", "-P", "-X", "-a", "-S", "now-2hours", "-o",
                                       "JobIDRaw,AdminComment"]), capture_output=True, text=True, env=cluster.env).stdout
    done = set()
    for line in out.splitlines():
        job, _, comment = line.partition("|")
        run = (record_format.parse(comment) or {}).get("run") or {}
        if run.get("fin") == 1:
            done.add(job)
    return done


def fault(cluster, daemon: str, jobs: int, limit_s: float) -> str:  # type: ignore[no-untyped-def]
    cluster.acct.pause(daemon)
    try:
        ids = [cluster.client.sbatch("--gres=gpu:1", "-o", "/dev/null", script=SCRIPT)[0] for _ in range(jobs)]
        cluster.wait_for(lambda: all(_final(cluster, str(job)) for job in ids), 60 + 10 * jobs, "jobs did not end")
        time.sleep(1.0)
    finally:
        cluster.acct.resume(daemon)
    back = time.monotonic()
    wanted = {str(job) for job in ids}
    converged = None
    while time.monotonic() - back < limit_s:
        if wanted <= _stored(cluster):
            converged = time.monotonic() - back
            break
        time.sleep(0.5)
    lost = len(wanted - _stored(cluster))
    text = (cluster.base / "log" / "agent.log").read_text(errors="replace")
    spooled = {job: float(s) for job, s in _SPOOLED.findall(text) if job in wanted}
    took = f"{converged:.1f} s" if converged is not None else f"not within {limit_s:.0f} s"
    return (f"{daemon} down: {len(ids)} jobs ended, {len(spooled)} spooled by their Epilog (longest accounting step "
            f"{max(spooled.values(), default=0):.2f} s), {lost} records lost, converged {took} after it returned")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--limit-s", type=float, default=120.0)
    args = parser.parse_args()
    problem = missing_requirements() or accounting.missing_requirements()
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="gpushare-bench-faults-", dir="/tmp"))
    toml = (f'[agent]\nstate_dir = "{base}/agent-state"\nrecords_dir = "{base}/records"\n'
            f'run_dir = "{base}/run-agent"\nlog_file = "{base}/log/agent.log"\nwithhold = "none"\n'
            f'device_backend = "sim:{base}/sim.json"\nmetrics_port = 0\n')
    helpers = _agent_helpers()
    SimBackend.from_scenario(helpers.two_gpus(), base / "sim.json")
    cluster = helpers.AgentCluster(base, bin_dir=os.path.dirname(sys.executable), toml_extra=toml, accounting=True)
    try:
        cluster.start()
        cluster.start_agent()
        for daemon in ("slurmdbd", "mariadbd"):
            print(fault(cluster, daemon, args.jobs, args.limit_s), flush=True)
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
