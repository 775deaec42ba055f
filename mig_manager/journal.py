"""The per-node repartition journal: what the executor set out to do, and how far it got.

Why a journal: a repartition spans seconds to hours (waiting for jobs), two daemon restarts and several
driver calls. The executor may be killed anywhere in between (node reboot, OOM killer, an admin's ^C).
Before each step it writes down what it is about to do; ``reconcile`` reads that back and either finishes
the change or undoes it, so the node never stays drained and Slurm's GRES never disagree with the GPU.

Format (a contract, docs/style.md #5 and #8): one JSON file per node, ``<journal_dir>/<node>.json``, written
atomically (temp file + fsync + rename), so a reader sees the previous or the next state, never half.
Unknown keys and a different ``version`` are refused with a message naming the file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from gpushare.errors import GpushareError
from gpushare.atomic import flock_within, write_json_atomic

JOURNAL_VERSION = 1
NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
Phase = Literal["running", "done", "rolled_back", "failed"]
# The steps in order; ``Journal.step`` is the last one *completed*.
STEPS = ("planned", "drained", "idle", "applied", "gres_written", "restarted", "verified", "resumed")
HISTORY_KEEP = 50  # finished reshapes remembered for the rate limit


class JournalError(GpushareError, ValueError):
    """An unreadable or foreign journal; the message names the file."""


@dataclass
class Op:
    """One device change: destroy or create the GPU instance ``profile@start`` on GPU ``gpu``."""

    kind: Literal["destroy", "create"]
    gpu: int
    profile: str
    start: int
    done: bool = False
    undone: bool = False  # set during a rollback once the op's effect is reverted

    def text(self) -> str:
        return f"{self.kind} {self.profile}@{self.start} on GPU {self.gpu}"


@dataclass
class Journal:
    """One node's journal. ``phase`` is ``running`` from ``planned`` until done or rolled back."""

    node: str
    run_id: str = ""
    phase: Phase = "done"
    step: str = ""  # last completed step of the current run (see STEPS)
    mode: Literal["forward", "rollback"] = "forward"
    before: dict[str, str] = field(default_factory=dict)  # GPU index -> layout text when the run began
    target: dict[str, str] = field(default_factory=dict)  # GPU index -> wanted layout text
    ops: list[Op] = field(default_factory=list)
    drain_reason: str = ""  # the Reason we set; we resume only a node drained with exactly this
    expected_gres: str = ""  # the Gres= written for Slurm (to verify)
    started_at: float = 0.0
    history: list[float] = field(default_factory=list)  # end times of finished reshapes
    log: list[str] = field(default_factory=list)  # human-readable, newest last, bounded
    version: int = JOURNAL_VERSION

    def note(self, now: float, text: str) -> None:
        self.log = (self.log + [f"{now:.3f} {text}"])[-200:]

    def recent(self, now: float, window_s: float = 3600.0) -> int:
        """Finished reshapes within the window (the rate limit's count)."""
        return sum(1 for t in self.history if now - t < window_s)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "Journal":
        if not isinstance(data, dict):
            raise JournalError(f"{where}: expected a JSON object")
        if data.get("version") != JOURNAL_VERSION:
            raise JournalError(f"{where}: journal version {data.get('version')!r}, this gpushare reads "
                               f"{JOURNAL_VERSION}; finish or remove it with the matching version")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise JournalError(f"{where}: unknown key {unknown[0]!r}")
        raw = dict(data)
        try:
            raw["ops"] = [Op(**op) for op in raw.get("ops", [])]
            journal = cls(**raw)
        except TypeError as exc:
            raise JournalError(f"{where}: malformed journal: {exc}") from None
        if journal.phase not in ("running", "done", "rolled_back", "failed") or (
                journal.step and journal.step not in STEPS):
            raise JournalError(f"{where}: unknown phase {journal.phase!r} or step {journal.step!r}")
        return journal


class JournalStore:
    """Journals of the nodes this host manages, one file each under ``directory``."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def path(self, node: str) -> Path:
        if not NODE_RE.match(node):
            raise JournalError(f"not a Slurm node name: {node[:70]!r}")
        return self.directory / f"{node}.json"

    def load(self, node: str) -> Journal:
        """The node's journal; a fresh, finished one when there is none yet."""
        path = self.path(node)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return Journal(node=node)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise JournalError(f"{path}: not JSON ({exc}); inspect it, then remove it to start over") from None
        journal = Journal.from_dict(data, str(path))
        if journal.node != node:
            raise JournalError(f"{path}: belongs to node {journal.node!r}, not {node!r}")
        return journal

    @contextmanager
    def lock(self, node: str) -> Iterator[None]:
        """One run per node at a time (a timer and an admin's command must not interleave steps).

        A non-blocking ``flock`` on ``<node>.lock``; the kernel drops it when the holder dies, even by
        SIGKILL, so a crashed run never blocks ``reconcile``.
        """
        path = self.path(node).with_suffix(".lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if not flock_within(fd, 0):
                raise JournalError(f"another gpushare mig run holds {path}; let it finish")
            yield
        finally:
            os.close(fd)

    def save(self, journal: Journal) -> None:
        journal.history = journal.history[-HISTORY_KEEP:]
        write_json_atomic(self.path(journal.node), journal.to_dict(), mode=0o600)
