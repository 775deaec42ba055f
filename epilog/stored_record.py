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

Where: the record goes into the row's SystemComment, and into its AdminComment too while that still holds our
record or nothing (older readers, and a rollback, read it there). A site tool may overwrite the database's
AdminComment at any time (Princeton's jobstats writes ``JS1:<summary>`` there from its EpilogSlurmctld, a few
seconds after the job ends); SystemComment is left alone by such tools, so both summaries survive in either
order (gpushare.slurm.record ``stored`` reads the two). When the AdminComment was overwritten before this
writer came, the controller's keys are taken from slurmctld's copy of the job (its AdminComment in memory is
never touched by ``sacctmgr``). ``sacctmgr`` on 22.05 lowercases the values it stores in either field
(measured; 24.11 and 26.05 keep the case).

Only the run that just ended is written: when the database's newest row of the job started after this run
ended (a requeue already ran again), the row is not ours and nothing is written.

Faults (docs/reliability.md): slurmdbd or its MariaDB may be down as the job ends. A failed ``sacct``/``sacctmgr``
is retried with a jittered backoff inside a time budget (``BUDGET_S``: the Epilog holds the node no longer), and
a run summary still not stored is spooled on the node (``spool``: one root-only file per run under the agent's
state directory, written atomically). The agent's loop (``gpushare.agent.followups``) and every later Epilog
deliver the spool (``deliver``) under one lock; a file is removed only after its summary is read back from the
database, and writing the same summary twice leaves the same row, so delivery is exactly once in effect. The
summary carries ``fin`` (the node's final one), so ``gpushare jobstats`` can tell the agent's partial summary
written while the job ran from a final one still waiting in a spool.
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpushare.node.comment import run_summary
from gpushare.atomic import read_json_object, write_json_atomic
from gpushare.slurm import record as record_format
from gpushare.slurm.accounting import job_rows
from gpushare.slurm.client import SlurmError
from gpushare.slurm.jobs import check_job_id

if TYPE_CHECKING:
    from gpushare.slurm.client import SlurmClient

log = logging.getLogger("gpushare.epilog")

TRIES = 20  # reads of the database while waiting for the job's end to land there
WAIT_S = 0.25
WRITES = 3  # merge-write-verify rounds when another writer changes the comment meanwhile
TIMEOUT_S = 10.0  # per sacct/sacctmgr call: slurmdbd unreachable must not hold the node long
BUDGET_S = 5.0  # the whole store in the Epilog, retries included; what is not stored by then is spooled
MAX_WAIT_S = 1.0  # the longest pause between two tries (jittered backoff from WAIT_S)
SPOOL = "pending-records"  # under the agent's state_dir
DELIVER_BUDGET_S = 30.0  # one delivery round run by the agent (main)
SPOOL_MAX_BYTES = 64 * 1024
_PERMANENT = ("no accounting database", "the newest run in the database is a later one",
              "the stored comments are not ours")
_FIELDS = ("JobIDRaw", "State", "Start", "End", "SystemComment", "AdminComment")  # the comment last: free text
_LIVE = ("PENDING", "RUNNING", "REQUEUED", "SUSPENDED", "COMPLETING", "CONFIGURING", "RESIZING")


@dataclass(frozen=True)
class Row:
    """One database row of a job (one run), as ``sacct -X -D -P`` prints it."""

    job: str
    state: str
    start: float | None
    end: float | None
    admin_comment: str
    system_comment: str = ""

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
    found = job_rows(client, job, _FIELDS)
    if found is None:
        return None
    return [Row(r["JobIDRaw"], r["State"], _time(r["Start"]), _time(r["End"]), r["AdminComment"], r["SystemComment"])
            for r in found]


def store(client: SlurmClient, job: str, record: dict[str, Any], tries: int = TRIES,
          wait_s: float = WAIT_S, budget_s: float = BUDGET_S) -> Outcome:
    """Merge ``record``'s run summary into the database's copy of the job's record (see the module)."""
    return store_summary(client, job, final_summary(record), float(record.get("end") or time.time()), tries,
                         wait_s, budget_s)


def final_summary(record: dict[str, Any]) -> dict[str, Any]:
    """The node's final run summary: ``run_summary`` marked ``fin`` (jobstats: not the agent's partial one)."""
    return {**run_summary(record), "fin": 1}


def _pause(wait_s: float, attempt: int, deadline: float) -> bool:
    """Sleep a jittered, growing pause (never past ``deadline``); False when the budget is spent."""
    pause = min(MAX_WAIT_S, wait_s * 1.5 ** attempt) * random.uniform(0.75, 1.25)
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    time.sleep(min(pause, left))
    return True


def store_summary(client: SlurmClient, job: str, summary: dict[str, Any], ended_at: float, tries: int = TRIES,
                  wait_s: float = WAIT_S, budget_s: float = BUDGET_S) -> Outcome:
    """Merge ``summary`` as the job's ``run`` into the database's record; at most ``tries`` reads while
    waiting for the row to show the run ended and at most ``budget_s`` seconds in all. A failing ``sacct`` is
    retried like a row not yet ended (slurmdbd restarting, MariaDB away) rather than ending the store."""
    deadline = time.monotonic() + budget_s
    reads = writes = 0
    row = None
    failure = ""
    for attempt in range(tries):
        try:
            found = rows(client, job)
        except SlurmError as exc:
            found, failure = [], str(exc)[-160:]
        reads += 1
        if found is None:
            return Outcome("no accounting database", reads)
        row = found[-1] if found else None
        if row is not None and row.ended:
            break
        if not _pause(wait_s, attempt, deadline):
            break
    if row is None or not row.ended:
        why = f": {failure}" if failure else ""
        return Outcome(f"the database did not show the job ended after {reads} reads{why}", reads)
    if row.start is not None and row.start > ended_at + 1.0:
        return Outcome("the newest run in the database is a later one", reads)
    live: dict[str, Any] | None = None
    for _ in range(WRITES):
        base = record_format.stored(row.admin_comment, row.system_comment)
        if base is None and live is None:
            live, extra = _live_record(client, job)
            reads += extra
        sets = _fields_to_set(row, {**(base or live or {}), "run": summary})
        if not sets:
            return Outcome("the stored comments are not ours", reads, writes)
        client.run("sacctmgr", "-i", "modify", "job", "where", f"jobid={job}", "set", *sets)
        writes += 1
        found = rows(client, job) or []
        reads += 1
        row = found[-1] if found else row
        stored = record_format.stored(row.admin_comment, row.system_comment)
        if stored is not None and _contains(stored.get("run"), summary):
            return Outcome("stored", reads, writes)
    return Outcome(f"the stored comment kept changing ({writes} writes)", reads, writes)


def _live_record(client: SlurmClient, job: str) -> tuple[dict[str, Any], int]:
    """The controller's keys from slurmctld's own copy of the job (its in-memory AdminComment, which no
    ``sacctmgr`` write reaches); empty when slurmctld no longer holds the job or the comment is not ours."""
    try:
        found = client.job(job)
    except SlurmError as exc:
        log.info("job %s: slurmctld's record unavailable (%s); the run summary is stored alone", job, str(exc)[-80:])
        return {}, 1
    record = record_format.parse(found.admin_comment) if found is not None else None
    return {key: value for key, value in (record or {}).items() if key != "run"}, 1


def _fields_to_set(row: Row, record: dict[str, Any]) -> list[str]:
    """``sacctmgr ... set`` arguments: SystemComment unless it holds someone else's text, AdminComment while it
    is ours or empty; none when neither may be written or the record cannot fit."""
    text = record_format.render(record)
    if text is None:
        return []
    sets = []
    if not row.system_comment or record_format.parse(row.system_comment) is not None:
        sets.append(f"SystemComment={text}")
    if not row.admin_comment or record_format.parse(row.admin_comment) is not None:
        sets.append(f"AdminComment={text}")
    return sets


def permanent(outcome: Outcome) -> bool:
    """True when trying again cannot store this summary (stored, or the row is not ours to write)."""
    return outcome.stored or outcome.result in _PERMANENT


# -- the node's spool ------------------------------------------------------------------------------------
def spool_dir(state_dir: str | os.PathLike[str]) -> Path:
    return Path(state_dir) / SPOOL


def spool(directory: Path, job: str, summary: dict[str, Any], ended_at: float) -> Path:
    """Keep a run summary the database did not take: one root-only file per run (job and end), atomic."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    path = directory / f"{check_job_id(job)}-{int(ended_at)}.json"
    write_json_atomic(path, {"v": 1, "job": job, "end": ended_at, "run": summary, "spooled": time.time()},
                      mode=0o600)
    return path


def pending(directory: Path) -> list[Path]:
    """Spooled summaries, oldest run first."""
    try:
        found = [p for p in directory.glob("*.json") if not p.name.startswith(".")]
    except OSError:
        return []
    return sorted(found, key=lambda p: (int(p.stem.rpartition("-")[2] or 0) if p.stem.rpartition("-")[2].isdigit()
                                        else 0, p.name))


def deliver(client: SlurmClient, directory: Path, budget_s: float = BUDGET_S) -> tuple[int, int]:
    """Store spooled summaries (oldest first) within ``budget_s``; returns (delivered, still pending).

    One deliverer at a time (a lock file beside the spool: the agent's loop and an Epilog never write the same
    row at once); a file goes only once its summary is read back, or when the row can never take it."""
    if not directory.is_dir():
        return 0, 0
    deadline = time.monotonic() + budget_s
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0, len(pending(directory))  # the other deliverer is at it
        done = 0
        files = pending(directory)
        for path in files:
            left = deadline - time.monotonic()
            if left <= 0.2:
                break
            try:
                item = read_json_object(path, SPOOL_MAX_BYTES)
            except Exception as exc:  # noqa: BLE001 - garbled: set aside, never retried forever
                log.error("spooled record %s unreadable (%s); moved aside", path.name, exc)
                path.rename(path.with_suffix(".bad"))
                continue
            if item is None or not isinstance(item.get("run"), dict) or not isinstance(item.get("job"), str):
                log.error("spooled record %s is not a record; moved aside", path.name)
                path.rename(path.with_suffix(".bad"))
                continue
            job = item["job"]
            try:
                outcome = store_summary(client, job, item["run"], float(item.get("end") or 0),
                                        tries=2, budget_s=min(left, 2.0))
            except SlurmError as exc:
                log.info("job %s: spooled record not delivered yet (%s)", job, str(exc)[-120:])
                break  # the database is still away: the rest waits for the next round
            if permanent(outcome):
                path.unlink(missing_ok=True)
                done += outcome.stored
                log.info("job %s: spooled record %s", job, "delivered to the accounting database" if outcome.stored
                         else f"dropped: {outcome.result}")
            else:
                log.info("job %s: spooled record not delivered yet (%s)", job, outcome.result)
        return done, len(pending(directory))
    finally:
        os.close(fd)


def with_timeout(client: SlurmClient, budget_s: float) -> SlurmClient:
    from gpushare.slurm.client import SlurmClient as Client

    return Client(client.conf_path, client.bin_dir, max(1.0, min(TIMEOUT_S, budget_s)))


def _contains(stored: Any, summary: dict[str, Any]) -> bool:
    return isinstance(stored, dict) and all(stored.get(key) == value for key, value in summary.items())


def main(argv: list[str] | None = None) -> int:
    """Deliver this node's spool once (the agent runs this while it holds something): exit 0 when it is
    empty afterwards, 3 while records still wait."""
    import argparse
    import sys

    from gpushare.slurm.client import SlurmClient as Client

    parser = argparse.ArgumentParser(prog="gpushare.epilog.stored_record", description=main.__doc__)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--slurm-conf")
    parser.add_argument("--bin-dir")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    # off the Epilog's path: a longer budget than an Epilog's, so a backlog drains in few rounds
    delivered, waiting = deliver(Client(args.slurm_conf, args.bin_dir, TIMEOUT_S), spool_dir(args.state_dir),
                                 budget_s=DELIVER_BUDGET_S)
    if delivered or waiting:
        log.info("%d delivered, %d still pending", delivered, waiting)
    return 3 if waiting else 0


if __name__ == "__main__":
    raise SystemExit(main())
