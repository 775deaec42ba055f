"""The OOM outcome counter the EpilogSlurmctld keeps and gpushare-submitd exports (gpushare/oom_counts.py)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from gpushare.oom_counts import COUNTS, count, read_counts


def _count_many(directory: str, outcome: str, times: int) -> None:
    for _ in range(times):
        count(directory, outcome)


def test_concurrent_hooks_lose_no_count(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_count_many, args=(str(tmp_path), outcome, 40))
             for outcome in ("would_requeue", "would_requeue", "requeue")]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    assert read_counts(tmp_path) == {"would_requeue": 80, "requeue": 40}
    assert (tmp_path / COUNTS).stat().st_mode & 0o077 == 0  # SlurmUser's file, not the world's


def test_a_torn_or_foreign_file_counts_nothing_and_is_replaced(tmp_path: Path) -> None:
    (tmp_path / COUNTS).write_text('{"would_requeue": 3, "x": -1, "y": "7"')
    assert read_counts(tmp_path) == {}
    (tmp_path / COUNTS).write_text('{"would_requeue": 3, "x": -1, "y": "7"}')
    assert read_counts(tmp_path) == {"would_requeue": 3}
    count(tmp_path, "would_requeue")
    assert read_counts(tmp_path) == {"would_requeue": 4}
    count(tmp_path / "missing", "requeue")  # never raises: a counter is not worth a failed hook
