"""gpushare-submitd's view of the queue: idle whole GPUs per partition and the GPUs pending jobs ask for.

Why a view and not a look per job: the submit answer runs under slurmctld's job write lock and must cost
milliseconds, and a Slurm call from inside job_submit would ask slurmctld while it waits on us. So a
background thread takes the view every ``[policy] queue_view_s`` seconds with one ``sinfo`` and one
``squeue`` call, and a submit only reads it (``pressure``). A view that is missing, failed or older than
``STALE_AFTER`` refreshes is not used: the decision then shares as ``share_when = "always"`` would (fail
toward the behaviour without the view), and the first such failure is logged once.

Between two views, every job kept whole counts against the idle GPUs it will take (``claim``), so a burst
of submissions does not send every job after the same idle GPU.

What counts as an idle GPU: on a node in state idle or mixed (allocated nodes have no CPU left, drained
or down ones take no work), a GPU index that appears neither in the node's allocated ``gpu`` nor in its
allocated ``shard`` indices (``sinfo -O GresUsed``: ``gpu:a100:1(IDX:1),shard:a100:1(IDX:0)`` on 22.05;
23.02+ print shards per GPU, ``shard:a100:5(5/40,0/40)``).
Memory and CPUs beyond the node state are not looked at: a job kept whole on a node that lacks them
waits, as it would have without gpushare.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpushare.policy.share_gate import Pressure

log = logging.getLogger("gpushare.submitd")

STALE_AFTER = 3  # refresh periods after which a view is not used
USABLE_STATES = ("idle", "mixed")
SINFO_ARGS = ("-h", "-N", "-O", "NodeList:|,Partition:|,StateLong:|,Gres:|,GresUsed:")
SQUEUE_ARGS = ("-h", "-t", "PD", "-O", "Partition:|,tres-per-node:|,tres-per-job:|,NumNodes:|,Reason:")
HELD_REASONS = ("JobHeld", "Dependency", "BeginTime", "DependencyNeverSatisfied", "launch failed")
_IDX = re.compile(r"IDX:([^)]*)")
_PER_GPU = re.compile(r"\((\d+/\d+(?:,\d+/\d+)*)\)")


@dataclass(frozen=True)
class Snapshot:
    """One view: per partition, its idle GPUs by node, and the GPUs pending jobs there ask for."""

    idle: dict[str, dict[str, int]]  # partition -> node -> idle whole GPUs
    pending: dict[str, int]  # partition -> GPUs asked for by pending jobs
    default_partition: str | None
    taken_at: float  # the clock's reading when the view was taken


def _items(gres: str) -> list[str]:
    """``gpu:a100:2(S:0-1),shard:a100:80`` -> its comma-separated items, commas inside brackets kept."""
    items, depth, current = [], 0, ""
    for ch in gres:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    return [*items, current] if current else items


def _indices(text: str) -> set[int]:
    """``0-1,3`` -> {0, 1, 3}; ``N/A`` or junk -> empty."""
    found: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (hi.isdigit() or not hi):
            found.update(range(int(lo), int(hi or lo) + 1))
    return found


def _count(item: str) -> int:
    head = item.split("(", 1)[0].split(":")
    return int(head[-1]) if len(head) > 1 and head[-1].isdigit() else (1 if len(head) == 1 else 0)


def idle_gpus(gres: str, gres_used: str) -> int:
    """Whole GPUs of one node that hold neither a ``gpu`` nor a ``shard`` allocation."""
    total = sum(_count(item) for item in _items(gres) if item.split(":", 1)[0] == "gpu")
    busy: set[int] = set()
    for item in _items(gres_used):
        name = item.split(":", 1)[0]
        if name in ("gpu", "shard") and _count(item) > 0:
            match = _IDX.search(item)
            if match:  # 22.05, and gpu on every release: the indices in use
                busy |= _indices(match.group(1))
            elif found := _PER_GPU.search(item):  # shard on 23.02+: used/total per GPU, in index order
                busy |= {i for i, pair in enumerate(found.group(1).split(",")) if not pair.startswith("0/")}
    return max(0, total - len(busy))


def parse_sinfo(text: str) -> tuple[dict[str, dict[str, int]], str | None]:
    """``sinfo -N -O NodeList,Partition,StateLong,Gres,GresUsed`` (``|``-separated) -> idle GPUs and the
    default partition (the one sinfo marks with ``*``)."""
    idle: dict[str, dict[str, int]] = {}
    default = None
    for line in text.splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) < 5 or not fields[0]:
            continue
        node, partition, state, gres, used = fields[:5]
        if partition.endswith("*"):
            partition = partition[:-1]
            default = partition
        usable = state.rstrip("*~#!%$@^-").lower() in USABLE_STATES
        idle.setdefault(partition, {})[node] = idle_gpus(gres, used) if usable else 0
    return idle, default


def _gpus_asked(tres: str) -> int:
    """GPUs one node's (or one job's) TRES string asks for: ``gres:gpu:2``, ``gres/gpu:a100:1``; a shared
    request (``shard``, ``mps``) counts one GPU."""
    asked = 0
    for item in tres.replace("gres/", "gres:").split(","):
        parts = item.split(":")
        if parts and parts[0] == "gres":
            parts = parts[1:]
        if not parts or parts[0] not in ("gpu", "shard", "mps"):
            continue
        count = int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
        asked += count if parts[0] == "gpu" else 1
    return asked


def parse_squeue(text: str) -> dict[str, int]:
    """``squeue -t PD -O Partition,tres-per-node,tres-per-job,NumNodes,Reason`` -> GPUs pending per
    partition. Held jobs and jobs waiting for a dependency or a start time are not demand yet."""
    pending: dict[str, int] = {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) < 5 or not fields[0]:
            continue
        partitions, per_node, per_job, nodes, reason = fields[:5]
        if reason.startswith(HELD_REASONS):
            continue
        count = int(nodes) if nodes.isdigit() else 1
        asked = _gpus_asked(per_node) * count + _gpus_asked(per_job)
        for partition in partitions.split(","):
            if asked:
                pending[partition] = pending.get(partition, 0) + asked
    return pending


class QueueView:
    """The view, its refresh thread and the claims made since it was taken.

    ``run(tool, *args) -> stdout`` runs a Slurm tool (``SlurmClient.run``); ``clock`` is injectable
    (docs/style.md #11), so tests advance time instead of sleeping."""

    def __init__(self, run: Callable[..., str], period_s: float, clock: Callable[[], float] = time.monotonic):
        self._run, self.period_s, self._clock = run, period_s, clock
        self._lock = threading.Lock()
        self._snapshot: Snapshot | None = None
        self._claimed: dict[str, int] = {}
        self._failing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> bool:
        """Take a new view (two Slurm calls). False, and the old view kept, when Slurm did not answer."""
        try:
            idle, default = parse_sinfo(self._run("sinfo", *SINFO_ARGS))
            pending = parse_squeue(self._run("squeue", *SQUEUE_ARGS))
        except Exception as exc:  # noqa: BLE001 - any failure: no new view, decisions share as before
            if not self._failing:
                log.warning("queue view not refreshed (%s); jobs are shared as with share_when = always until "
                            "it is", str(exc)[:200])
            self._failing = True
            return False
        with self._lock:
            first = self._snapshot is None
            self._snapshot = Snapshot(idle, pending, default, self._clock())
            self._claimed = {}
        if first or self._failing:
            nodes = {node: count for by_node in idle.values() for node, count in by_node.items()}
            log.warning("queue view %s: %d idle GPUs on %d nodes in %d partitions", "taken" if first else
                        "refreshed again", sum(nodes.values()), len(nodes), len(idle))
        self._failing = False
        return True

    def _fresh(self) -> Snapshot | None:
        snap = self._snapshot
        if snap is None or self._clock() - snap.taken_at > STALE_AFTER * self.period_s:
            return None
        return snap

    def _partitions(self, snap: Snapshot, partition: str | None, default: str | None) -> list[str]:
        wanted = [p.strip() for p in (partition or "").split(",") if p.strip()]
        return wanted or [p for p in (default or snap.default_partition,) if p]

    def pressure(self, partition: str | None, default: str | None = None) -> tuple[Pressure | None, int]:
        """(the pressure in the job's partitions, GPUs claimed there since the view); (None, 0) without a
        fresh view or when the partitions are unknown to it."""
        with self._lock:
            snap = self._fresh()
            if snap is None:
                return None, 0
            names = [p for p in self._partitions(snap, partition, default) if p in snap.idle]
            if not names:
                return None, 0
            nodes: dict[str, int] = {}
            for name in names:
                nodes.update(snap.idle[name])
            pending = sum(snap.pending.get(name, 0) for name in names)
            claimed = sum(self._claimed.get(name, 0) for name in names)
            return Pressure(sum(nodes.values()), pending), claimed

    def claim(self, partition: str | None, default: str | None = None, gpus: int = 1) -> None:
        """A job was kept whole on the strength of this view: it will take ``gpus`` of its idle GPUs."""
        with self._lock:
            snap = self._snapshot
            if snap is None:
                return
            for name in self._partitions(snap, partition, default):
                self._claimed[name] = self._claimed.get(name, 0) + gpus

    def start(self) -> QueueView:
        """Refresh now and every ``period_s`` in a thread of its own (the first look too: a slow Slurm
        must not delay the service's start)."""
        self._thread = threading.Thread(target=self._loop, name="queue-view", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        self.refresh()
        while not self._stop.wait(self.period_s):
            self.refresh()

    def stop(self) -> None:
        self._stop.set()
