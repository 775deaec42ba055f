"""The job's gpushare record in Slurm's accounting database, written by the node Epilog as the job ends.

Why here and why this way: the node's records ledger dies with the node, users cannot log into GPU nodes, and
Slurm refuses ``scontrol update admincomment=`` once the job is COMPLETING (22.05; docs/compatibility.md).
``sacctmgr modify job where jobid=N set AdminComment=...`` writes the database row of a finished job on every
supported release, and ``sacct`` (``gpushare jobstats``) reads it from any login node. Everything goes through
Slurm's own tools: the controller never reads the node's files.

Ordering: slurmctld sends the job's end (state, times and its in-memory AdminComment) to slurmdbd on its own,
concurrently with this Epilog, and a later end message rewrites the row's comment. So this writer waits until
the database shows this run ended, merges its ``run`` summary into the comment stored there (the submit
decision, an OOM recovery's ``oom`` — everything the controller wrote stays; ``run`` itself is replaced whole,
since this summary is the run's final one and an earlier run's keys must not linger), writes, and reads back;
a comment changed meanwhile is merged again. Tries are bounded (``TRIES``): the Epilog must not hold a node.

Only the run that just ended is written: when the database's newest row of the job started after this run
ended (a requeue already ran again), the row is not ours and nothing is written.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from gpushare.agent.comment import run_summary
from gpushare.slurm import record as record_format
from gpushare.slurm.client import SlurmError
from gpushare.slurm.jobs import check_job_id

if TYPE_CHECKING:
    from gpushare.slurm.client import SlurmClient

log = logging.getLogger("gpushare.epilog")

TRIES = 20  # reads of the database while waiting for the job's end to land there
WAIT_S = 0.25
WRITES = 3  # merge-write-verify rounds when another writer changes the comment meanwhile
TIMEOUT_S = 10.0  # per sacct/sacctmgr call: slurmdbd unreachable must not hold the node long
_FIELDS = "JobIDRaw,State,Start,End,AdminComment"
_LIVE = ("PENDING", "RUNNING", "REQUEUED", "SUSPENDED", "COMPLETING", "CONFIGURING", "RESIZING")


@dataclass(frozen=True)
class Row:
    """One database row of a job (one run), as ``sacct -X -D -P`` prints it."""

    job: str
    state: str
    start: float | None
    end: float | None
    admin_comment: str

    @property
    def ended(self) -> bool:
        return self.end is not None and self.state.split()[0] not in _LIVE


@dataclass(frozen=True)
class Outcome:
    """What happened: ``stored`` (written and read back), or why not; reads/writes for the benchmark."""

    result: str
    reads: int = 0
    writes: int = 0

    @property
    def stored(self) -> bool:
        return self.result == "stored"


def _time(text: str) -> float | None:
    if text in ("", "Unknown", "None", "N/A"):
        return None
    try:
        return datetime.fromisoformat(text).timestamp()  # sacct prints local time without a zone
    except ValueError:
        return None


def rows(client: SlurmClient, job: str) -> list[Row] | None:
    """Every run of ``job`` in the database, oldest first; None when Slurm has no accounting database."""
    try:
        out = client.run("sacct", "-n", "-P", "-X", "-D", "-j", check_job_id(job), "-o", _FIELDS)
    except SlurmError as exc:
        if "disabled" in str(exc) or "accounting_storage/none" in str(exc):
            return None
        raise
    found = []
    for line in out.splitlines():
        parts = line.split("|", 4)  # AdminComment is last: a "|" inside it stays there
        if len(parts) == 5 and parts[0] == job:
            found.append(Row(parts[0], parts[1], _time(parts[2]), _time(parts[3]), parts[4]))
    return found


def store(client: SlurmClient, job: str, record: dict[str, Any], tries: int = TRIES,
          wait_s: float = WAIT_S) -> Outcome:
    """Merge ``record``'s run summary into the database's copy of the job's AdminComment (see the module)."""
    summary = run_summary(record)
    ended_at = float(record.get("end") or time.time())
    reads = writes = 0
    row = None
    for _ in range(tries):
        found = rows(client, job)
        reads += 1
        if found is None:
            return Outcome("no accounting database", reads)
        row = found[-1] if found else None
        if row is not None and row.ended:
            break
        time.sleep(wait_s)
    else:
        return Outcome(f"the database did not show the job ended after {tries} reads", reads)
    assert row is not None
    if row.start is not None and row.start > ended_at + 1.0:
        return Outcome("the newest run in the database is a later one", reads)
    for _ in range(WRITES):
        text = record_format.merge(row.admin_comment or None, run=summary)
        if text is None:
            return Outcome("the stored AdminComment is not ours", reads, writes)
        client.run("sacctmgr", "-i", "modify", "job", "where", f"jobid={job}", "set", f"AdminComment={text}")
        writes += 1
        found = rows(client, job) or []
        reads += 1
        row = found[-1] if found else row
        stored = record_format.parse(row.admin_comment)
        if stored is not None and _contains(stored.get("run"), summary):
            return Outcome("stored", reads, writes)
    return Outcome(f"the stored comment kept changing ({writes} writes)", reads, writes)


def _contains(stored: Any, summary: dict[str, Any]) -> bool:
    return isinstance(stored, dict) and all(stored.get(key) == value for key, value in summary.items())
