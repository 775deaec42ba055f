"""Limits files of the hard cap shim (gres/hardcap/hardcap.c; docs/isolation.md), written by the Prolog.

For a fraction-capped shared job under ``[agent] hardcap`` = ``shim`` or ``auto``, the Prolog (root) writes
``<dir>/job_<id>/gpu<ordinal>`` = ``"<limit_bytes> <context_bytes>"`` for each of the job's GPUs as the job
numbers them (0..n-1: Slurm's device cgroup and ``CUDA_VISIBLE_DEVICES`` renumber them), root-owned 0644
(the shim ignores anything else), and creates the job's shared usage files ``gpu<ordinal>.state``
owned by the job's user, 0600 (the shim maps them from inside the job). The TaskProlog then preloads the
library (``preload_line``). The driver's own per-cgroup limits are not implemented: ``auto`` uses the shim
and says so once per job in the Prolog's log.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Mapping

from gpushare.atomic import write_text_atomic

HARDCAP_DIR = "/run/gpushare/hardcap"  # compiled into the shim (HARDCAP_DIR in hardcap.c)
# Charged once per process and GPU for the CUDA context, which the driver allocates out of the shim's
# sight but which counts against the job's share on the device (and in the backstop's samples).
CONTEXT_BYTES = 256 << 20
_JOB_RE = re.compile(r"^\d{1,10}$")
_PATH_RE = re.compile(r"^[A-Za-z0-9_./+@-]{1,4096}$")

log = logging.getLogger("gpushare.prolog")


def job_dir(job: str, root: str = HARDCAP_DIR) -> Path:
    if not _JOB_RE.match(job):
        raise ValueError(f"job id {job[:20]!r} is not a number")
    return Path(root) / f"job_{job}"


def write_limits(job: str, uid: int, gpus: int, limit_bytes: int, root: str = HARDCAP_DIR,
                 context_bytes: int = CONTEXT_BYTES) -> Path:
    """Write the limits and usage files of ``job``'s ``gpus`` GPUs; returns the job's directory."""
    if uid < 0 or gpus < 1 or limit_bytes <= 0:
        raise ValueError(f"job {job}: uid {uid}, {gpus} GPUs, limit {limit_bytes} B: nothing to cap")
    directory = job_dir(job, root)
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    if directory.is_symlink() or (directory.stat().st_uid != 0 and os.geteuid() == 0):
        raise ValueError(f"{directory} is not root's own directory")
    os.chmod(directory, 0o755)
    for ordinal in range(gpus):
        write_text_atomic(directory / f"gpu{ordinal}", f"{limit_bytes} {context_bytes}\n", mode=0o644)
        state = directory / f"gpu{ordinal}.state"
        fd = os.open(state, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, 0)  # a fresh budget: nothing of an earlier job with this id survives
            if os.geteuid() == 0:
                os.fchown(fd, uid, -1)
        finally:
            os.close(fd)
    return directory


def clear(job: str, root: str = HARDCAP_DIR) -> None:
    """Remove ``job``'s limits and usage files (Epilog; missing is fine)."""
    shutil.rmtree(job_dir(job, root), ignore_errors=True)


def apply(job: str, uid: int, gpus: int, exports: Mapping[str, str], mode: str, root: str = HARDCAP_DIR) -> bool:
    """The Prolog's step: write the files for a fraction-capped job under ``mode`` ``shim``/``auto``.
    True: written (the TaskProlog is to preload the shim). Never raises: the job proceeds uncapped."""
    if mode not in ("shim", "auto") or exports.get("GPUSHARE_CAPS_MODE") != "fraction":
        if mode == "driver":
            log.warning("job %s: hardcap=driver: per-cgroup driver memory limits are not implemented; not hard-capped", job)
        return False
    try:
        limit = int(str(exports.get("GPUSHARE_MEM_LIMIT_MIB", ""))) << 20
        if mode == "auto":
            log.info("job %s: hardcap=auto: driver memory limits unavailable (not implemented); using the shim", job)
        write_limits(job, uid, gpus, limit, root)
        return True
    except (OSError, ValueError) as exc:
        log.warning("job %s: hard cap files not written (%s); the job runs without the hard cap", job, exc)
        return False


def preload_line(env: Mapping[str, str], library: str) -> list[str]:
    """``export LD_PRELOAD=<library>[:<user's>]`` for the TaskProlog; nothing where the library is missing
    or a path has characters that cannot be passed on safely."""
    if not _PATH_RE.match(library) or not os.path.isfile(library):
        return []
    user = [p for p in re.split(r"[: ]", env.get("LD_PRELOAD", "")) if p and p != library]
    value = ":".join([library] + user)
    if not _PATH_RE.match(value.replace(":", "/")):
        return []
    return [f"export LD_PRELOAD={value}"]
