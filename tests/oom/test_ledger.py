"""The ledger: atomic entries, exclusive claims, and 100 concurrent writers."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from gpushare.epilog.ledger import Ledger, LedgerError, entry_key


def _entry(job: str, restarts: int = 0, **extra: object) -> dict:
    return {"job": job, "restarts": restarts, "action": "requeue", "state": "decided", "steps": [], **extra}


def test_put_get_and_retries(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l")
    ledger.ensure()
    assert ledger.get("5", 0) is None
    ledger.put(_entry("5", 0, steps=["requeuehold", "gres"]))
    ledger.put(_entry("5", 1, action="stay_failed", state="stay_failed"))
    ledger.put(_entry("55", 0, steps=["requeuehold"]))  # another job whose id starts alike
    assert ledger.get("5", 0)["steps"] == ["requeuehold", "gres"]
    assert [e["restarts"] for e in ledger.entries_for("5")] == [0, 1]
    assert ledger.retries_used("5") == 1
    assert oct(os.stat(tmp_path / "l" / "5.0.json").st_mode & 0o777) == "0o600"


def test_keys_are_validated() -> None:
    assert entry_key("12_3", 2) == "12_3.2"
    for bad in ("../x", "1;rm", "", "1 2"):
        with pytest.raises(ValueError):
            entry_key(bad, 0)


def test_unfinished_lists_only_stale_incomplete_requeues(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    ledger.put(_entry("1", state="requeued"))
    ledger.put(_entry("2", state="done"))
    ledger.put(_entry("3", action="stay_failed", state="stay_failed"))
    assert ledger.unfinished(min_age_s=30) == []  # too fresh: its own epilog may still be running
    assert [e["job"] for e in ledger.unfinished(min_age_s=0)] == ["1"]


def test_symlinked_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(LedgerError, match="not a directory"):
        Ledger(tmp_path / "link").ensure()


def test_claim_is_exclusive(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    with ledger.claim("9", 0) as first:
        assert first
        with Ledger(tmp_path).claim("9", 0) as second:  # flock is per open file: a second open conflicts
            assert not second
        with ledger.claim("9", 1) as other_run:
            assert other_run
    with ledger.claim("9", 0) as again:
        assert again


def _writer(directory: str, index: int) -> None:
    ledger = Ledger(directory)
    ledger.put(_entry(str(1000 + index)))
    for n in range(5):
        ledger.append_history({"job": str(1000 + index), "n": n, "pad": "x" * 3000})


def _claimer(directory: str, counter: str, barrier) -> None:  # type: ignore[no-untyped-def]
    ledger = Ledger(directory)
    barrier.wait()
    with ledger.claim("77", 0) as mine:
        if mine and ledger.get("77", 0) is None:
            ledger.put(_entry("77"))
            with open(counter, "a") as handle:
                handle.write("won\n")


@pytest.mark.slow
def test_one_hundred_concurrent_writers(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), i)) for i in range(100)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    ledger = Ledger(tmp_path)
    history = ledger.history()  # every line parses: no interleaving
    assert len(history) == 500
    assert sorted({h["job"] for h in history}) == [str(1000 + i) for i in range(100)]
    assert all(ledger.get(str(1000 + i), 0) for i in range(100))
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.slow
def test_concurrent_claims_decide_once(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(40)
    counter = tmp_path / "winners"
    procs = [ctx.Process(target=_claimer, args=(str(tmp_path), str(counter), barrier)) for _ in range(40)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(30)
    assert counter.read_text() == "won\n"
