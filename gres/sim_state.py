"""Where the simulated GPUs' state lives: in memory, or in a JSON file shared by processes.

Why a file: on a test node the agent, the Prolog, the TaskProlog and the job itself are separate
processes (some started by slurmd as root, some as the user), and they must all see the same simulated
GPUs — a MIG instance the executor creates must be there when the agent lists instances.

Locking scheme: every read-modify-write takes an exclusive ``fcntl.flock`` on a sidecar ``<state>.lock``
file (never on the state file itself, which is replaced by rename and would leave lockers holding a lock
on a dead inode), re-reads the state under the lock, applies the change and writes it with
``gpushare.atomic.write_json_atomic`` (temp file + fsync + rename). Readers take no lock: a rename is atomic,
so they see the old or the new state, never half of one. flock is per open file description, so it also
serialises threads that open their own descriptor, and the kernel drops it if a holder dies.
Plain reads re-read the bytes (a few KiB) but re-parse only when they changed, so a sampling loop stays
cheap; comparing bytes rather than (inode, mtime, size) is exact even when the kernel reuses an inode within
one coarse timestamp tick.
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from gpushare.atomic import write_json_atomic
from gpushare.gres.errors import GpuError, NvmlCode

STATE_VERSION = 1


class MemoryStore:
    """State held in this process only (the trace simulator, unit tests)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def read(self) -> dict[str, Any]:
        return self._state

    @contextmanager
    def transaction(self) -> Iterator[dict[str, Any]]:
        work = copy.deepcopy(self._state)
        yield work  # an exception inside leaves the old state untouched, like the file store
        self._state = work


class FileStore:
    """State in a JSON file, safe for many concurrent processes (see module docstring)."""

    def __init__(self, path: str | os.PathLike[str], mode: int = 0o666) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.mode = mode  # world-readable/writable by default: jobs run as users, the agent as root
        # (raw bytes, parsed state) as one tuple so threads never pair bytes with another state
        self._cached: tuple[bytes, dict[str, Any]] | None = None

    def exists(self) -> bool:
        return self.path.exists()

    def _load(self) -> dict[str, Any]:
        try:
            raw = self.path.read_bytes()
            cached = self._cached
            if cached is not None and cached[0] == raw:
                return cached[1]
            state = json.loads(raw)
        except FileNotFoundError:
            raise GpuError(NvmlCode.DRIVER_NOT_LOADED,
                           f"simulated GPU state {self.path} does not exist (create it with "
                           f"'python -m gpushare.gres.sim_backend init SCENARIO {self.path}')") from None
        except ValueError as exc:
            raise GpuError(NvmlCode.CORRUPTED_INFOROM, f"simulated GPU state {self.path} is not JSON: {exc}") from exc
        if state.get("state_version") != STATE_VERSION:
            raise GpuError(NvmlCode.LIB_RM_VERSION_MISMATCH,
                           f"{self.path}: state_version {state.get('state_version')!r}, expected {STATE_VERSION}")
        self._cached = (raw, state)
        return state

    def read(self) -> dict[str, Any]:
        """The current state; callers must not mutate it (use :meth:`transaction`)."""
        return self._load()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, self.mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    @contextmanager
    def transaction(self) -> Iterator[dict[str, Any]]:
        """Exclusive read-modify-write; the change is written only if the block exits normally."""
        with self._locked():
            self._cached = None  # always re-read under the lock
            work = copy.deepcopy(self._load())
            yield work
            write_json_atomic(self.path, work, mode=self.mode)

    def create(self, state: dict[str, Any], overwrite: bool = False) -> None:
        """Write an initial state; refuses to clobber an existing one unless ``overwrite``."""
        with self._locked():
            if self.path.exists() and not overwrite:
                raise FileExistsError(f"{self.path} exists; pass overwrite=True to replace it")
            write_json_atomic(self.path, {**state, "state_version": STATE_VERSION}, mode=self.mode)
            self._cached = None
