"""Counts of OOM recovery outcomes, kept in ``<[oom] ledger_dir>/oom-counts.json`` (outcome -> count).

Why a file: the EpilogSlurmctld that counts is a short process of its own, so gpushare-submitd, the
controller's long-running service, reads the file when its metrics endpoint is scraped
(``gpushare_oom_recoveries_total{outcome}``, slurm_plugins/submit_metrics.py). Written atomically under a
lock beside it; submitd runs as root and reads SlurmUser's 0700 ledger directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from pathlib import Path
from typing import Any

from gpushare.atomic import write_json_atomic

log = logging.getLogger("gpushare.oom_counts")
COUNTS = "oom-counts.json"


def count(directory: str | os.PathLike[str], outcome: str) -> None:
    """Add one to ``outcome`` in the counts file; never fatal (a counter is not worth a lost record)."""
    path = Path(directory) / COUNTS
    try:
        fd = os.open(Path(directory) / ".oom-counts.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            counts = read_counts(directory)
            counts[outcome] = counts.get(outcome, 0) + 1
            write_json_atomic(path, counts, mode=0o600)
        finally:
            os.close(fd)
    except OSError as exc:
        log.info("OOM counter %s not updated: %s", path, exc)


def read_counts(directory: str | os.PathLike[str]) -> dict[str, int]:
    """outcome -> count; {} when the file is missing or not ours (a torn or foreign file counts nothing)."""
    with contextlib.suppress(OSError, ValueError):
        data: Any = json.loads((Path(directory) / COUNTS).read_text(encoding="utf-8"))
        if isinstance(data, dict):
            return {str(k)[:32]: int(v) for k, v in data.items() if isinstance(v, int) and v >= 0}
    return {}
