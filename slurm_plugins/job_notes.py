"""A line for the user in their job's log, written for slurmctld's hooks by the one root service there.

Why here: EpilogSlurmctld runs as SlurmUser (``slurm`` in the distributions' packages) and cannot write a
file of the job's user, yet the user must read in their own log that the job was requeued on a whole GPU
after a GPU out-of-memory, or why it stays failed. gpushare-submitd runs as root on the same host and
already answers slurmctld's account on its socket: the hook asks it (``op = "note"``), and it appends the
line as the job's user (never as root: gpushare.user_files.append_note forks and drops to the
owner), to the log Slurm's own record names. Before an OOM requeue it also copies the end of the failed
run's logs aside (``<log>.oom-run<N>``), which slurmstepd would otherwise truncate when the job starts again. The
request carries only the job id, a restart count and the text; the owner and the paths come from Slurm, so
even a trusted caller cannot point the write elsewhere.
"""

from __future__ import annotations

import re
from typing import Any

from gpushare.config import Config
from gpushare.slurm.client import SlurmClient
from gpushare.slurm.jobs import log_paths
from gpushare.slurm_plugins.protocol import ProtocolError
from gpushare.user_files import append_note, kept_name, keep_logs

_JOB_ID = re.compile(r"[0-9]{1,10}", re.ASCII)
_RUN = re.compile(r"[0-9]{1,4}", re.ASCII)
MAX_NOTE_CHARS = 1000


def write_note(cfg: Config, fields: dict[str, Any]) -> str:
    """Carry out one note request; the outcome in a few words (``written``, ``kept``, or why not).

    ``step`` (absent: append ``message``) ``keep`` copies the job's logs aside for run ``run`` before its
    requeue (slurmstepd truncates them when it starts again), ``restore`` drops the copies when the requeue
    did not happen; with ``run`` a message also goes to that run's kept copy."""
    job_id = str(fields.get("job_id") or "")
    if not _JOB_ID.fullmatch(job_id):
        raise ProtocolError(f"note: job_id {job_id[:20]!r} is not a job id")
    run_text = str(fields.get("run", ""))
    if run_text and not _RUN.fullmatch(run_text):
        raise ProtocolError(f"note: run {run_text[:20]!r} is not a restart count")
    step = str(fields.get("step") or "append")
    if step not in ("append", "keep", "restore") or (step != "append" and not run_text):
        raise ProtocolError(f"note: step {step[:20]!r} (with run) is not one of append, keep, restore")
    message = str(fields.get("message") or "")[:MAX_NOTE_CHARS]
    if step == "append" and not message:
        raise ProtocolError("note: empty message")
    job = SlurmClient.from_config(cfg, timeout_s=5.0).require_job(job_id)
    paths = log_paths(job)
    if not paths:
        return "not written: the job has no log file"
    timeout_s = cfg.oom.read_timeout_s
    if step in ("keep", "restore"):
        handled = keep_logs(paths, step, int(run_text), job.user_id, job.group_id, timeout_s)
        return ("kept" if step == "keep" else "restored") if handled else "not kept: no log file exists"
    for target in [paths[0]] + ([kept_name(paths[0], int(run_text))] if run_text else []):
        append_note(target, message, job.user_id, job.group_id, timeout_s)
    return "written"
