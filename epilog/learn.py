"""Teach the estimate cache from an observed GPU OOM, so the same batch script is not under-sized again.

The submit path (slurm_plugins/estimate_source.py) sizes a job from ``<[submit] cache_dir>/by-script/
<sha256 of the batch script>.json``. After an OOM we know a lower bound the estimate missed: the job did
not fit in the memory it was given. We raise every peak in that document to at least ``LEARN_FACTOR``
times the failed size (capped at the whole GPU, where the job is exclusive anyway); the submit decision
then adds its usual margin on top. Raising never lowers: a larger estimate that is already there stays.

Why a factor and not the true peak: an OOM tells us only that the need exceeded the request; the re-run
on a whole GPU does not report its peak here. A factor of 1.5 on the failed request (which already held
the margin) covers an under-estimate of up to 50 % in one step (docs/estimator.md records a 13 % median and
30-45 % for large-batch convnets), and the cap keeps it from ever asking for more than a GPU.

The cache directory is written as root, so it must be a real directory owned by root (or by us): a
symlinked or user-owned ``by-script`` could otherwise steer the write elsewhere.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from gpushare.atomic import write_json_atomic
from gpushare.config import Config
from gpushare.estimator_cli.schema import byte_field
from gpushare.gpus import GiB
from gpushare.slurm_plugins.directives import parse_directives
from gpushare.slurm_plugins.estimate_source import command_cache_key, script_cache_key
from gpushare.slurm.gres_request import parse_gres

LEARN_FACTOR = 1.5
MAX_DOC_BYTES = 1 << 20


def failed_size_bytes(tres_per_node: str, cfg: Config) -> int | None:
    """GPU memory the job had when it ran out: shards (1 GiB each) or its MIG slice; None if unknown."""
    try:
        items = parse_gres(tres_per_node)
    except ValueError:
        return None
    for item in items:
        if item.name == "shard":
            return item.count * GiB
        if item.name == "gpu" and item.type:
            for model in cfg.gpus.values():
                for profile in model.mig_profiles:
                    if profile.name == item.type:
                        return profile.usable_bytes
    return None


def learned_document(old: dict[str, Any] | None, failed_bytes: int, cap_bytes: int, job_id: str,
                     now: float) -> dict[str, Any]:
    """The cache document after the lesson (pure; ``old`` may be None or any shape)."""
    floor = min(int(failed_bytes * LEARN_FACTOR), cap_bytes) if cap_bytes > 0 else int(failed_bytes * LEARN_FACTOR)
    doc = dict(old) if isinstance(old, dict) else {}
    targets = doc.get("targets")
    if isinstance(targets, list):
        doc["targets"] = [_raise(row, floor) if isinstance(row, dict) else row for row in targets]
    elif isinstance(targets, dict):
        doc["targets"] = {k: _raise(v, floor) if isinstance(v, dict) else v for k, v in targets.items()}
    current = byte_field(doc, "peak_total_bytes")
    if current is None or current < floor:
        doc["peak_total_bytes"] = floor
    doc["learned"] = {"from_job": job_id, "failed_gib": round(failed_bytes / GiB, 2), "factor": LEARN_FACTOR,
                      "at": round(now, 3)}
    return doc


def _raise(row: dict[str, Any], floor: int) -> dict[str, Any]:
    value = byte_field(row, "peak_total_bytes")
    if value is not None and value >= floor:
        return row
    return {**row, "peak_total_bytes": floor}


def learn_from_oom(cfg: Config, script: str, job_id: str, tres_per_node: str, cap_bytes: int,
                   uid: int | None, now: float | None = None, work_dir: str | None = None) -> Path | None:
    """Raise the cached estimate of ``uid``'s ``script`` and, with ``work_dir``, the lesson of its training
    command (``command_cache_key``: it survives cosmetic edits of the script); returns the script's file
    (None: nothing to learn, or the owner is unknown: one user's OOM never resizes another user's script)."""
    failed = failed_size_bytes(tres_per_node, cfg)
    if failed is None or not script or uid is None:
        return None
    directory = Path(cfg.submit.cache_dir) / "by-script"
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    for part in (directory.parent, directory):
        info = os.lstat(part)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid not in (0, os.geteuid()):
            raise PermissionError(f"{part}: not a directory owned by root; estimate not updated")
    command_key = command_cache_key(script, parse_directives(script, cfg.submit.max_script_bytes).script,
                                     work_dir, uid)
    names = [script_cache_key(script, uid)] + ([command_key] if command_key else [])
    for name in names:
        path = directory / f"{name}.json"
        try:
            old = json.loads(path.read_bytes()[:MAX_DOC_BYTES])
        except (OSError, ValueError):
            old = None
        write_json_atomic(path, learned_document(old, failed, cap_bytes, job_id, time.time() if now is None else now))
    return directory / f"{names[0]}.json"
