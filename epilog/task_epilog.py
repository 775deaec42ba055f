"""``gpushare-task-epilog``: Slurm's TaskEpilog, which reports an out-of-memory message from the GPU node.

Why here: OOM recovery decides on the controller (EpilogSlurmctld), from the OOM text in the job's log and a
measured peak. On a real cluster the controller often cannot read that log: it is on the GPU node's own disk
(``--output=/tmp/...``) or in a 0700 home that root on the controller may not read (root squash). And once the
job has ended, Slurm no longer lets the node's Epilog write into the job's record. The TaskEpilog is the one
hook that runs as the job's user, on the node, while the job still runs (measured on 22.05, 24.11 and 26.05:
JobState=RUNNING; once for each task of each step, and for the batch script with no step id). So at the end of
the batch script it reads the tails of the job's logs as their owner and, when one ends in an OOM message,
adds ``gpushare-oom:{json}`` to the job's Comment (``scontrol update``, which the owner may do on a running
job); the controller reads it from Slurm.

Trust: the Comment is the user's to write, as the log itself is; the report only replaces reading the log.
Recovery still needs the peak the node agent (root) measured (``[oom] corroborate``), and the report counts only
for the run (``restarts``) that wrote it. A foreign Comment is kept: the report is appended after it.

Never fails a job: every error exits 0 silently, as a task epilog must not change the job's outcome.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

MARK = "gpushare-oom:"
VERSION = 1
MAX_COMMENT_CHARS = 2000  # the user's own text, kept, plus our report
_BATCH_STEPS = ("", "batch", "4294967294")  # the batch step's id as the TaskEpilog sees it, by release
_REPORT_RE = re.compile(r"(?:^| )gpushare-oom:(\{[^\n]{0,800}\})$")
_FAMILY_RE = re.compile(r"^[a-z][a-z0-9-]{0,40}$")


def render(family: str, line: str, source: str, restarts: int) -> str:
    return MARK + json.dumps({"v": VERSION, "family": family, "line": line, "source": source[-200:],
                              "restarts": restarts}, separators=(",", ":"), sort_keys=True)


def merged(comment: str, report: str) -> str:
    """``comment`` with ``report`` at its end, replacing an earlier report; the user's text kept."""
    match = _REPORT_RE.search(comment)
    own = (comment[:match.start()] if match else comment).rstrip()
    own = own[: MAX_COMMENT_CHARS - len(report) - 1]
    return f"{own} {report}" if own else report


def parse(comment: str) -> dict[str, Any] | None:
    """The report at the end of a job's Comment (the user's to write: every field checked), or None."""
    match = _REPORT_RE.search(comment or "")
    if not match:
        return None
    try:
        data = json.loads(match.group(1))
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("v") != VERSION:
        return None
    family, line, source, restarts = data.get("family"), data.get("line"), data.get("source"), data.get("restarts")
    if not (isinstance(family, str) and _FAMILY_RE.match(family) and isinstance(line, str) and line.isprintable()
            and isinstance(source, str) and source.isprintable() and isinstance(restarts, int)
            and not isinstance(restarts, bool) and 0 <= restarts < 1 << 31):
        return None
    from gpushare.epilog.oom_detect import MAX_MESSAGE_CHARS

    return {"family": family, "line": line[:MAX_MESSAGE_CHARS], "source": source[:200], "restarts": restarts}


def report(env: Mapping[str, str]) -> str:
    """What this run of the hook did (for tests; the hook itself prints nothing)."""
    if env.get("SLURM_STEP_ID", "") not in _BATCH_STEPS:
        return "not the batch step"
    job_id = env.get("SLURM_JOB_ID", "")
    if not job_id.isdigit():
        return "no job"
    if not any(env.get(k) for k in ("SLURM_JOB_GPUS", "SLURM_SHARDS_ON_NODE", "CUDA_VISIBLE_DEVICES",
                                     "SLURM_GPUS_ON_NODE")):
        return "no GPU"
    from gpushare.config import load_config
    from gpushare.epilog.oom_detect import compile_patterns, find_oom
    from gpushare.user_files import TailError, _read_tail_here
    from gpushare.slurm.client import SlurmClient
    from gpushare.slurm.jobs import log_paths

    cfg = load_config(warn=False)
    if not cfg.from_file:  # nothing reported (gpushare.hooks.no_file_line: why)
        from gpushare.hooks import no_file_line

        sys.stderr.write(no_file_line("gpushare-task-epilog", cfg) + "\n")
        return "no gpushare.toml"
    client = SlurmClient.from_config(cfg)
    job = client.job(job_id)
    if job is None:
        return "job unknown to Slurm"
    patterns = compile_patterns(cfg.oom.patterns_extra)
    for path in log_paths(job, env.get("SLURMD_NODENAME", "")):
        try:  # as the job's user, who owns the log: no privilege to drop
            text = _read_tail_here(path, cfg.oom.tail_bytes).decode("utf-8", "replace")
        except TailError:
            continue
        found = find_oom(text, patterns)
        if found:
            pattern, line = found
            text = merged(job.comment, render(pattern.family, line, path, job.restarts))
            client.update_job(job_id, comment=text)
            return f"reported {pattern.family} from {path}"
    return "no OOM message"


def main(argv: list[str] | None = None) -> int:
    try:
        report(os.environ)
    except Exception:  # noqa: BLE001 - a task epilog must never change the job's outcome
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
