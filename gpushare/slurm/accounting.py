"""A job's rows in Slurm's accounting database, as ``sacct`` prints them: the one reader of them.

Why one reader: ``gpushare jobstats`` and the Epilog's stored record both read a job's runs from the database,
and they must agree on the same three things. The columns are separated by a control character, since both
comments are free text and may hold ``|``; a row is the job's when its own id (JobIDRaw ``104``) is the one
asked for, or its array name (JobID ``100_4``) where the caller reads JobID; and a Slurm without an accounting
database (``sacct`` says it is disabled, or names ``accounting_storage/none``) is told apart from a job with
no rows, so callers can fall back to slurmctld's copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpushare.slurm.client import SlurmError
from gpushare.slurm.jobs import check_job_id

if TYPE_CHECKING:
    from gpushare.slurm.client import SlurmClient

SEP = "\x1f"  # sacct's column delimiter here: both comments are free text and may hold "|"


def job_rows(client: SlurmClient, job: str, fields: Sequence[str]) -> list[dict[str, str]] | None:
    """Every run of ``job`` (``123``, or an array task ``100_4``) the caller may read, oldest first, as
    ``{field: text}``; None when Slurm has no accounting database. ``fields`` start with ``JobIDRaw`` (and
    ``JobID``, for array tasks by their array name); only the last may hold the delimiter (a comment)."""
    if not fields or fields[0] != "JobIDRaw":
        raise ValueError(f"sacct fields must start with JobIDRaw: {list(fields)}")
    ids = 2 if len(fields) > 1 and fields[1] == "JobID" else 1
    try:
        out = client.run("sacct", "-n", "-P", f"--delimiter={SEP}", "-X", "-D", "-j", check_job_id(job),
                         "-o", ",".join(fields))
    except SlurmError as exc:
        if "disabled" in str(exc) or "accounting_storage/none" in str(exc):
            return None
        raise
    runs = []
    for line in out.splitlines():
        parts = line.split(SEP, len(fields) - 1)
        if len(parts) == len(fields) and job in parts[:ids]:  # an array task: 100_4 (JobID) is 104
            runs.append(dict(zip(fields, parts)))
    return runs
