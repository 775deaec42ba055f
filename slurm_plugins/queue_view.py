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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpushare.policy.share_gate import Pressure
from gpushare.slurm.queue import SINFO_ARGS, SQUEUE_ARGS, idle_gpus, parse_sinfo, parse_squeue

log = logging.getLogger("gpushare.submitd")

STALE_AFTER = 3  # refresh periods after which a view is not used
# The Slurm text is parsed in gpushare.slurm.queue; these names stay importable from the view.
__all__ = ["SINFO_ARGS", "SQUEUE_ARGS", "QueueView", "Snapshot", "idle_gpus", "parse_sinfo", "parse_squeue"]


@dataclass(frozen=True)
class Snapshot:
    """One view: per partition, its idle GPUs by node, and the GPUs pending jobs there ask for."""

    idle: dict[str, dict[str, int]]  # partition -> node -> idle whole GPUs
    pending: dict[str, int]  # partition -> GPUs asked for by pending jobs
    default_partition: str | None
    taken_at: float  # the clock's reading when the view was taken


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
