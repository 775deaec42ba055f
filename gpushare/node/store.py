"""The agent's job store: one JSON file per running job on this node, written atomically under a lock.

Why a directory of files and not the agent's memory: the Prolog creates a job's entry (with the energy
counters read before the job starts) even when the agent is down or restarting, the agent adds what only
it sees (first kernel, utilisation, peak memory), and the Epilog reads the result even if the agent died
mid-job. NVML (or the simulated state) stays the truth for devices; this store is the truth for jobs.

Each entry is replaced whole (temp file + fsync + rename, ``gpushare.atomic``), and a read-modify-write
holds the entry's ``flock`` (a sidecar ``.lock`` file, never the entry itself, which rename replaces), so
the Prolog, the agent and the Epilog may touch one job at the same moment without losing an update.

Entry format (``v`` 1; times are Unix seconds, energy mJ, memory bytes; GPU keys are NVML indices as
strings because JSON object keys are strings)::

    v: 1
    job: str               # Slurm job id, validated (digits, optional _task)
    restarts: int          # Slurm restart count of this run
    uid: int; user: str    # the job's owner (from slurmd's Prolog environment)
    gpus: list[int]        # NVML indices the job got (SLURM_JOB_GPUS)
    shared: bool           # a shard (shared) request
    est_gib, margin_gib: float | None   # from the submit record; None without one
    shards: int | None     # shard count Slurm allocated (GiB)
    caps: dict             # agent_caps.Caps as a dict
    start: float           # Prolog time
    start_energy_mj: {gpu: int | None}
    kernel_at: float | None            # first kernel (per-process SM activity), else first process seen
    ttfk_source: "kernel" | "first-process" | None
    oom: dict | None       # the backstop's record (gpushare.agent.backstop.oom_record), when it acted
    forecast: dict | None  # the forecaster's record (gpushare.agent.backstop.forecast_record), when it fired
    share_mj, active_s: {gpu: float}   # attributed energy and seconds with a process running
    peak_bytes: {gpu: int}             # largest memory of the job's processes seen
    series: {gpu: [[t, used_bytes, job_bytes, smact], ...]}   # down-sampled timeline
    registered_by: "agent" | "prolog"
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator

from gpushare.atomic import read_json_object, write_json_atomic

STORE_VERSION = 1
_JOB_RE = re.compile(r"^\d{1,10}(?:_\d{1,10})?$")


def check_job(job: str | int) -> str:
    """A job id safe to use as a file name and in argv; ValueError otherwise."""
    text = str(job)
    if not _JOB_RE.match(text):
        raise ValueError(f"not a Slurm job id: {text[:30]!r}")
    return text


class JobStore:
    """Per-job entries under ``directory`` (created 0700: entries hold users' job details)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)

    def ensure(self) -> "JobStore":
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.dir.is_symlink() or not self.dir.is_dir():
            raise OSError(f"{self.dir}: not a directory (symlinks are refused)")
        return self

    def _path(self, job: str, suffix: str) -> Path:
        return self.dir / f"{check_job(job)}{suffix}"

    @contextlib.contextmanager
    def locked(self, job: str) -> Iterator[None]:
        """Hold the entry's lock (blocking): every read-modify-write of one job goes through here."""
        self.ensure()
        fd = os.open(self._path(job, ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def get(self, job: str) -> dict[str, Any] | None:
        return read_json_object(self._path(job, ".json"), 8 << 20, STORE_VERSION)

    def put(self, entry: dict[str, Any], durable: bool = True) -> dict[str, Any]:
        """Write an entry whole; callers that read first must hold :meth:`locked`.

        ``durable=False`` skips the fsyncs: still atomic (rename), and it survives the agent dying, only
        not the machine losing power — what the agent's periodic accumulator flushes need, at a fraction
        of the cost (100 running jobs flushed every few seconds must not saturate the disk).
        """
        entry = {**entry, "v": STORE_VERSION}
        self.ensure()
        path = self._path(entry["job"], ".json")
        if durable:
            write_json_atomic(path, entry, mode=0o600)
        else:
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    handle.write(json.dumps(entry, separators=(",", ":")))  # dumps: the C encoder, one write
                os.replace(tmp, path)
            except BaseException:  # a full disk: the old entry stays, and no partial file is left taking space
                tmp.unlink(missing_ok=True)
                raise
        return entry

    def update(self, job: str, change: Callable[[dict[str, Any]], dict[str, Any] | None],
               durable: bool = True) -> dict[str, Any] | None:
        """Read, change and write one entry under its lock; None (and nothing written) if it is absent."""
        with self.locked(job):
            entry = self.get(job)
            if entry is None:
                return None
            changed = change(entry)
            return self.put(changed if changed is not None else entry, durable=durable)

    def delete(self, job: str) -> None:
        with self.locked(job):
            self._path(job, ".json").unlink(missing_ok=True)
        self._path(job, ".lock").unlink(missing_ok=True)

    def all(self) -> list[dict[str, Any]]:
        """Every entry, in job-id order (the agent reloads these after a restart)."""
        if not self.dir.is_dir():
            return []
        found = []
        for path in sorted(self.dir.glob("*.json")):
            job = path.stem
            if _JOB_RE.match(job):
                entry = self.get(job)
                if entry is not None:
                    found.append(entry)
        return found
