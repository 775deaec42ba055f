"""The OOM recovery ledger: one durable record per (job id, restart count), plus an audit history.

Why per key files: the EpilogSlurmctld runs once per job end, many at a time, and may run twice for the
same end (an admin re-running it, slurmctld restarting mid-hook). A requeue must happen at most once per
job run, so each run of a job (job id + Slurm's restart count, which requeue increments) gets its own
entry, written atomically (temp file + fsync + rename) and updated step by step, and a per-key
``flock`` makes concurrent runs for the same key exclusive: the loser sees the lock held and leaves.
An entry left half-done by a crash is found by :meth:`Ledger.unfinished` and completed by the next run.

The history file (``history.jsonl``) is append-only, one JSON object per line, each written with a
single ``write`` under an exclusive ``flock``, so 100 concurrent writers never interleave lines.

Entry format (version 1), all keys present unless noted::

    v: 1
    job: str            # Slurm job id ("123" or "123_4")
    restarts: int       # Restarts= of the run that failed
    state: str          # "decided" -> "requeued" -> "done"; or "stay_failed"; or "gone" (job purged)
    action: str         # "requeue" | "stay_failed"
    reason: str         # one line, also logged
    family, message, source: str | None   # the matched OOM message and the log it came from
    old_gres, new_gres: str | None        # new_gres absent unless action == "requeue"
    retry, max_retries: int
    steps: list[str]    # Slurm steps already done, in order
    created, updated: float  # Unix time
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import time
from pathlib import Path
from typing import Any, Iterator

from gpushare.errors import GpushareError
from gpushare.atomic import flock_within, read_json_object, write_json_atomic

LEDGER_VERSION = 1
FINAL_STATES = ("done", "stay_failed", "gone", "observed")  # observed: [policy] mode = observe, nothing done
_JOB_RE = re.compile(r"^\d{1,10}(?:_\d{1,10})?$")


class LedgerError(GpushareError, OSError):
    """The ledger directory is unusable (missing permissions, not a directory, unsafe owner)."""


def entry_key(job_id: str, restarts: int) -> str:
    if not _JOB_RE.match(str(job_id)) or not isinstance(restarts, int) or restarts < 0:
        raise ValueError(f"bad ledger key: job {str(job_id)[:30]!r}, restarts {restarts!r}")
    return f"{job_id}.{restarts}"


class Ledger:
    """A directory of entries; safe for many concurrent processes on one host."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)

    def ensure(self) -> None:
        """Create the directory (0700) or check it: a real directory, and root's when we are root."""
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = os.lstat(self.dir)
        except OSError as exc:
            raise LedgerError(f"{self.dir}: cannot create ledger directory: {exc.strerror}") from exc
        if not stat.S_ISDIR(info.st_mode):
            raise LedgerError(f"{self.dir}: not a directory (symlinks are refused)")
        if os.geteuid() == 0 and info.st_uid != 0:
            raise LedgerError(f"{self.dir}: owned by uid {info.st_uid}, not root: run this as that account "
                              "(SlurmUser, which runs EpilogSlurmctld and gpushare-oom-resume), not as root")

    # --- entries ----------------------------------------------------------------------------------
    def _path(self, key: str, suffix: str) -> Path:
        return self.dir / f"{key}{suffix}"

    @contextlib.contextmanager
    def claim(self, job_id: str, restarts: int, wait_s: float = 0.0) -> Iterator[bool]:
        """Hold the key's lock for the ``with`` body; yields False when another process keeps it longer
        than ``wait_s``."""
        key = entry_key(job_id, restarts)
        fd = os.open(self._path(key, ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if not flock_within(fd, wait_s):
                yield False
                return
            yield True
        finally:
            os.close(fd)  # closing releases the lock

    def get(self, job_id: str, restarts: int) -> dict[str, Any] | None:
        return self._load(self._path(entry_key(job_id, restarts), ".json"))

    def put(self, entry: dict[str, Any]) -> dict[str, Any]:
        """Write (create or replace) an entry atomically; stamps version and times."""
        key = entry_key(entry["job"], entry["restarts"])
        now = time.time()
        entry = {**entry, "v": LEDGER_VERSION, "updated": now}
        entry.setdefault("created", now)
        write_json_atomic(self._path(key, ".json"), entry, mode=0o600)
        marker = self._path(key, ".open")  # lets unfinished() list open entries without reading them all
        if entry.get("state") in FINAL_STATES:
            marker.unlink(missing_ok=True)
        elif not marker.exists():
            marker.touch(mode=0o600)
        return entry

    def entries_for(self, job_id: str) -> list[dict[str, Any]]:
        """All entries of one job (each run that ended in an OOM), oldest run first."""
        entry_key(job_id, 0)  # validates the id before it becomes part of a glob
        found = [self._load(path) for path in self.dir.glob(f"{job_id}.*.json")]
        entries = [e for e in found if e and str(e.get("job")) == str(job_id)]
        return sorted(entries, key=lambda e: int(e.get("restarts", 0)))

    def retries_used(self, job_id: str) -> int:
        """How many times this job was already requeued for an OOM (entries that got that far), not counting
        its free re-run as a neighbour's collateral (``charged`` false; entries without the key count)."""
        return sum(1 for e in self._requeued(job_id) if e.get("charged") is not False)

    def free_reruns(self, job_id: str) -> int:
        """How many free re-runs (collateral, ``charged`` false) this job already got."""
        return sum(1 for e in self._requeued(job_id) if e.get("charged") is False)

    def _requeued(self, job_id: str) -> list[dict[str, Any]]:
        return [e for e in self.entries_for(job_id)
                if e.get("action") == "requeue" and "requeuehold" in e.get("steps", [])]

    def unfinished(self, min_age_s: float = 30.0, now: float | None = None) -> list[dict[str, Any]]:
        """Requeues a crashed or interrupted run left half done (older than ``min_age_s``)."""
        now = time.time() if now is None else now
        out = []
        for marker in self.dir.glob("*.open"):
            entry = self._load(marker.with_suffix(".json"))
            if (entry and entry.get("action") == "requeue" and entry.get("state") not in FINAL_STATES
                    and now - float(entry.get("updated", 0)) >= min_age_s):
                out.append(entry)
        return out

    @staticmethod
    def _load(path: Path) -> dict[str, Any] | None:
        return read_json_object(path, 1 << 20, LEDGER_VERSION)

    # --- per-user budget and concurrency ------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        fd = os.open(self.dir / name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _user_path(self, uid: int) -> Path:
        if not isinstance(uid, int) or isinstance(uid, bool) or uid < 0:
            raise ValueError(f"bad uid {uid!r}")
        return self.dir / "users" / f"{uid}.json"

    def user_recoveries(self, uid: int | None, now: float | None = None, window_s: float = 86400.0) -> int:
        """How many OOM requeues ``uid``'s jobs got in the last ``window_s`` (the per-user budget)."""
        if uid is None:
            return 0
        now = time.time() if now is None else now
        times = (self._load(self._user_path(uid)) or {}).get("t", [])
        return sum(1 for t in times if isinstance(t, (int, float)) and now - t < window_s)

    def note_user_recovery(self, uid: int | None, now: float | None = None, window_s: float = 86400.0) -> None:
        """Count one requeue against ``uid`` (atomic file per user, under one lock; old times dropped)."""
        if uid is None:
            return
        now = time.time() if now is None else now
        path = self._user_path(uid)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        with self._locked("users.lock"):
            times = [t for t in (self._load(path) or {}).get("t", [])
                     if isinstance(t, (int, float)) and now - t < window_s]
            write_json_atomic(path, {"uid": uid, "t": [*times, round(now, 3)]}, mode=0o600)

    @contextlib.contextmanager
    def slot(self, count: int, wait_s: float, poll_s: float = 0.05) -> Iterator[bool]:
        """One of ``count`` concurrency slots (``slots/N.lock`` flocks) for the ``with`` body; yields False
        when none frees up within ``wait_s``. Why: a storm of failed jobs must not become as many
        concurrent full-queue Slurm queries."""
        directory = self.dir / "slots"
        directory.mkdir(mode=0o700, exist_ok=True)
        fds = []
        try:
            for index in range(count):
                fds.append(os.open(directory / f"{index}.lock",
                                   os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
            deadline = time.monotonic() + wait_s
            while True:
                for fd in fds:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue
                    yield True
                    return
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(poll_s)
        finally:
            for fd in fds:
                os.close(fd)

    # --- retention --------------------------------------------------------------------------------
    def prune(self, retention_s: float, now: float | None = None, every_s: float = 3600.0) -> int:
        """Remove finished entries (and their lock files) and history lines older than ``retention_s``;
        at most once per ``every_s`` (a stamp file), so hook runs stay cheap. Returns files removed.

        Why: one entry per OOM run and one history line per event grow without bound otherwise. Open
        (unfinished) entries are never pruned: they are what keeps a job from staying held."""
        now = time.time() if now is None else now
        stamp = self.dir / "pruned.stamp"
        try:
            if now - os.lstat(stamp).st_mtime < every_s:
                return 0
        except FileNotFoundError:
            pass
        removed = 0
        with self._locked("prune.lock"):
            stamp.touch(mode=0o600)
            os.utime(stamp, (now, now))
            cutoff = now - retention_s
            for path in self.dir.glob("*.json"):
                entry = self._load(path)
                if entry and entry.get("state") in FINAL_STATES and float(entry.get("updated", now)) < cutoff:
                    for suffix in (".json", ".lock", ".open"):
                        try:
                            (path.with_suffix(suffix)).unlink()
                            removed += 1 if suffix == ".json" else 0
                        except FileNotFoundError:
                            pass
            self._prune_history(cutoff)
        return removed

    def _prune_history(self, cutoff: float) -> None:
        path = self.dir / "history.jsonl"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # writers append under this same lock
            with open(fd, "rb", closefd=False) as handle:
                lines = handle.read().splitlines(keepends=True)
            kept = []
            for line in lines:
                try:
                    if float(json.loads(line).get("t", 0)) >= cutoff:
                        kept.append(line)
                except (ValueError, AttributeError):
                    continue
            if len(kept) != len(lines):
                os.ftruncate(fd, 0)
                os.pwrite(fd, b"".join(kept), 0)
                os.fsync(fd)
        finally:
            os.close(fd)

    # --- history ----------------------------------------------------------------------------------
    def append_history(self, event: dict[str, Any]) -> None:
        """One line in history.jsonl; a single write under an exclusive lock, then fsync."""
        line = (json.dumps({"t": round(time.time(), 3), **event}, sort_keys=True, default=str) + "\n").encode()
        fd = os.open(self.dir / "history.jsonl",
                     os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            start = os.lseek(fd, 0, os.SEEK_END)
            view = memoryview(line)
            try:
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except OSError:  # a full disk: take back a torn line so the next one starts clean
                os.ftruncate(fd, start)
                raise
        finally:
            os.close(fd)

    def history(self) -> list[dict[str, Any]]:
        try:
            text = (self.dir / "history.jsonl").read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        found = []
        for line in text.splitlines():
            try:  # a line torn by a crash mid-write is skipped, never read as an event
                event = json.loads(line) if line.strip() else None
            except ValueError:
                continue
            if isinstance(event, dict):
                found.append(event)
        return found
