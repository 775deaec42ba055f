"""Atomic, durable file writes for state and ledgers.

Why: epilogs, the agent and the submit service write state that other processes read at any moment and
that must survive a crash mid-write. Writing to a temporary file in the same directory, fsync-ing it and
renaming over the target means a reader sees the old file or the new one, never half of either.
"""

from __future__ import annotations

import fcntl
import json
import time
import os
import tempfile
from pathlib import Path
from typing import Any

from gpushare.errors import GpushareError


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_text_atomic(path: str | os.PathLike[str], text: str, mode: int = 0o644) -> None:
    write_bytes_atomic(path, text.encode("utf-8"), mode)


def write_json_atomic(path: str | os.PathLike[str], obj: Any, mode: int = 0o644) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"), mode)


class FormatVersionError(GpushareError, ValueError):
    """A state file written by a newer gpushare than this one (its ``v`` is higher than we read)."""


def read_json_object(path: str | os.PathLike[str], max_bytes: int, version: int | None = None
                     ) -> dict[str, Any] | None:
    """The JSON object a state file holds, read without following a symlink and at most ``max_bytes``.

    None when the file is missing, or is not (or no longer) a JSON object; other errors (a symlink put
    in its place, permissions) are raised for the caller to judge. With ``version``, an object whose
    ``v`` is newer raises :class:`FormatVersionError` (one line, naming the file): reading a newer shape
    as if it were ours could, say, requeue a job twice. A missing ``v`` is an older shape and is accepted.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as handle:
        try:
            data = json.loads(handle.read(max_bytes))
        except ValueError:
            return None
    if not isinstance(data, dict):
        return None
    found = data.get("v")
    if version is not None and found is not None and (not isinstance(found, int) or found > version):
        raise FormatVersionError(f"{path}: format v{found!s:.10} is not one this gpushare reads (v{version} and "
                                 "older); was it written by a newer release?")
    return data


def flock_within(fd: int, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Take an exclusive ``flock`` on ``fd`` within ``timeout_s`` (0: one try); False when another holder
    keeps it longer. Polling, not a blocking call: a hook must be able to give up and go on."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
