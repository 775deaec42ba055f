"""The one way our code writes a job's AdminComment: read it fresh, merge, write, read back and verify.

Why: several writers share the ``gpushare:{…}`` record (the estimation service on the controller, the node
agent's run summary and collateral notes, OOM recovery, the Epilog) and Slurm offers no compare-and-swap on
AdminComment. A writer that merged into a copy read earlier once overwrote a note written a millisecond
before it. So every write here starts from the comment as Slurm has it now (never a caller's snapshot),
merges only its own keys (gpushare/slurm/record.py keeps everyone else's), and after writing reads the
comment back: if a concurrent writer replaced it and our keys are gone, it merges again over theirs.
Within one process writes are serialized; across hosts the re-read narrows the window to one
read-write-read round trip per attempt.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpushare.slurm import record as record_format

if TYPE_CHECKING:
    from gpushare.slurm.client import SlurmClient

log = logging.getLogger("gpushare.slurm.admin_comment")
ATTEMPTS = 4
_LOCK = threading.Lock()  # the agent writes from several threads: one read-merge-write at a time

Merge = Callable[[str | None], str | None]


def merge_fields(**fields: Any) -> Merge:
    """A merge that sets ``fields`` as top-level keys of the record (other writers' keys kept)."""
    return lambda existing: record_format.merge(existing, **fields)


def merge_write(client: SlurmClient, job_id: str | int, merge: Merge, attempts: int = ATTEMPTS,
                sleep: Callable[[float], None] = time.sleep) -> bool:
    """Merge into the job's current AdminComment and write it; True once Slurm holds our keys.

    ``merge(existing)`` returns the new comment, or None when the comment is someone else's or would
    overflow (left alone, False). It must be idempotent (merging into its own result changes nothing):
    that is how the read-back tells whether our keys survived. Slurm errors propagate to the caller."""
    with _LOCK:
        for attempt in range(attempts):
            job = client.job(job_id)
            if job is None:
                return False
            existing = job.admin_comment or None
            text = merge(existing)
            if text is None:
                return False
            if text == existing:
                return True
            client.update_job(job_id, admincomment=text)
            after = client.job(job_id)
            current = (after.admin_comment or None) if after is not None else None
            if current is not None and merge(current) == current:
                return True
            log.info("job %s: AdminComment changed under our write (attempt %d); merging again", job_id, attempt + 1)
            sleep(0.05 * (attempt + 1))
    log.warning("job %s: AdminComment kept changing; our keys may be missing", job_id)
    return False
