"""``gpushare-agent``: the node agent. Samples GPUs, keeps CARMA's risk and TTFK state, runs MPS daemons,
withholds busy nodes from new shared jobs, serves the local API and Prometheus metrics.

Why a facade over parts with injected fixtures (docs/style.md #11): the clock, the device backend, the Slurm
lever and the metrics registry are constructor arguments, so unit tests step ``tick()`` with a fake clock over
the simulated backend, and the integration tests run the very same object as a daemon against a real Slurm.
``Agent`` holds what every part shares (configuration, clock, backend, the sampler, the job store, the guard,
the counters, the lock) and composes one part per concern:

==============================================  ================================================================
``jobs`` (``agent/job_registry.py``)            the job store and the entries kept in memory while the disk
                                                refuses them; registration, closing, restore; MPS daemons
``watch`` (``agent/watch.py``)                  the sampling tick: backstop and forecaster, observe mode,
                                                collateral, adoptions, warming, AdminComment evidence, withholding
``work`` (``agent/followups.py``)               the two work queues (follow-ups, AdminComment summaries) and the
                                                threads that carry them out off the lock; the spool's delivery
``handlers`` (``agent/handlers.py``)            what the three sockets ask: the API, the lanes checks, live
==============================================  ================================================================

Locks, always taken in this order and never the other way round:

1. the lane service's lock (``gpushare.agent.lane_service``): a tick reads the lane holders before it takes
   the agent's lock, and closing a job leaves its lane after releasing it;
2. ``Agent.lock`` (re-entrant), shared by every part: the sampling tick and each socket request hold it
   briefly (a tick of 8 GPUs takes well under a millisecond of work plus the backend's reads);
3. the MPS lock (``JobRegistry._mps_lock``): MPS daemon starts and stops; a start (up to tens of seconds)
   runs with only this lock held, so Prologs and the tick never wait behind it.

Anything that talks to Slurm or signals a process is queued under the lock and done by ``work`` off it.

Restart: jobs come back from the store (``gpushare.node.store``), windows refill from NVML within
one window; accumulators lose at most ``flush_every_s`` of attributed energy (whole-device energy comes
from the counters and is never lost).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from gpushare.agent.adopt import Adopter, process_uid
from gpushare.agent.failsafe import THREADS_HOLD_S, FailSafe
from gpushare.agent.followups import DELIVER_MAX_S, DELIVER_S, SPOOL, FollowUps
from gpushare.agent.guard import Guard
from gpushare.agent.handlers import Handlers
from gpushare.agent.job_registry import JobRegistry
from gpushare.agent.lane_service import LaneFacts, LaneService
from gpushare.agent.sampler import Sampler, process_job
from gpushare.agent.watch import MAX_WARMING_S, Watch
from gpushare.config import CORROBORATE_FRACTION
from gpushare.gres import open_backend
from gpushare.node.store import JobStore
from gpushare.policy.observe import Shadow

if TYPE_CHECKING:
    from gpushare.config import AgentSection
    from gpushare.gres.device import GpuBackend
    from gpushare.node.withhold import NodeFeature

log = logging.getLogger("gpushare.agent")
__all__ = ["Agent", "DELIVER_MAX_S", "DELIVER_S", "MAX_WARMING_S", "SPOOL", "main"]


class Agent:
    def __init__(self, cfg: AgentSection, backend: GpuBackend, clock: Callable[[], float] = time.time,
                 feature: NodeFeature | None = None, registry: Any = None,
                 pid_job: Callable[[int], str | None] = process_job, slurm: Any = None,
                 pid_uid: Callable[[int], int | None] = process_uid,
                 evidence_fraction: float = CORROBORATE_FRACTION) -> None:
        self.cfg = cfg
        self.evidence_fraction = evidence_fraction  # [oom] corroborate_fraction (gpushare.agent.watch)
        self.backend = backend
        self.clock = clock
        self.feature = feature
        self.lock = threading.RLock()  # the lock order is in this module's docstring
        self.store = JobStore(Path(cfg.state_dir) / "jobs")
        self.sampler = Sampler(backend, cfg.window_samples, cfg.sample_period_s, pid_job=pid_job, pid_uid=pid_uid)
        self.mps = backend.mps(str(cfg.run_dir))
        self.slurm = slurm  # SlurmClient for AdminComment run summaries; None: off
        self.guard = Guard.from_config(cfg)
        self.pid_job = pid_job
        self.adopter = Adopter(uid_of=pid_uid)
        # why the backstop must not stop what it cannot attribute now (gpushare.agent.failsafe)
        self.failsafe = FailSafe()
        self.counters = {"backstop_stops": 0, "backstop_records": 0, "forecast_warnings": 0, "oom_avoided": 0,
                         "adopted": 0, "unattributed_stops": 0, "unattributed_records": 0, "unattributed_held": 0,
                         "observe_would_stop": 0}
        # observe mode (gpushare.policy.observe): the backstop's judgement on jobs it must leave alone
        self.shadow = Shadow(self.guard.tolerance_bytes, self.guard.grace_s)
        # the latest processes acted on that belonged to no job (status "unattributed"; also in the agent log)
        self.unattributed: deque[dict[str, Any]] = deque(maxlen=100)
        self.registry = registry
        # lanes (Salus): the service has its own lock, taken before self.lock, never after (lane_service.py)
        self.lanes = LaneService(self.lane_facts, policy=cfg.lane_policy, turn_limit_s=cfg.lane_turn_limit_s)
        self.jobs = JobRegistry(self)
        self.watch = Watch(self)
        self.work = FollowUps(self)
        self.handlers = Handlers(self)
        if registry is not None:
            from gpushare.agent.metrics import register

            register(self, registry)

    @property
    def open(self) -> bool | None:
        """Whether the node takes new shared jobs, as last seen or set (None: not yet)."""
        return self.watch.open

    # -- lifecycle (JobRegistry, Watch) ------------------------------------------------------------
    def load(self) -> int:
        """Pick up every job in the store (after a restart); returns how many."""
        return self.jobs.load()

    def tick(self) -> None:
        self.watch.tick()

    def flush(self) -> None:
        """Persist every running job's accumulators (``JobRegistry.flush``)."""
        self.jobs.flush()

    def register(self, raw: dict[str, Any], by: str = "agent") -> dict[str, Any]:
        """Track a job the Prolog announces (or the agent adopts): ``JobRegistry.register``."""
        return self.jobs.register(raw, by=by)

    def close(self, job: str) -> dict[str, Any] | None:
        """Stop tracking a job; its entry (with final accumulators) stays for the Epilog to record."""
        return self.jobs.close(job)

    def thread_trouble(self, detail: str) -> None:
        """A socket server could not start a thread: the agent is short of tasks (its unit's TasksMax)."""
        self.failsafe.hold("threads", detail, for_s=THREADS_HOLD_S)

    # -- follow-ups off the lock (FollowUps) -------------------------------------------------------
    def followup_pending(self, block_s: float = 0.0) -> int:
        """Carry out queued follow-ups (job-log messages, early requeues) off the sampling lock."""
        return self.work.followup_pending(block_s)

    def annotate_pending(self, block_s: float = 0.0) -> int:
        """Write queued run summaries to Slurm (off the sampling lock); returns how many were tried."""
        return self.work.annotate_pending(block_s)

    def adopt(self, job: str, where: dict[int, list[int]]) -> dict[str, Any] | None:
        """Register a running job from Slurm's record of it (``gpushare.agent.adopt``); None: not adopted."""
        return self.work.adopt(job, where)

    def verify_restored(self, job: str, restarts: int) -> str | None:
        """Close a restored run that Slurm says no longer runs here (``gpushare.agent.restore``); its reason."""
        return self.work.verify_restored(job, restarts)

    # -- the sockets' requests (Handlers) ----------------------------------------------------------
    def lane_facts(self, job: str) -> LaneFacts:
        return self.handlers.lane_facts(job)

    def lane_owner(self, job: str, uid: int, pid: int) -> str | None:
        return self.handlers.lane_owner(job, uid, pid)

    def snapshot(self) -> dict[str, Any]:
        return self.handlers.snapshot()

    def live(self, job: str, uid: int) -> dict[str, Any]:
        return self.handlers.live(job, uid)

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.handlers.handle(request)

    # -- daemon ------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        self.work.start(stop)
        period = self.cfg.sample_period_s
        next_at = time.monotonic()
        while not stop.is_set():
            try:
                self.tick()
                self.failsafe.clear("tick")
            except Exception as exc:  # noqa: BLE001 - one bad tick must not end the agent
                log.exception("sampling tick failed")
                self.failsafe.hold("tick", f"sampling tick failed ({exc.__class__.__name__}: {str(exc)[:200]})")
            next_at += period
            delay = next_at - time.monotonic()
            if delay < 0:  # fell behind (suspended, slow backend): do not burst to catch up
                next_at, delay = time.monotonic(), 0.0
            stop.wait(delay)
        self.flush()


def main(argv: list[str] | None = None) -> int:
    from gpushare.agent.cli import run_agent

    return run_agent(argv if argv is not None else sys.argv[1:], Agent, open_backend)


if __name__ == "__main__":
    sys.exit(main())
