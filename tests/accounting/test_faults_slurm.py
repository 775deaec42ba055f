"""Job records lose nothing when the accounting database is away as jobs end (docs/reliability.md): a real
Slurm of the running release with MariaDB + slurmdbd (devcluster.accounting), the agent and the shipped
Prolog/Epilog. slurmdbd is stopped, then (separately) MariaDB; shared jobs end meanwhile (one of them recovered
from an OOM); the Epilogs spool the run summaries on the node; once the daemon is back, every record reaches
the database (the agent's loop or the next Epilog delivers it, once), merged into what the row holds, and
``gpushare jobstats`` shows peak, energy and exit for each.

Three jobs per fault (not more): each outage costs a daemon restart and the jobs' run time, and three already
show ordering (two shared jobs on one GPU, an OOM requeue's two runs). The single-host cluster: the fault is
the database's, which every node reaches the same way, and its start costs a fraction of the multi-host one's.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from gpushare.slurm import record as record_format

pytestmark = [pytest.mark.slurm, pytest.mark.faults]


def _jobstats_module() -> Any:
    """The accounting cluster fixture and helpers of test_jobstats_slurm.py, loaded under their own name."""
    path = Path(__file__).with_name("test_jobstats_slurm.py")
    spec = importlib.util.spec_from_file_location("gpushare_accounting_test_helpers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_helpers = _jobstats_module()
cluster = _helpers.cluster  # one accounting cluster for this module
script, jobstats = _helpers.script, _helpers.jobstats


def _submit(cluster: Any, out: Path, args: str, directive: str = "mem=4G") -> int:
    as_owner = ("--gres=gpu:1", f"--uid={cluster.owner.pw_uid}", f"--gid={cluster.owner.pw_gid}", "-D", str(out),
                "-o", str(out / "job-%j.out"), "--open-mode=append",
                f"--export=ALL,GPUSHARE_CONFIG={cluster.gpushare_conf}")
    return int(cluster.client.sbatch(*as_owner, script=script(directive, args))[0])


def _spooled(cluster: Any) -> dict[str, int]:
    spool = Path(cluster.agent_cfg().state_dir) / "pending-records"
    found: dict[str, int] = {}
    for path in spool.glob("*.json"):
        job = path.stem.rpartition("-")[0]
        found[job] = found.get(job, 0) + 1
    return found


def _final(cluster: Any, job: int) -> bool:
    return (cluster.client.job(str(job)) or type("J", (), {"state": ""})()).state in ("COMPLETED", "FAILED")


def _stored(cluster: Any, job: int, oom: bool = False) -> bool:
    """The database's newest row of ``job`` ended and holds the node's final summary (``fin``)."""
    found = subprocess.run(cluster.argv(["sacct", "-n", "-P", "-X", "-j", str(job), "-o", "State,AdminComment"]),
                           capture_output=True, text=True, env=cluster.env).stdout.strip().splitlines()
    if not found:
        return False
    state, _, comment = found[-1].partition("|")
    record = record_format.parse(comment) or {}
    run = record.get("run") or {}
    return (state.split()[0] == "COMPLETED" and run.get("fin") == 1 and "exit" in run
            and (not oom or "oom" in record))


def _outage(cluster: Any, daemon: str, jobs: dict[str, tuple[str, str]]) -> tuple[dict[str, int], float]:
    """Stop ``daemon``, run ``jobs`` (name -> (directive, simjob args)) to their end, start it again; returns
    the job ids and the seconds from the daemon's return until every record was in the database."""
    out = Path(tempfile.mkdtemp(prefix="gpushare-faults-out-"))
    out.chmod(0o777)
    cluster.acct.pause(daemon)
    try:
        ids = {name: _submit(cluster, out, args, directive) for name, (directive, args) in jobs.items()}
        cluster.wait_for(lambda: all(_final(cluster, job) for job in ids.values()), 180,
                         f"jobs {ids} did not end while {daemon} was down")
        cluster.wait_for(lambda: all(str(job) in _spooled(cluster) for job in ids.values()), 30,
                         f"the Epilogs did not spool jobs {ids}: {_spooled(cluster)}")
        spool = Path(cluster.agent_cfg().state_dir) / "pending-records"
        assert spool.stat().st_mode & 0o777 == 0o700 and spool.stat().st_uid == 0
        assert all(p.stat().st_mode & 0o777 == 0o600 for p in spool.glob("*.json"))
    finally:
        cluster.acct.resume(daemon)
    back = time.monotonic()
    cluster.wait_for(lambda: all(_stored(cluster, job, oom=name == "oom") for name, job in ids.items()), 90,
                     f"records of {ids} not in the database after {daemon} returned")
    converged = time.monotonic() - back
    print(f"{daemon} down: {len(ids)} jobs, converged {converged:.1f} s after it returned")
    cluster.wait_for(lambda: not any(str(job) in _spooled(cluster) for job in ids.values()), 30,
                     "delivered records left in the spool")
    return ids, converged


def _check_jobstats(cluster: Any, ids: dict[str, int]) -> None:
    for name, job in ids.items():
        done = jobstats(cluster, cluster.owner.pw_name, job)
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        assert doc["state"] == "COMPLETED" and doc["decision"] == "shared", doc  # the submit shim's key kept
        assert doc["peak_gib"] is not None and doc["energy_j"] is not None and doc["exit_code"] == 0, doc
        assert not doc["partial"] and "never have used its GPU" not in doc["advice"], doc
        if name == "oom":
            assert doc["runs"] == 2 and doc["oom"]["n"] == 1, doc  # OOM recovery's key kept too


def _delivered_once(cluster: Any, job: int) -> None:
    """The job's final summary was written once: from the spool, or (an OOM-requeued job whose last run's
    Epilog ran after the database returned) directly; a superseded earlier run's spooled summary is dropped."""
    text = "".join(p.read_text(errors="replace") for p in (cluster.base / "log").glob("*.log"))
    writes = text.count(f"job {job}: spooled record delivered") + text.count(f"job {job}: accounting database: stored")
    assert writes == 1, f"job {job}: final summary written {writes} times"


def test_slurmdbd_down_as_jobs_end_loses_no_record(cluster):
    ids, _converged = _outage(cluster, "slurmdbd", {
        "a": ("mem=4G", "--mem-mib 3000 --seconds 3"), "b": ("mem=4G", "--mem-mib 2000 --seconds 3"),
        "oom": ("mem=4G", "--mem-mib 4300 --seconds 3 --oom-first-run")})
    _check_jobstats(cluster, ids)
    for job in ids.values():
        _delivered_once(cluster, job)


def test_mariadb_down_as_jobs_end_loses_no_record(cluster):
    ids, _converged = _outage(cluster, "mariadbd", {
        "a": ("mem=4G", "--mem-mib 3000 --seconds 3"), "b": ("mem=4G", "--mem-mib 2000 --seconds 3"),
        "c": ("mem=4G", "--mem-mib 1000 --seconds 3")})
    _check_jobstats(cluster, ids)
    for job in ids.values():
        _delivered_once(cluster, job)


def _where_the_epilog_runs(cluster: Any, command: str) -> str:
    """Run ``command`` (sh) in the node's view of the files: a chroot release's slurmd (and its Epilog) has a
    mount namespace of its own, which a mount made on the host afterwards does not reach."""
    argv = ["sh", "-c", command]
    if cluster.in_chroot:
        argv = ["nsenter", "-t", str(cluster.pids[next(n for n in cluster.pids if n.startswith("slurmd-"))]),
                "-m", "-r", *argv]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (command, done.stderr)
    return done.stdout


def test_a_full_records_disk_fails_open_and_recovers(cluster):
    """The node's records directory on a full filesystem (a 64 KiB tmpfs, filled): the Epilog still ends the
    job cleanly and its record still reaches the database; the failed write leaves no file behind; once space
    returns the next job's record is in the node ledger again."""
    records = Path(cluster.agent_cfg().records_dir)
    records.mkdir(parents=True, exist_ok=True)
    _where_the_epilog_runs(cluster, f"mount -t tmpfs -o size=64k,mode=0755 tmpfs '{records}' && "
                                    f"(dd if=/dev/zero of='{records}/filler' bs=4k 2>/dev/null; true)")
    out = Path(tempfile.mkdtemp(prefix="gpushare-faults-out-"))
    out.chmod(0o777)
    try:
        full = _submit(cluster, out, "--mem-mib 2000 --seconds 2")
        cluster.wait_for(lambda: _stored(cluster, full), 120, f"job {full}'s record not in the database")
        cluster.wait_for(lambda: _final(cluster, full), 60, f"job {full} not ended in slurmctld")  # may still be COMPLETING
        files = _where_the_epilog_runs(cluster, f"find '{records}' -type f -size +0").split()
        assert files == [f"{records}/filler"], files  # nothing torn left behind
        log = (cluster.base / "log" / "agent.log").read_text(errors="replace")
        assert log.count(f"job {full}: record not written to the node ledger") == 1
        assert "drain" not in cluster.client.run("sinfo", "-h", "-o", "%T").lower()
        _where_the_epilog_runs(cluster, f"rm '{records}/filler'")  # space returns
        later = _submit(cluster, out, "--mem-mib 1000 --seconds 2")
        cluster.wait_for(lambda: _stored(cluster, later), 120, f"job {later}'s record not in the database")
        cluster.wait_for(lambda: f".{later}.0.json" in _where_the_epilog_runs(cluster, f"ls '{records}'"), 10,
                         "no ledger record after space returned")
    finally:
        _where_the_epilog_runs(cluster, f"umount -l '{records}' || true")
