"""A line for the user in their job's log, written for slurmctld's hooks by the one root service there.

Why here: EpilogSlurmctld runs as SlurmUser (``slurm`` in the distributions' packages) and cannot write a
file of the job's user, yet the user must read in their own log that the job was requeued on a whole GPU
after a GPU out-of-memory, or why it stays failed. gpushare-submitd runs as root on the same host and
already answers slurmctld's account on its socket: the hook asks it (``op = "note"``), and it appends the
line as the job's user (never as root: gpushare.epilog.oom_detect.append_note forks and drops to the
owner), to the log Slurm's own record names. The request carries only the job id and the text; the owner
and the path come from Slurm, so even a trusted caller cannot point the write elsewhere.
"""

from __future__ import annotations

import re
from typing import Any

from gpushare.config import Config
from gpushare.epilog.oom_detect import append_note
from gpushare.slurm.client import SlurmClient
from gpushare.slurm.jobs import log_paths
from gpushare.slurm_plugins.protocol import ProtocolError

_JOB_ID = re.compile(r"[0-9]{1,10}", re.ASCII)
MAX_NOTE_CHARS = 1000


def write_note(cfg: Config, fields: dict[str, Any]) -> str:
    """Append the request's note to its job's log; the outcome in a few words (``written``, or why not)."""
    job_id = str(fields.get("job_id") or "")
    if not _JOB_ID.fullmatch(job_id):
        raise ProtocolError(f"note: job_id {job_id[:20]!r} is not a job id")
    message = str(fields.get("message") or "")[:MAX_NOTE_CHARS]
    if not message:
        raise ProtocolError("note: empty message")
    job = SlurmClient.from_config(cfg, timeout_s=5.0).require_job(job_id)
    paths = log_paths(job)
    if not paths:
        return "not written: the job has no log file"
    append_note(paths[0], message, job.user_id, job.group_id, cfg.oom.read_timeout_s)
    return "written"
