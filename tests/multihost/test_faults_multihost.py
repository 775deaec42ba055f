"""Faults on the multi-host cluster lose nothing (docs/reliability.md): a daemon stopped on its own host.

slurmdbd runs on the controller, the GPU node gpu1 reaches it only through Slurm's tools, and the records a
job's Epilog writes on gpu1 must still end in the database (and in ``gpushare jobstats`` on the login host)
when slurmdbd is away while the jobs end. The single-host form of this fault, with MariaDB down as well, is
tests/accounting/test_faults_slurm.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gpushare.slurm import record as record_format

pytestmark = [pytest.mark.slurm, pytest.mark.multihost, pytest.mark.faults]
SIMJOB = Path(__file__).parents[1] / "agent" / "simjob.py"  # a GPU process on the simulated backend
ALICE = "gpushare-alice"
SPOOL = "/var/lib/gpushare/agent/pending-records"  # [agent] state_dir's spool on gpu1 (epilog/stored_record.py)
# Long enough for the agent's delivery to back off to its longest pause (agent/followups.py: 2, 4, 8, 16, then
# DELIVER_MAX_S = 30 s): a longer outage only repeats that pause, and slurmctld queues its own records for
# any length, so two minutes would cost the suite time and prove nothing more.
OUTAGE_S = 40.0
JOBS = {  # five shared jobs on gpu1's two GPUs at once; one is recovered from an OOM (two runs)
    "a": "--mem-mib 3000 --seconds 3", "b": "--mem-mib 2000 --seconds 3", "c": "--mem-mib 1000 --seconds 4",
    "d": "--mem-mib 2500 --seconds 2", "oom": "--mem-mib 4300 --seconds 3 --oom-first-run"}


def _script(cluster, args: str) -> str:  # type: ignore[no-untyped-def]
    return (f"#!/bin/sh\n#SBATCH --gres=gpu:1\n#SBATCH --output=/tmp/job-%j.out\n#SBATCH --open-mode=append\n"
            f"#GPUSHARE mem=4G\n{cluster.bin_dir}/python {SIMJOB} {args}\n")


def _ended(cluster, job_id: int, oom: bool) -> bool:  # type: ignore[no-untyped-def]
    job = cluster.client.require_job(job_id)
    return job.state == "COMPLETED" and not job.completing and (job.restarts >= 1 or not oom)


def _stored(cluster, job_id: int, oom: bool) -> bool:  # type: ignore[no-untyped-def]
    """The database's newest row of the job ended and holds gpu1's final summary (``fin``), read on login."""
    rows = cluster.run("login", ["sacct", "-n", "-P", "-X", "-j", str(job_id), "-o", "State,AdminComment"],
                       check=False).stdout.strip().splitlines()
    if not rows:
        return False
    state, _, comment = rows[-1].partition("|")
    record = record_format.parse(comment) or {}
    run = record.get("run") or {}
    return (state.split()[0] == "COMPLETED" and run.get("fin") == 1 and "exit" in run
            and (not oom or "oom" in record))


def _spooled(cluster) -> set[str]:  # type: ignore[no-untyped-def]
    return {path.stem.rpartition("-")[0] for path in cluster.path_on("gpu1", SPOOL).glob("*.json")}


def test_slurmdbd_stopped_on_the_controller_as_shared_jobs_end_loses_no_record(multihost):
    """slurmdbd stopped on ctl (as a crash leaves it) for OUTAGE_S while five shared jobs run and end on gpu1,
    one of them after an OOM recovery: the Epilogs on gpu1 spool the run summaries on gpu1's disk; once
    slurmdbd is back every job's record is in the database, its final summary merged into the row slurmctld
    queued, the spool is empty, and ``gpushare jobstats`` on the login host shows each with peak, energy and
    exit code."""
    started = time.monotonic()
    cluster = multihost(agents=True, accounting=True)
    cluster.wait_for(lambda: cluster.agent_up("gpu1"), 20, "agent")
    ready = time.monotonic()
    cluster.acct.pause("slurmdbd")
    down = time.monotonic()
    try:
        ids = {name: cluster.sbatch("login", ALICE, _script(cluster, args)) for name, args in JOBS.items()}
        cluster.wait_for(lambda: all(_ended(cluster, job, name == "oom") for name, job in ids.items()), 150,
                         f"jobs {ids} did not end while slurmdbd was down")
        cluster.wait_for(lambda: {str(job) for job in ids.values()} <= _spooled(cluster), 30,
                         f"gpu1's Epilogs did not spool jobs {ids}: {_spooled(cluster)}")
        assert not any(_stored(cluster, job, False) for job in ids.values())  # nothing could reach it
        time.sleep(max(0.0, down + OUTAGE_S - time.monotonic()))
    finally:
        cluster.acct.resume("slurmdbd")
    back = time.monotonic()
    cluster.wait_for(lambda: all(_stored(cluster, job, name == "oom") for name, job in ids.items()), 90,
                     f"records of {ids} not in the database after slurmdbd returned")
    converged = time.monotonic() - back
    cluster.wait_for(lambda: not ({str(job) for job in ids.values()} & _spooled(cluster)), 30,
                     "delivered records left in gpu1's spool")
    for name, job in ids.items():  # one database row per run: nothing recorded twice
        runs = cluster.run("login", ["sacct", "-n", "-P", "-X", "-D", "-j", str(job), "-o", "JobID"]).stdout.split()
        assert len(runs) == (2 if name == "oom" else 1), (name, runs)
    for name, job in ids.items():
        done = cluster.run("login", ["gpushare", "jobstats", "--json", str(job)], user=ALICE)
        doc = json.loads(done.stdout)
        assert (doc["state"], doc["decision"], doc["exit_code"]) == ("COMPLETED", "shared", 0), doc
        assert doc["peak_gib"] is not None and doc["energy_j"] is not None and not doc["partial"], doc
        assert "never have used its GPU" not in doc["advice"], doc
        if name == "oom":
            assert doc["runs"] == 2 and doc["oom"]["n"] == 1, doc
    print(f"\nslurmdbd down {back - down:.0f} s on ctl: {len(ids)} jobs, records converged {converged:.1f} s after "
          f"it returned; cluster start {ready - started:.1f} s, test {time.monotonic() - started:.1f} s")
