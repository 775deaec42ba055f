"""Time the node Epilog adds per job end to store the job's record in Slurm's accounting database.

Two real local clusters of the same Slurm release, one after the other: "off" (``accounting_storage/none``:
the Epilog's one ``sacct`` call finds no database and stops) and "on" (MariaDB + slurmdbd,
devcluster.accounting: wait for the database to show the run ended, ``sacctmgr`` write, read back;
gpushare.epilog.stored_record). Each runs ``--jobs`` short GPU jobs (``#GPUSHARE mem=2G``) one after the other,
with the node agent on simulated GPUs (tests/agent/conftest.py's AgentCluster). The sample is the time the Epilog itself logs for the step
(``accounting database: ... (N reads, M writes, X s)``), so machine noise elsewhere in the job's end is not
counted. Also printed: the order of the two Epilogs (the node Epilog's record written, less EpilogSlurmctld's
outcome logged, from their logs' millisecond stamps), how many database reads the "on" writer needed (2 = the run had already ended in the
database at the first read, plus the read-back) and the job's turnaround (sbatch to COMPLETED, polled).

    sudo GPUSHARE_TEST_SLURM=24.11 python benchmarks/accounting_overhead.py --jobs 40
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from devcluster import accounting
from devcluster.local_cluster import missing_requirements
from gpushare.gres.sim_backend import SimBackend

SCRIPT = "#!/bin/sh\n#GPUSHARE mem=2G\ntrue\n"
_LINE = re.compile(r"job (\d+): accounting database: (.*) \((\d+) reads, (\d+) writes, ([\d.]+) s\)")
_STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*job (\d+): "
_RECORD = re.compile(_STAMP + "record written", re.M)  # the node Epilog, before its accounting step
_CTLD = re.compile(_STAMP + "none: exited 0", re.M)  # EpilogSlurmctld's outcome for a job that exited 0


def _stamps(pattern: re.Pattern[str], text: str) -> dict[str, float]:
    from datetime import datetime

    return {job: datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp() for stamp, job in pattern.findall(text)}


def _agent_helpers():  # type: ignore[no-untyped-def]
    """tests/agent/conftest.py (AgentCluster, two_gpus), loaded under its own name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpushare_agent_test_helpers",
                                                  Path(__file__).parents[1] / "tests" / "agent" / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(with_db: bool, jobs: int) -> tuple[list[float], list[int], list[float], list[str], list[float]]:
    base = Path(tempfile.mkdtemp(prefix="gpushare-bench-acct-", dir="/tmp"))
    toml = (f'[agent]\nstate_dir = "{base}/agent-state"\nrecords_dir = "{base}/records"\n'
            f'run_dir = "{base}/run-agent"\nlog_file = "{base}/log/agent.log"\nwithhold = "none"\n'
            f'device_backend = "sim:{base}/sim.json"\nmetrics_port = 0\n')
    helpers = _agent_helpers()
    SimBackend.from_scenario(helpers.two_gpus(), base / "sim.json")
    cluster = helpers.AgentCluster(base, bin_dir=os.path.dirname(sys.executable), toml_extra=toml,
                                   accounting=with_db)
    turnaround = []
    try:
        cluster.start()
        cluster.start_agent()
        for _ in range(jobs):
            started = time.monotonic()
            job, _ = cluster.client.sbatch("--gres=gpu:1", "-o", "/dev/null", script=SCRIPT)
            cluster.wait_job(job, 60)
            turnaround.append(time.monotonic() - started)
        time.sleep(1.0)
        text = (base / "log" / "agent.log").read_text()
        node, ctld = _stamps(_RECORD, text), _stamps(_CTLD, (base / "log" / "oom.log").read_text())
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)
    found = _LINE.findall(text)
    order = [node[job] - ctld[job] for job in node if job in ctld]  # > 0: EpilogSlurmctld was done first
    return ([float(m[4]) for m in found], [int(m[2]) for m in found], turnaround, sorted({m[1] for m in found}),
            order)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=40)
    args = parser.parse_args()
    problem = missing_requirements() or accounting.missing_requirements()
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2
    for label, with_db in (("off", False), ("on", True)):
        added, reads, turnaround, results, order = run(with_db, args.jobs)
        if not added:
            print(f"{label}: the Epilog logged no accounting step", file=sys.stderr)
            return 1
        print(f"database {label}: {len(added)} job ends; Epilog's accounting step median "
              f"{statistics.median(added) * 1000:.0f} ms, p99 {p99(added) * 1000:.0f} ms; reads "
              f"{dict(sorted((r, reads.count(r)) for r in set(reads)))}; outcome {', '.join(results)}; "
              f"turnaround median {statistics.median(turnaround):.2f} s, p99 {p99(turnaround):.2f} s; "
              f"node Epilog's record minus EpilogSlurmctld's outcome: {min(order) * 1000:+.0f} to "
              f"{max(order) * 1000:+.0f} ms (median {statistics.median(order) * 1000:+.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
