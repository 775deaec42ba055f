"""A line for the user in their job's log, written for slurmctld's hooks by the one root service there.

Why here: EpilogSlurmctld runs as SlurmUser (``slurm`` in the distributions' packages) and cannot write a
file of the job's user, yet the user must read in their own log that the job was requeued on a whole GPU
after a GPU out-of-memory, or why it stays failed. gpushare-submitd runs as root on the same host and
already answers slurmctld's account on its socket: the hook asks it (``op = "note"``), and it appends the
line as the job's user (never as root: gpushare.user_files.append_note forks and drops to the
owner), to the log Slurm's own record names. Before an OOM requeue it also copies the end of the failed
run's logs aside (``<log>.oom-run<N>.<token>``), which slurmstepd would otherwise truncate when the job starts
again. The request carries only the job id, a restart count, the copies' random token and the text; the owner
and the paths come from Slurm, so even a trusted caller cannot point the write elsewhere.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gpushare.config import Config
from gpushare.slurm.client import SlurmClient
from gpushare.slurm.jobs import log_paths
from gpushare.slurm_plugins.protocol import ProtocolError
from gpushare.user_files import TOKEN, append_note, keep_logs, note_kept, restore_logs

_JOB_ID = re.compile(r"[0-9]{1,10}", re.ASCII)
_RUN = re.compile(r"[0-9]{1,4}", re.ASCII)
MAX_NOTE_CHARS = 1000


def write_note(cfg: Config, fields: dict[str, Any]) -> str:
    """Carry out one note request; the outcome in a few words (``written``, ``kept [names]``, or why not).

    ``step`` (absent: append ``message``) ``keep`` copies the job's logs aside for run ``run`` before its
    requeue (slurmstepd truncates them when it starts again) under names made with ``token``, and answers
    ``kept`` and the JSON list of the copies (empty: no log here to copy); ``restore`` drops the copies
    when the requeue did not happen; with ``run`` and ``token`` a message also goes to that run's copies."""
    job_id = str(fields.get("job_id") or "")
    if not _JOB_ID.fullmatch(job_id):
        raise ProtocolError(f"note: job_id {job_id[:20]!r} is not a job id")
    run_text = str(fields.get("run", ""))
    if run_text and not _RUN.fullmatch(run_text):
        raise ProtocolError(f"note: run {run_text[:20]!r} is not a restart count")
    step = str(fields.get("step") or "append")
    if step not in ("append", "keep", "restore") or (step != "append" and not run_text):
        raise ProtocolError(f"note: step {step[:20]!r} (with run) is not one of append, keep, restore")
    token = str(fields.get("token") or "")
    if (token or step != "append") and not TOKEN.fullmatch(token):
        raise ProtocolError(f"note: token {token[:20]!r} is not 12 hex digits")
    message = str(fields.get("message") or "")[:MAX_NOTE_CHARS]
    if step == "append" and not message:
        raise ProtocolError("note: empty message")
    job = SlurmClient.from_config(cfg, timeout_s=5.0).require_job(job_id)
    paths = log_paths(job)
    timeout_s = cfg.oom.read_timeout_s
    if step == "keep":
        kept = keep_logs(paths, int(run_text), job.user_id, job.group_id, timeout_s, token, job.work_dir)
        return "kept " + json.dumps(kept, ensure_ascii=True)
    if step == "restore":
        restore_logs(paths, int(run_text), token, job.user_id, job.group_id, timeout_s, job.work_dir)
        return "restored"
    if not paths:
        return "not written: the job has no log file"
    if run_text and token:  # first: the copies outlive the log, which the rerun truncates
        note_kept(paths, int(run_text), token, message, job.user_id, job.group_id, timeout_s, job.work_dir)
    append_note(paths[0], message, job.user_id, job.group_id, timeout_s)
    return "written"
