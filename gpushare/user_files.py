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
import re
import secrets
import select
import signal
import stat
import time
from typing import Callable, Iterable

from gpushare.errors import GpushareError


class TailError(GpushareError, OSError):
    """A log could not be read safely; the message says why (for the ledger, never for a decision)."""


def _read_tail_here(path: str, max_bytes: int, owner: int | None = None) -> bytes:
    """Read the last ``max_bytes`` of a regular file without following a final symlink or opening devices.

    ``owner``: the file must belong to that uid and be readable by it (checked on the opened inode, so a
    directory swapped for a link on the way to it gains nothing): for a reader that is not the job's user."""
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
        if owner is not None and (info.st_uid != owner or not info.st_mode & stat.S_IRUSR):
            raise TailError(f"{path}: not a file of the job's user (uid {owner}); not read")
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
        mid_line = start > 0 and os.pread(fd, 1, start - 1) != b"\n"
    finally:
        os.close(fd)
    if mid_line:  # we began mid-line: drop the partial first line, unless it is the only one
        cut = data.find(b"\n")
        if cut >= 0 and data[cut + 1:].strip():
            data = data[cut + 1:]
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

    Not root (an unprivileged SlurmUser) and not the job's user: the file is read only when it belongs to the
    job's user (checked on the opened file), so a link swapped in for a folder of the user's cannot make us
    read, and match lines of, a file that user could not read (SlurmUser's own, for one).
    """
    owner = None
    if os.geteuid() != 0 and uid != os.geteuid():
        if uid is None or uid < 0:
            raise TailError(f"{path}: job owner unknown; not read")
        owner = uid
    return _decode(as_job_user(path, uid, gid, lambda: _read_tail_here(path, max_bytes, owner), max_bytes,
                               timeout_s))


def _note_line(text: str) -> bytes:
    return ("\n" + "".join(ch if ch.isprintable() else " " for ch in text)[:1000] + "\n").encode()


def _append_here(path: str, line: bytes, missing_ok: bool = False) -> bool:
    """Append ``line`` to an existing regular file, no link followed; False when it is absent and ``missing_ok``."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        if missing_ok:
            return False
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TailError(f"{path}: not a regular file")
        os.write(fd, line)
    finally:
        os.close(fd)
    return True


def append_note(path: str, text: str, uid: int | None, gid: int | None, timeout_s: float = 10.0) -> None:
    """Append one line to the job's log as the job's user (never as root), so the user sees what we did."""
    line = _note_line(text)

    def write() -> bytes:
        _append_here(path, line)
        return b""

    as_job_user(path, uid, gid, write, 0, timeout_s)


#: The random part of a kept copy's name: 12 hex digits, drawn when the copy is made (``new_token``).
TOKEN = re.compile(r"[0-9a-f]{12}", re.ASCII)


def new_token() -> str:
    """The unpredictable part of the names one requeue's copies get (48 bits: no name can be squatted)."""
    return secrets.token_hex(6)


def kept_name(path: str, restarts: int, token: str) -> str:
    """A copy of run ``restarts`` (0 = the first) of a requeued job's log beside it: ``<log>.oom-run<N>.<token>``."""
    return f"{path}.oom-run{restarts}.{token}"


def kept_places(path: str, restarts: int, token: str, work_dir: str = "") -> list[str]:
    """Where that copy may go, in order: beside the log, then (the log's folder refused it: not the user's
    to write, full, read-only) in the job's working directory."""
    places = [kept_name(path, restarts, token)]
    if work_dir.startswith("/") and os.path.dirname(path) != os.path.normpath(work_dir):
        places.append(kept_name(os.path.join(work_dir, os.path.basename(path)), restarts, token))
    return places


#: How much of a failed run's log is kept (its end: where the error is); a training log can be gigabytes.
KEEP_MAX_BYTES = 64 << 20


def _copy_here(path: str, places: list[str]) -> str:
    """Copy the end of ``path`` to the first of ``places`` that takes it; its name, or "" when there is
    nothing to copy (no such file here, or no regular file: nothing a rerun could truncate)."""
    try:
        src = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        raise TailError(f"{path}: {exc.strerror or exc}") from None
    failures = []
    try:
        info = os.fstat(src)
        if not stat.S_ISREG(info.st_mode):
            return ""
        skipped = max(0, info.st_size - KEEP_MAX_BYTES)
        for target in places:
            try:
                dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                failures.append(f"{target}: {exc.strerror or exc}")
                continue
            try:
                if skipped:
                    os.write(dst, f"[gpushare: the first {skipped} bytes of {path} are not kept]\n".encode())
                os.lseek(src, skipped, os.SEEK_SET)
                while chunk := os.read(src, 1 << 20):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(dst, view):]
                return target
            except OSError as exc:  # a full disk part-way: no half copy stays, the next place is tried
                failures.append(f"{target}: {exc.strerror or exc}")
                os.unlink(target)
            finally:
                os.close(dst)
    finally:
        os.close(src)
    raise TailError("no copy could be made: " + "; ".join(failures))


def _copier(path: str, places: list[str]) -> Callable[[], bytes]:
    return lambda: _copy_here(path, places).encode()


def keep_logs(paths: Iterable[str], restarts: int, uid: int | None, gid: int | None, timeout_s: float = 10.0,
              token: str = "", work_dir: str = "") -> list[str]:
    """Copy the end of each of the job's logs aside before its requeue, as the job's user; the copies' names.

    Why: unless the job or the site chose append, slurmstepd truncates the output file when a requeued job
    starts again (measured: tests/oom/test_oom_slurm.py), and the failed run's output, with its error, would
    be gone. A copy, not a move: a job that asked for append keeps one whole log, and nothing changes for it.
    Each copy is ``<log>.oom-run<N>.<token>``, ``token`` drawn now (``new_token``): a name nobody can know
    before, so nobody can have created it (a predictable name in a shared folder was squatted, the copy
    refused, and the rerun truncated the log); it is created with O_EXCL and O_NOFOLLOW as the user, and
    where the log's folder refuses it, in the job's working directory. A log that does not exist here, or is
    no regular file, is skipped; a log that exists and could not be copied raises TailError, after the copies
    already made are removed: the caller must not let the rerun truncate it."""
    token = token or new_token()
    if not TOKEN.fullmatch(token):
        raise TailError(f"{token[:20]!r}: not a copy token")
    kept: list[str] = []
    try:
        for path in paths:
            name = as_job_user(path, uid, gid, _copier(path, kept_places(path, restarts, token, work_dir)), 8192,
                               timeout_s).decode()
            if name:
                kept.append(name)
    except OSError:
        for name in kept:
            try:
                _unlink_as(name, uid, gid, timeout_s)
            except OSError:
                pass
        raise
    return kept


def _unlink_as(name: str, uid: int | None, gid: int | None, timeout_s: float) -> bool:
    def drop() -> bytes:
        try:
            os.unlink(name)
        except FileNotFoundError:
            return b"0"
        return b"1"

    return as_job_user(name, uid, gid, drop, 16, timeout_s) == b"1"


def restore_logs(paths: Iterable[str], restarts: int, token: str, uid: int | None, gid: int | None,
                 timeout_s: float = 10.0, work_dir: str = "") -> int:
    """Undo :func:`keep_logs` when the requeue did not happen (the logs themselves were never touched): remove
    the copies named with ``token``, as the user; how many were removed."""
    if not TOKEN.fullmatch(token):
        raise TailError(f"{token[:20]!r}: not a copy token")
    return sum(_unlink_as(name, uid, gid, timeout_s) for path in paths
               for name in kept_places(path, restarts, token, work_dir))


def note_kept(paths: Iterable[str], restarts: int, token: str, text: str, uid: int | None, gid: int | None,
              timeout_s: float = 10.0, work_dir: str = "") -> int:
    """Append ``text`` to every copy :func:`keep_logs` made with ``token``, as the user; how many there were."""
    if not TOKEN.fullmatch(token):
        raise TailError(f"{token[:20]!r}: not a copy token")
    line = _note_line(text)
    names = [name for path in paths for name in kept_places(path, restarts, token, work_dir)]
    if not names:
        return 0
    done = as_job_user(names[0], uid, gid,
                       lambda: str(sum(_append_here(name, line, missing_ok=True) for name in names)).encode(),
                       64, timeout_s)
    return int(done or b"0")


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
