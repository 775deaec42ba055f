"""Exact grammars for the job fields root and SlurmUser code reads from squeue/scontrol.

Why: users name their jobs, set their comments and choose their partitions, and every such string reaches
code running as root (the estimation service, the watchdog). ``str.isdigit`` and ``\\d`` accept Unicode
digits ('١٢', '²') that ``int()`` reads differently or rejects, so one renamed job once failed every
estimation round. Here numbers are ASCII digits only (``[0-9]`` under ``re.ASCII``), each reader returns
None for what does not match, and :class:`Skipped` counts and logs the rows a caller skips, so one foreign
row is dropped with one line, never fatal to the round.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

MAX_ID_DIGITS = 12  # job ids, uids and times fit; longer text is not one of Slurm's numbers
_NUMBER = re.compile(r"[0-9]{1,%d}" % MAX_ID_DIGITS, re.ASCII)
_JOB_ID = re.compile(r"([0-9]{1,12})", re.ASCII)
# squeue's array forms: 123_4, 123_[1-5,7], 123_[1-9%2], 123_* (the pending rest of an array)
_ARRAY_ID = re.compile(r"([0-9]{1,12})_(?:[0-9]{1,12}|\[[0-9,%\-]{1,200}\]|\*)", re.ASCII)
_PARTITION = re.compile(r"[A-Za-z0-9_.-]{1,64}", re.ASCII)


def number(text: object) -> int | None:
    """A non-negative ASCII-decimal integer, or None (Unicode digits, signs, spaces, overlong text)."""
    if isinstance(text, bool):
        return None
    if isinstance(text, int):
        return text if 0 <= text < 10 ** MAX_ID_DIGITS else None
    if not isinstance(text, str) or not _NUMBER.fullmatch(text):
        return None
    return int(text)


def job_id(text: object) -> int | None:
    """A plain job id (``123``), or None; array and het forms are not plain ids."""
    if not isinstance(text, str):
        return number(text)
    match = _JOB_ID.fullmatch(text)
    return int(match.group(1)) if match else None


def array_job_id(text: object) -> int | None:
    """The array's job id from ``123_4`` / ``123_[1-5]`` / ``123_*``, or None."""
    match = _ARRAY_ID.fullmatch(text) if isinstance(text, str) else None
    return int(match.group(1)) if match else None


def suffix_number(name: object, prefix: str) -> int | None:
    """``N`` from a job name ``<prefix>N`` (ASCII digits only), or None: how an estimation job names the
    job it serves. Anything else, e.g. '²', '١٢', ' 12', '12\\n', is not such a name."""
    if not isinstance(name, str) or not name.startswith(prefix):
        return None
    return number(name[len(prefix):])


def partition(text: object) -> str | None:
    """A partition name Slurm would accept (letters, digits, ``_.-``), or None."""
    return text if isinstance(text, str) and _PARTITION.fullmatch(text) else None


@dataclass
class Skipped:
    """Rows a reader skipped because a field did not parse: counted, and logged once per job id and field."""

    log: logging.Logger
    count: int = 0
    _seen: set[tuple[str, str]] = field(default_factory=set)

    def skip(self, job: str, what: str) -> None:
        self.count += 1
        key = (job[:40], what)
        if key not in self._seen:
            if len(self._seen) >= 4096:  # a long-running service: bounded memory, lines again after a while
                self._seen.clear()
            self._seen.add(key)
            self.log.warning("job %r skipped: %s does not parse", job[:40], what)
