"""The estimate cache: ``<[submit] cache_dir>/by-script/<key>.json``, its keys, its one reader and the one
writer of the learned floor.

The submit path (gpushare.estimate.source) sizes a job from the document cached for its batch script, or for
its training command. After an OOM we know a lower bound the estimate missed: the job did not fit in the
memory it was given. The writer raises every peak in those documents to at least ``LEARN_FACTOR`` times the
failed size (capped at the whole GPU, where the job is exclusive anyway); the submit decision then adds its
usual margin on top. Raising never lowers: a larger estimate that is already there stays.

Why a factor and not the true peak: an OOM tells us only that the need exceeded the request; the re-run
on a whole GPU does not report its peak here. A factor of 1.5 on the failed request (which already held
the margin) covers an under-estimate of up to 50 % in one step (docs/estimator.md records a 13 % median and
30-45 % for large-batch convnets), and the cap keeps it from ever asking for more than a GPU.

The cache directory is written as root (or SlurmUser), so it must be a real directory owned by root (or by
us): a symlinked or user-owned ``by-script`` could otherwise steer the write elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from gpushare.atomic import write_json_atomic
from gpushare.config import Config
from gpushare.estimate.directives import parse_directives
from gpushare.estimate.schema import byte_field
from gpushare.gpus import GiB

LEARN_FACTOR = 1.5
MAX_DOC_BYTES = 1 << 20  # the writer merges into documents up to this size
BY_SCRIPT = "by-script"


def directory(cfg: Config) -> Path:
    """The folder of cached documents (gpushare-submitd creates it owned by SlurmUser)."""
    return Path(cfg.submit.cache_dir) / BY_SCRIPT


def script_cache_key(script: str, uid: int) -> str:
    """Cache key of one user's batch script: ``<uid>.<sha256 of the script>``.

    Why the uid: the cache learns from OOMs (``write_learned_floor``); keyed by the script alone, one user's
    (possibly faked) OOM would resize another user's identical script."""
    if not isinstance(uid, int) or isinstance(uid, bool) or uid < 0:
        raise ValueError(f"bad uid {uid!r}")
    return f"{uid}.{hashlib.sha256(script.encode('utf-8', 'surrogateescape')).hexdigest()}"


def command_cache_key(script: str, directive_script: str | None, work_dir: str | None, uid: int) -> str | None:
    """Key of an OOM lesson for one user's training command: ``<uid>.cmd.<sha256 of working directory,
    training script and its arguments as found in the batch script>``; None when no command is found or the
    working directory is unknown.

    Why besides the script's own key: what decides a job's memory is the command it trains with, not the
    bytes of its batch script; keyed by those bytes, one edited comment line dropped a learned floor and the
    next run fell into the same OOM. The working directory tells two projects' ``train.py`` apart."""
    from gpushare.estimate.script_discovery import TrainingCommand, find_training_command

    if not isinstance(uid, int) or isinstance(uid, bool) or uid < 0 or not work_dir or not script:
        return None
    found = find_training_command(script, directive_script)
    if not isinstance(found, TrainingCommand):
        return None
    text = "\0".join((work_dir, found.script, *found.args))
    return f"{uid}.cmd.{hashlib.sha256(text.encode('utf-8', 'surrogateescape')).hexdigest()}"


def read_document(cfg: Config, key: str, max_bytes: int | None = None) -> Any:
    """The cached document under ``key`` (None: none, or unreadable); at most ``max_bytes`` are read
    (default ``[submit] max_estimate_file_bytes``)."""
    limit = cfg.submit.max_estimate_file_bytes if max_bytes is None else max_bytes
    try:
        return json.loads((directory(cfg) / f"{key}.json").read_bytes()[:limit])
    except (OSError, ValueError):
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


def write_learned_floor(cfg: Config, script: str, uid: int, work_dir: str | None, failed_bytes: int,
                        cap_bytes: int, job_id: str, now: float) -> Path:
    """Raise the cached estimate of ``uid``'s ``script`` and, with ``work_dir``, the lesson of its training
    command (``command_cache_key``: it survives cosmetic edits of the script); returns the script's file."""
    folder = directory(cfg)
    folder.mkdir(mode=0o755, parents=True, exist_ok=True)
    for part in (folder.parent, folder):
        info = os.lstat(part)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid not in (0, os.geteuid()):
            raise PermissionError(f"{part}: not a directory owned by root; estimate not updated")
    command_key = command_cache_key(script, parse_directives(script, cfg.submit.max_script_bytes).script,
                                     work_dir, uid)
    names = [script_cache_key(script, uid)] + ([command_key] if command_key else [])
    for name in names:
        old = read_document(cfg, name, MAX_DOC_BYTES)
        write_json_atomic(folder / f"{name}.json", learned_document(old, failed_bytes, cap_bytes, job_id, now))
    return folder / f"{names[0]}.json"
