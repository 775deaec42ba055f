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


def slurm_facts(job: HookJob, slurm_job: Job | None) -> dict[str, Any]:
    """Registration facts for the agent from the hook's job and Slurm's structured record of it (may be None)."""
    from gpushare.node.jobs import registration_facts

    return registration_facts(job.job, job.uid, job.user, job.gpus, slurm_job)
