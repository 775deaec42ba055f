"""What the slurmd Prolog/Epilog may take from their environment and from Slurm, validated.

Why paranoid: these hooks run as root, and part of what reaches them is chosen by the job's user (the
job's name, comment, work directory, and — for the TaskProlog — the whole environment). Only values
slurmd itself sets are read here (job id, uid, user, GPU indices), each against a strict pattern, and the
job's estimate comes from Slurm's structured JSON (``SlurmClient.job``), never from text a user can
write into ``scontrol show job`` output. Anything malformed yields "not ours": the hook exits 0.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from gpushare.slurm.jobs import Job

log = logging.getLogger("gpushare.prolog")
_JOB_RE = re.compile(r"^\d{1,10}$")
_USER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@-]{0,63}$")
_GPUS_RE = re.compile(r"^\d{1,4}(,\d{1,4}){0,63}$")
_SHARD_RE = re.compile(r"(?:^|,)(?:gres[:/])?shard(?::[A-Za-z0-9_.-]+)?:(\d{1,6})(?:,|$)")


@dataclass(frozen=True)
class HookJob:
    job: str
    uid: int
    user: str
    gpus: list[int]


def job_from_env(env: Mapping[str, str] = os.environ) -> HookJob | None:
    """The job a slurmd hook runs for, or None when it has no GPUs or anything looks wrong."""
    job = env.get("SLURM_JOB_ID", "")
    if not _JOB_RE.match(job):
        log.warning("hook: SLURM_JOB_ID %r is not a job id; ignored", job[:20])
        return None
    gpus_text = env.get("SLURM_JOB_GPUS", "") or env.get("CUDA_VISIBLE_DEVICES", "")
    if not gpus_text or not _GPUS_RE.match(gpus_text):
        return None  # not a GPU job (or a MIG/UUID form the agent does not manage)
    try:
        uid = int(env.get("SLURM_JOB_UID", "-1"))
    except ValueError:
        uid = -1
    user = env.get("SLURM_JOB_USER", "")
    return HookJob(job, uid, user if _USER_RE.match(user) else "", sorted({int(g) for g in gpus_text.split(",")}))


def shards_of(tres: str | None) -> int | None:
    """Shard count of a TRES string like ``gres:shard:12`` / ``gres/shard:12`` (None if no shards)."""
    if not tres:
        return None
    match = _SHARD_RE.search(tres.strip())
    return int(match.group(1)) if match else None


def slurm_facts(job: HookJob, slurm_job: Job | None) -> dict[str, Any]:
    """Registration facts for the agent from the hook's job and Slurm's structured record of it (may be None)."""
    from gpushare.slurm.record import parse as parse_record

    shards = shards_of(slurm_job.tres_per_node if slurm_job else None)
    record = parse_record(slurm_job.admin_comment if slurm_job else None) or {}
    facts: dict[str, Any] = {
        "job": job.job, "uid": job.uid, "user": job.user, "gpus": job.gpus,
        "restarts": max(0, slurm_job.restarts) if slurm_job else 0,
        "shared": shards is not None, "shards": shards, "est_gib": None, "margin_gib": None,
    }
    if record.get("decision") == "shared":
        for key in ("est_gib", "margin_gib"):
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1 << 20:
                facts[key] = float(value)
    return facts
