"""The one way our code writes a job's AdminComment: read it fresh, merge, write, read back and verify.

Why: several writers share the ``gpushare:{…}`` record (the estimation service on the controller, the node
agent's run summary and collateral notes, OOM recovery, the Epilog) and Slurm offers no compare-and-swap on
AdminComment. A writer that merged into a copy read earlier once overwrote a note written a millisecond
before it. So every write here starts from the comment as Slurm has it now (never a caller's snapshot),
merges only its own keys (gpushare/slurm/record.py keeps everyone else's), and after writing reads the
comment back: if a concurrent writer replaced it and our keys are gone, it merges again over theirs.
Writers on one host (agent, Epilog, recovery; the estimation service on the controller) are serialized by
a lock file in a directory only their user can write (``LOCK_DIR``, the node's runtime directory, made
0755 by ``gpushare.run_dir`` like every folder there: the hard cap shim reads its limits below it as the
job's user; a directory anyone else could write is not used); across hosts the read-back narrows a race to
one round trip per attempt, and the controller writes held jobs while the node writers write running ones.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpushare.atomic import flock_within
from gpushare.run_dir import make_run_dir
from gpushare.slurm import record as record_format

if TYPE_CHECKING:
    from gpushare.slurm.client import SlurmClient

log = logging.getLogger("gpushare.slurm.admin_comment")
ATTEMPTS = 4
_LOCK = threading.Lock()  # the agent writes from several threads: one read-merge-write at a time
LOCK_DIR = "/run/gpushare"
LOCK_WAIT_S = 5.0  # a writer stuck longer than this is not waited for (fail open: the read-back remains)

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
    with _LOCK, _host_lock():
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


@contextlib.contextmanager
def _host_lock(directory: str = LOCK_DIR) -> Iterator[None]:
    """Serialize read-merge-write with the other writers on this host; without a private lock dir, no lock."""
    fd = -1
    try:
        make_run_dir(directory)
        info = os.stat(directory, follow_symlinks=False)
        if info.st_uid == os.geteuid() and not info.st_mode & 0o022:
            fd = os.open(os.path.join(directory, "admin-comment.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        log.debug("no AdminComment lock in %s: %s", directory, exc)
    try:
        if fd >= 0:
            if not flock_within(fd, LOCK_WAIT_S, poll_s=0.01):
                log.warning("AdminComment lock busy for %.0f s; writing without it", LOCK_WAIT_S)
        yield
    finally:
        if fd >= 0:
            os.close(fd)
