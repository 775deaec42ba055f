"""The stored record under faults, against a stand-in for Slurm's tools: a failing ``sacct`` is retried (not
given up on after one try), the whole store stays within its budget, and what the database does not take is
spooled on the node (atomic, root-only) and delivered later, once, without losing other writers' keys."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from gpushare.epilog import stored_record
from gpushare.slurm import record as record_format
from gpushare.slurm.client import SlurmError

SUMMARY = {"node": "n1", "peak_gib": 3.0, "energy_j": 100.0, "exit": 0, "fin": 1}
EXISTING = 'gpushare:{"v":1,"decision":"shared","est_gib":8.0,"est_job":"12","run":{"node":"n1","ttfk_s":1.5}}'


class Database:
    """sacct/sacctmgr of one ended job; ``down`` calls fail as an unreachable slurmdbd does."""

    def __init__(self, down: int = 0) -> None:
        self.comment, self.down, self.writes = EXISTING.replace('"', "`"), down, 0
        self.system = ""  # the row's SystemComment; ``comment`` is its AdminComment
        self.conf_path, self.bin_dir = None, None

    def run(self, tool: str, *args: str, **_: object) -> str:
        if self.down:
            self.down -= 1
            raise SlurmError(f"{tool}: error: Connection refused")
        if tool == "sacct":
            return "\x1f".join(["7", "COMPLETED", "2033-05-18T03:00:00", "2033-05-18T03:33:00", self.system,
                                self.comment]) + "\n"
        self.writes += 1
        for item in args[args.index("set") + 1:]:
            key, _, value = item.partition("=")
            setattr(self, {"AdminComment": "comment", "SystemComment": "system"}[key], value.replace('"', "`"))
        return ""


def test_a_refused_sacct_is_retried_within_the_budget():
    db = Database(down=3)
    outcome = stored_record.store_summary(db, "7", SUMMARY, 2_000_000_000.0, wait_s=0.01)
    assert outcome.stored and outcome.reads == 5
    stored = record_format.parse(db.comment) or {}
    assert stored["run"] == SUMMARY and stored["est_job"] == "12" and stored["decision"] == "shared"


def test_a_database_that_stays_away_ends_the_store_within_its_budget():
    db = Database(down=10**6)
    started = time.monotonic()
    outcome = stored_record.store_summary(db, "7", SUMMARY, 2_000_000_000.0, budget_s=0.5)
    assert not stored_record.permanent(outcome) and "Connection refused" in outcome.result
    assert time.monotonic() - started < 1.0 and outcome.reads > 1


def test_spooled_records_wait_root_only_then_are_delivered_once(tmp_path: Path):
    spool = stored_record.spool_dir(tmp_path / "state")
    path = stored_record.spool(spool, "7", SUMMARY, 2_000_000_000.0)
    assert stat.S_IMODE(os.stat(spool).st_mode) == 0o700 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert json.loads(path.read_text())["run"] == SUMMARY
    db = Database(down=10**6)
    assert stored_record.deliver(db, spool, budget_s=0.5) == (0, 1) and path.exists()
    db.down = 0
    assert stored_record.deliver(db, spool) == (1, 0) and not path.exists()
    assert stored_record.deliver(db, spool) == (0, 0) and db.writes == 1
    stored = record_format.parse(db.comment) or {}
    assert stored["run"] == SUMMARY and stored["est_job"] == "12" and stored["decision"] == "shared"


def test_a_garbled_spool_file_is_set_aside_not_retried(tmp_path: Path):
    spool = stored_record.spool_dir(tmp_path)
    stored_record.spool(spool, "7", SUMMARY, 2_000_000_000.0)
    (spool / "7-1.json").write_text('{"v": 1, "job": "7", "ru')  # a torn write (never ours: atomic.py)
    db = Database()
    assert stored_record.deliver(db, spool) == (1, 0)  # the good one still goes
    assert (spool / "7-1.bad").exists() and not (spool / "7-1.json").exists()


def _doc(run: dict[str, Any], state: str = "COMPLETED") -> dict[str, Any]:
    from gpushare.epilog import jobstats_cli

    text = (record_format.render({"decision": "shared", "run": run}) or "").replace('"', "`")
    return jobstats_cli.summarise([{"JobIDRaw": "7", "User": "alice", "State": state, "ExitCode": "0:0",
                                    "Elapsed": "00:01:05", "NodeList": "n1",
                                    "AllocTRES": "billing=1,cpu=1,gres/shard=9,mem=100M,node=1", "AdminComment": text}])


def test_jobstats_calls_the_agents_partial_record_pending_not_an_unused_gpu():
    partial = _doc({"node": "n1", "ttfk_s": 1.5})  # what the agent wrote while the job ran: no peak, no exit
    assert partial["partial"] and "pending delivery from the node n1" in partial["advice"]
    assert "never have used its GPU" not in partial["advice"]
    running = _doc({"node": "n1", "ttfk_s": 1.5}, state="RUNNING")
    assert not running["partial"]
    final = _doc({"node": "n1", "fin": 1})  # the node's final summary with nothing measured: that advice stands
    assert not final["partial"] and "never have used its GPU" in final["advice"]


def test_a_torn_history_line_is_skipped_and_a_full_disk_takes_its_line_back(tmp_path: Path):
    import errno
    import subprocess

    import pytest

    from gpushare.epilog.ledger import Ledger

    ledger = Ledger(tmp_path)
    ledger.ensure()
    ledger.append_history({"job": "1", "event": "record"})
    with open(tmp_path / "history.jsonl", "a") as handle:
        handle.write('{"job": "2", "ev')  # a crash mid-write
    assert [h["job"] for h in ledger.history()] == ["1"]
    if os.geteuid() != 0:
        pytest.skip("a full filesystem needs root (tmpfs)")
    full = tmp_path / "full"
    full.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(full)]).returncode != 0:
        pytest.skip("tmpfs cannot be mounted here")
    try:
        small = Ledger(full)
        small.ensure()
        small.append_history({"job": "1", "event": "record"})
        with pytest.raises(OSError) as raised:
            small.append_history({"job": "2", "event": "record", "pad": "x" * 16384})
        assert raised.value.errno == errno.ENOSPC
        assert (full / "history.jsonl").read_text().count("\n") == 1 and [h["job"] for h in small.history()] == ["1"]
    finally:
        subprocess.run(["umount", "-l", str(full)])
