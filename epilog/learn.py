"""Teach the estimate cache from an observed GPU OOM, so the same batch script is not under-sized again.

What the job had when it ran out comes from its GRES request (shards are 1 GiB each, a MIG slice its usable
memory); the lesson itself, ``LEARN_FACTOR`` times that size as the new floor, is written by the cache's one
writer (gpushare.estimate.cache, which the submit path reads).
"""

from __future__ import annotations

import time
from pathlib import Path

from gpushare.config import Config
from gpushare.estimate.cache import write_learned_floor
from gpushare.policy.oom_recovery import failed_size_bytes
from gpushare.slurm.gres_request import GresRequest


def learn_from_oom(cfg: Config, script: str, job_id: str, request: GresRequest, cap_bytes: int,
                   uid: int | None, now: float | None = None, work_dir: str | None = None) -> Path | None:
    """Raise the cached estimate of ``uid``'s ``script`` and, with ``work_dir``, the lesson of its training
    command; returns the script's file (None: nothing to learn, or the owner is unknown: one user's OOM never
    resizes another user's script)."""
    failed = failed_size_bytes(request, cfg)
    if failed is None or not script or uid is None:
        return None
    return write_learned_floor(cfg, script, uid, work_dir, failed, cap_bytes, job_id, time.time() if now is None else now)
