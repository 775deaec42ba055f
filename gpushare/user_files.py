"""A job's files, read and written as the job's user: the tail of its logs, a note appended to them, and a
copy of a failed run's log kept aside before a requeue.

Why as the user: the code that needs this runs as root or SlurmUser (EpilogSlurmctld, gpushare-submitd) and
the paths come from the job. Even with O_NOFOLLOW on the last component, a directory symlink or a hard
link planted by the user could point root at /etc/shadow; doing the work in a child that has dropped to the
job's uid and groups makes the question moot (they can only make us touch what they can). Regular files
only, never a FIFO or device; a hung file system costs at most the timeout (docs/oom-messages.md,
"Security").
"""

from __future__ import annotations

import os
import pwd
import select
import signal
import stat
import time
from typing import Callable, Iterable

from gpushare.errors import GpushareError


class TailError(GpushareError, OSError):
    """A log could not be read safely; the message says why (for the ledger, never for a decision)."""


def _read_tail_here(path: str, max_bytes: int) -> bytes:
    """Read the last ``max_bytes`` of a regular file without following a final symlink or opening devices."""
    try:
        handle = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise TailError(f"{path}: {exc.strerror}") from None
    try:
        info = os.fstat(handle)
        if stat.S_ISLNK(info.st_mode):
            raise TailError(f"{path}: is a symbolic link; not followed")
        if not stat.S_ISREG(info.st_mode):
            raise TailError(f"{path}: not a regular file")
        # Re-open through the O_PATH descriptor: same inode, and a FIFO or device is never opened.
        fd = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except TailError:
        raise
    except OSError as exc:
        raise TailError(f"{path}: {exc.strerror}") from None
    finally:
        os.close(handle)
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - max_bytes)
        chunks, got = [], 0
        while got < max_bytes:
            chunk = os.pread(fd, max_bytes - got, start + got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if start > 0:  # we began mid-line: drop the partial first line
        cut = data.find(b"\n")
        data = data[cut + 1:] if cut >= 0 else data
    return data


def user_groups(uid: int, gid: int) -> list[int]:
    """The job owner's full group list (primary + supplementary), as a login would have it.

    Why: a log in a directory readable through a supplementary group (a project group) is readable by
    the user; dropping to the primary group alone would make the hook miss it. Looked up in the forked
    child, so a hung name service costs at most the read timeout. Unknown user: the primary group only."""
    try:
        name = pwd.getpwuid(uid).pw_name
        return sorted(set(os.getgrouplist(name, gid)) | {gid})
    except (KeyError, OSError):
        return [gid]


def _drop_to(uid: int, gid: int) -> None:
    os.setgroups(user_groups(uid, gid))
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise PermissionError("could not drop privileges")


def read_tail(path: str, max_bytes: int, uid: int | None = None, gid: int | None = None,
              timeout_s: float = 10.0) -> str:
    """The decoded tail of ``path``; as root it is read by a child running as ``uid``/``gid``.

    Why a child: the path is the job's. Even with O_NOFOLLOW on the last component, a directory symlink
    or a hard link planted by the user could point root at /etc/shadow; reading with the user's own
    credentials makes the question moot (they can only make us read what they can read). A hung file
    system costs at most ``timeout_s``. Raises TailError with the reason.
    """
    return _decode(as_job_user(path, uid, gid, lambda: _read_tail_here(path, max_bytes), max_bytes, timeout_s))


def append_note(path: str, text: str, uid: int | None, gid: int | None, timeout_s: float = 10.0) -> None:
    """Append one line to the job's log as the job's user (never as root), so the user sees what we did."""
    line = ("\n" + "".join(ch if ch.isprintable() else " " for ch in text)[:1000] + "\n").encode()

    def write() -> bytes:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise TailError(f"{path}: not a regular file")
            os.write(fd, line)
        finally:
            os.close(fd)
        return b""

    as_job_user(path, uid, gid, write, 0, timeout_s)


def kept_name(path: str, restarts: int) -> str:
    """Where run ``restarts`` (0 = the first) of a requeued job keeps its log: beside it, never replaced."""
    return f"{path}.oom-run{restarts}"


#: How much of a failed run's log is kept (its end: where the error is); a training log can be gigabytes.
KEEP_MAX_BYTES = 64 << 20


def keep_log(path: str, restarts: int, uid: int | None, gid: int | None, timeout_s: float = 10.0) -> str:
    """Copy the end of the job's log aside before its requeue, as the job's user; return the copy's name.

    Why: unless the job or the site chose append, slurmstepd truncates the output file when a requeued job
    starts again (measured: tests/oom/test_oom_slurm.py), and the failed run's output, with its error, would
    be gone. A copy, not a move: a job that asked for append keeps one whole log, and nothing changes for it.
    The copy is created with O_EXCL and O_NOFOLLOW (nothing of the user's is replaced, no link followed),
    the source read with O_NOFOLLOW; a source that is no regular file is left alone."""
    target = kept_name(path, restarts)

    def copy() -> bytes:
        src = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        try:
            info = os.fstat(src)
            if not stat.S_ISREG(info.st_mode):
                raise TailError(f"{path}: not a regular file")
            dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                skipped = max(0, info.st_size - KEEP_MAX_BYTES)
                if skipped:
                    os.write(dst, f"[gpushare: the first {skipped} bytes of {path} are not kept]\n".encode())
                    os.lseek(src, skipped, os.SEEK_SET)
                while chunk := os.read(src, 1 << 20):
                    os.write(dst, chunk)
            finally:
                os.close(dst)
        finally:
            os.close(src)
        return b""

    as_job_user(path, uid, gid, copy, 0, timeout_s)
    return target


def restore_log(path: str, restarts: int, uid: int | None, gid: int | None, timeout_s: float = 10.0) -> None:
    """Undo :func:`keep_log` when the requeue did not happen (the log itself was never touched)."""
    kept = kept_name(path, restarts)

    def drop() -> bytes:
        os.unlink(kept)
        return b""

    as_job_user(kept, uid, gid, drop, 0, timeout_s)


def keep_logs(paths: Iterable[str], step: str, restarts: int, uid: int | None, gid: int | None,
              timeout_s: float = 10.0) -> int:
    """:func:`keep_log` (``step`` "keep") or :func:`restore_log` each of a job's logs; how many were handled.
    A log that does not exist (never written, /dev/null, or another step's) is skipped; other failures raise."""
    handled = 0
    for path in paths:
        if not os.path.lexists(path if step == "keep" else kept_name(path, restarts)):
            continue
        (keep_log if step == "keep" else restore_log)(path, restarts, uid, gid, timeout_s)
        handled += 1
    return handled


def as_job_user(path: str, uid: int | None, gid: int | None, work: Callable[[], bytes], max_bytes: int,
                timeout_s: float) -> bytes:
    """Run ``work`` (file access on a job-supplied path) with the job owner's credentials.

    Not root: run it here. Root with a known non-root owner: run it in a forked child that drops to
    ``uid``/``gid`` first and pipes the bytes back. Root with an unknown owner: refuse.
    """
    if "\0" in path or not os.path.isabs(path):
        raise TailError(f"{path[:100]!r}: not an absolute path")
    if os.geteuid() != 0 or uid == 0:
        try:
            return work()
        except TailError:
            raise
        except OSError as exc:  # as ourselves (an unprivileged SlurmUser): e.g. not ours to write
            raise TailError(f"{path}: {exc.strerror or exc}") from exc
    if uid is None or uid < 0:
        raise TailError(f"{path}: job owner unknown; not accessed as root")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns
        code = 0
        try:
            os.close(read_end)
            _drop_to(uid, gid if gid is not None and gid >= 0 else uid)
            payload = b"O" + work()
        except BaseException as exc:  # noqa: BLE001 - report any failure to the parent
            payload, code = b"E" + str(exc).encode("utf-8", "replace")[:500], 1
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(write_end, view):]
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        data = _collect(read_end, max_bytes + 1024, timeout_s, pid, path)
    finally:
        os.close(read_end)
        _reap(pid)
    if not data:
        raise TailError(f"{path}: reader exited without an answer")
    if data[:1] == b"E":
        raise TailError(data[1:].decode("utf-8", "replace"))
    return data[1:]


def _collect(fd: int, limit: int, timeout_s: float, pid: int, path: str) -> bytes:
    deadline = time.monotonic() + timeout_s
    parts, total = [], 0
    while total < limit:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            os.kill(pid, signal.SIGKILL)
            raise TailError(f"{path}: no answer in {timeout_s:.0f} s (slow or hung file system)")
        chunk = os.read(fd, min(1 << 16, limit - total))
        if not chunk:
            break
        parts.append(chunk)
        total += len(chunk)
    return b"".join(parts)


def _reap(pid: int) -> None:
    """Never leave a child behind, and never wait on one that is stuck writing."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _decode(data: bytes) -> str:
    """Text for matching: invalid UTF-8 and NULs from binary junk become spaces, lines stay lines."""
    return data.replace(b"\0", b" ").decode("utf-8", "replace")
