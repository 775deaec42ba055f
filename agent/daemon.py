"""``gpushare-agent``: the node agent. Samples GPUs, keeps CARMA's risk and TTFK state, runs MPS daemons,
withholds busy nodes from new shared jobs, serves the local API and Prometheus metrics.

Why one small class with injected parts (docs/style.md #11): the clock, the device backend, the Slurm lever and
the metrics registry are constructor arguments, so unit tests step ``tick()`` with a fake clock over the
simulated backend, and the integration tests run the very same object as a daemon against a real Slurm.

Threads: the sampling loop and the API threads share one lock; each API request and each tick holds it
briefly (a tick of 8 GPUs takes well under a millisecond of work plus the backend's reads).

Restart: jobs come back from the store (``gpushare.node.store``), windows refill from NVML within
one window; accumulators lose at most ``flush_every_s`` of attributed energy (whole-device energy comes
from the counters and is never lost).
"""

from __future__ import annotations

import logging
import math
import queue
import random
import subprocess
import sys
from collections import deque
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from gpushare.config import CORROBORATE_FRACTION
from gpushare.gres import GpuError, open_backend
from gpushare.agent.adopt import RETRY_S, Adopter, process_uid
from gpushare.node.api import node_name
from gpushare.agent.backstop import forecast_message, oom_message, unattributed_message
from gpushare.agent.failsafe import THREADS_HOLD_S, FailSafe, hold_reason
from gpushare.policy.observe import Shadow, cap_message, stop_message, summary as observe_summary
from gpushare.agent.guard import Action, Guard
from gpushare.agent.lane_service import LaneFacts, LaneRefused, LaneService
from gpushare.node.jobs import (build_entry, clean_facts, mps_corunners, registration_facts, share_bytes,
                                tenants_of, time_left)
from gpushare.node.jobs import final_record
from gpushare.agent.sampler import Sampler, process_job
from gpushare.node.store import STORE_VERSION, JobStore, check_job
from gpushare.node.withhold import NodeFeature
from gpushare.policy.withhold import node_open

if TYPE_CHECKING:
    from gpushare.gres.device import GpuBackend
    from gpushare.config import AgentSection

log = logging.getLogger("gpushare.agent")
MAX_WARMING_S = 600.0  # CARMA's lesson: a job that never reaches its GPU must not pin it "warming" forever


def _merged(fields: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A store update that sets ``fields`` on the entry (bound now, not when the loop variable moves on)."""
    return lambda entry: {**entry, **fields}


SPOOL = "pending-records"  # run summaries waiting for the accounting database (gpushare.epilog.stored_record)
DELIVER_S = 2.0  # the spool's delivery round (agent._deliverer) while the database takes records
DELIVER_MAX_S = 30.0  # its longest pause while the database is away


class Agent:
    def __init__(self, cfg: AgentSection, backend: GpuBackend, clock: Callable[[], float] = time.time,
                 feature: NodeFeature | None = None, registry: Any = None,
                 pid_job: Callable[[int], str | None] = process_job, slurm: Any = None,
                 pid_uid: Callable[[int], int | None] = process_uid,
                 evidence_fraction: float = CORROBORATE_FRACTION) -> None:
        self.cfg = cfg
        # OOM recovery's corroboration on the controller ([oom] corroborate_fraction): a shared job's peak at or
        # above this share of its GPU share is written into its AdminComment while it runs (_queue_annotations)
        self.evidence_fraction = evidence_fraction
        self._evidence: dict[str, int] = {}  # job -> the peak (bytes) last written into its AdminComment
        self._shares: dict[str, int | None] = {}  # job -> its GPU share in bytes (None: not a shared job)
        self.backend = backend
        self.clock = clock
        self.feature = feature
        self.lock = threading.RLock()
        self._mps_lock = threading.Lock()  # MPS daemon starts and stops, taken after self.lock, never before
        self.store = JobStore(Path(cfg.state_dir) / "jobs")
        # While the store cannot be written (a full disk): each registered job's entry is kept here, the
        # job is watched from memory, and the entry is written at the first flush the disk takes again.
        self._unsaved: dict[str, dict[str, Any]] = {}
        self._store_error: str | None = None  # set from the first failed write until one succeeds: said once
        self.sampler = Sampler(backend, cfg.window_samples, cfg.sample_period_s, pid_job=pid_job, pid_uid=pid_uid)
        self.mps = backend.mps(str(cfg.run_dir))
        self.open: bool | None = None
        self.slurm = slurm  # SlurmClient for AdminComment run summaries; None: off
        self._annotate: queue.Queue[dict[str, Any]] = queue.Queue()
        self.guard = Guard.from_config(cfg)
        self.pid_job = pid_job
        self._followups: queue.Queue[tuple[Action, str]] = queue.Queue()  # log messages, early requeues, adoptions
        self.adopter = Adopter(uid_of=pid_uid)
        # why the backstop must not stop what it cannot attribute now (gpushare.agent.failsafe)
        self.failsafe = FailSafe()
        self.counters = {"backstop_stops": 0, "backstop_records": 0, "forecast_warnings": 0, "oom_avoided": 0,
                         "adopted": 0, "unattributed_stops": 0, "unattributed_records": 0, "unattributed_held": 0,
                         "observe_would_stop": 0}
        # observe mode (gpushare.policy.observe): the backstop's judgement on jobs it must leave alone
        self.shadow = Shadow(self.guard.tolerance_bytes, self.guard.grace_s)
        self._would: dict[str, int] = {}  # job -> its would-be cap in bytes (0: not an observed job)
        # the latest processes acted on that belonged to no job (status "unattributed"; also in the agent log)
        self.unattributed: deque[dict[str, Any]] = deque(maxlen=100)
        self._collateral: set[tuple[str, str]] = set()  # (victim, offender) pairs already marked
        self._annotated: set[str] = set()
        self._expired: set[str] = set()
        self._last_flush = clock()
        self._last_assert = -math.inf
        self.registry = registry
        # lanes (Salus): the service has its own lock, taken before self.lock, never after (lane_service.py)
        self.lanes = LaneService(self.lane_facts, policy=cfg.lane_policy, turn_limit_s=cfg.lane_turn_limit_s)
        if registry is not None:
            from gpushare.agent.metrics import register

            register(self, registry)

    # -- lifecycle ---------------------------------------------------------------------------------
    def load(self) -> int:
        """Pick up every job in the store (after a restart); returns how many."""
        with self.lock:
            entries = [e for e in self.store.ensure().all() if not e.get("closed")]  # closed: awaiting its Epilog
            for entry in entries:
                self.sampler.track(entry)
                self._ensure_mps(entry)
                if self.slurm is not None:  # still running here? asked off the lock (gpushare.agent.restore)
                    self._followups.put((Action("verify", entry["job"], 0, {"restarts": entry.get("restarts", 0)}), ""))
            log.info("agent: %d running job(s) restored from %s", len(entries), self.store.dir)
            return len(entries)

    def verify_restored(self, job: str, restarts: int) -> str | None:
        """Close a restored run that Slurm says no longer runs here (``gpushare.agent.restore``); its reason."""
        from gpushare.agent.restore import not_here

        try:
            reason = not_here(self.slurm.job(job), node_name(self.cfg), restarts)
        except Exception as exc:  # noqa: BLE001 - Slurm away: the job stays tracked, as before the restart
            log.warning("job %s: restored; Slurm's record unavailable (%s)", job, exc)
            self.failsafe.hold("slurm", f"job {job}'s record unavailable ({str(exc)[:200]})", for_s=2 * RETRY_S)
            return None
        self.failsafe.clear("slurm")
        entry = self.store.get(job) or {}
        if reason is None or entry.get("closed") or entry.get("restarts", 0) != restarts:
            return None  # running, or its Epilog or a new run's Prolog got there first
        log.warning("job %s: restored from the job store, but %s; closed as lost (no Epilog ran here)", job, reason)
        self.close(job)
        self.store.update(job, lambda e: {**e, "lost": reason[:200]})
        (Path(self.cfg.run_dir) / "jobs" / f"{check_job(job)}.json").unlink(missing_ok=True)  # its Prolog's caps
        return reason

    def tick(self) -> None:
        holders = self.lanes.holders()  # the lane service's lock comes before ours, never inside it
        with self.lock:
            now = self.clock()
            self.sampler.tick(now)
            self._queue_adoptions(now)
            self._guard(now, holders)
            self._observe(now)
            self._expire_warming(now)
            self._queue_annotations()
            if now - self._last_flush >= self.cfg.flush_every_s:
                self.flush()
            self._withhold(now)

    def flush(self) -> None:
        """Persist every running job's accumulators (a crash loses at most one flush period). A full disk
        fails open: the jobs stay watched from memory and are written at the first flush it takes again."""
        with self.lock:
            wrote = False
            for acc in list(self.sampler.jobs.values()):
                try:
                    unsaved = self._unsaved.get(acc.job)
                    if unsaved is not None:  # never written: the whole entry, durably, under its lock
                        with self.store.locked(acc.job):
                            self.store.put({**unsaved, **acc.fields()})
                        del self._unsaved[acc.job]
                        wrote = True
                    else:
                        wrote = self.store.update(acc.job, _merged(acc.fields()), durable=False) is not None or wrote
                except OSError as exc:
                    self._store_failed(exc)
            if wrote:
                self._store_writable()
            self._last_flush = self.clock()

    def _entry(self, job: str) -> dict[str, Any]:
        """A job's entry: the store's, or the one kept in memory while the disk refused it ({}: neither)."""
        return self.store.get(job) or self._unsaved.get(job) or {}

    def _update(self, job: str, change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> dict[str, Any] | None:
        """``JobStore.update`` that fails open: an entry kept in memory is changed there (and written at the
        next flush the disk takes), a write the disk refuses is said once and the change kept in memory."""
        unsaved = self._unsaved.get(job)
        if unsaved is None:
            try:
                return self.store.update(job, change)
            except OSError as exc:
                self._store_failed(exc)
                unsaved = self.store.get(job)
                if unsaved is None:
                    return None
        changed = change(dict(unsaved))
        self._unsaved[job] = changed if changed is not None else unsaved
        return self._unsaved[job]

    def _store_failed(self, exc: OSError) -> None:
        """One line when the job store stops taking writes (not one per flush); jobs go on being watched."""
        if self._store_error is None:
            log.error("job store not writable (%s: %s): running jobs are watched from memory, their records go "
                      "to the Epilog from the agent, and entries are written when the disk takes them again",
                      self.store.dir, exc.strerror or exc)
        self._store_error = exc.strerror or str(exc)

    def _store_writable(self) -> None:
        if self._store_error is not None:
            log.warning("job store writable again (%s); %d job(s) still waiting to be written",
                        self.store.dir, len(self._unsaved))
            self._store_error = None

    def _queue_annotations(self) -> None:
        """Run summaries into AdminComment while the job runs (Slurm refuses updates to a finished job):
        once its first kernel is seen (TTFK), and whenever its measured peak is evidence OOM recovery needs.

        Why the peak travels this way: the controller decides on a GPU OOM in EpilogSlurmctld, which can run
        before the node's Epilog has written anything (measured: 7-96 ms before it on one host), and on a real
        cluster it cannot read the node's records at all. So a shared job whose peak reaches
        ``evidence_fraction`` of its share has ``run.peak_gib`` written at once, and again each time it grows by
        a further 5 % of the share (at most about 20 writes a job), so the record the controller reads is never
        more than one sample behind the device."""
        if self.slurm is None or self.cfg.admin_comment != "yes":
            return
        for acc in self.sampler.jobs.values():
            peak = max(acc.peak_bytes.values(), default=0)
            evidence = self._evidence_due(acc.job, peak)
            if (acc.kernel_at is not None and acc.job not in self._annotated) or evidence:
                self._annotated.add(acc.job)
                entry = self._entry(acc.job)
                record: dict[str, Any] = {"job": acc.job, "node": node_name(self.cfg), "caps": entry.get("caps"),
                                          "would": observe_summary(entry.get("would_mib"), entry.get("would_stop"))}
                if acc.kernel_at is not None:
                    record["ttfk_s"] = acc.fields()["ttfk_s"]
                if evidence:
                    self._evidence[acc.job] = peak
                    record["gpus"] = {g: {"peak_bytes": int(v)} for g, v in acc.peak_bytes.items()}
                self._annotate.put(record)

    def _evidence_due(self, job: str, peak: int) -> bool:
        """Whether ``peak`` should be written now: at or above the evidence share, and new by 5 % of the share."""
        if job not in self._shares:  # read once per job: the store is a file per job
            self._shares[job] = share_bytes(self._entry(job))
        share = self._shares[job]
        if not share or peak < self.evidence_fraction * share:
            return False
        last = self._evidence.get(job)
        return last is None or peak - last >= 0.05 * share

    def _queue_adoptions(self, now: float) -> None:
        """Jobs running on our GPUs that nobody registered (their Prolog did not run): look them up off the lock."""
        for job, where in self.adopter.due(self.sampler.strays, now):
            try:
                entry = self.store.get(job)
            except (OSError, ValueError):
                entry = None
            if entry is not None and not entry.get("closed") and job not in self.sampler.jobs:
                # its Prolog could not reach the agent and registered it in the job store itself
                log.warning("job %s: running on GPU(s) %s, registered by %s while the agent was unreachable; "
                            "taken from the job store", job, sorted(where), entry.get("registered_by") or "?")
                self.sampler.track(entry)
                continue
            if self.slurm is not None:
                self._followups.put((Action("adopt", job, min(where), {"where": where}), ""))

    def adopt(self, job: str, where: dict[int, list[int]]) -> dict[str, Any] | None:
        """Register a running job from Slurm's record of it (``gpushare.agent.adopt``); None: not adopted."""
        try:
            slurm_job = self.slurm.job(job)
        except Exception as exc:  # noqa: BLE001 - Slurm busy or down: tried again after the retry period
            log.warning("job %s: running on GPU(s) %s unregistered; Slurm's record unavailable (%s)", job,
                        sorted(where), exc)
            self.failsafe.hold("slurm", f"job {job}'s record unavailable ({str(exc)[:200]})", for_s=2 * RETRY_S)
            return None
        self.failsafe.clear("slurm")
        refusal = self.adopter.refusal(slurm_job, node_name(self.cfg), where)
        with self.lock:
            if refusal is None:
                self.adopter.refused.pop(job, None)
            else:
                self.adopter.refused[job] = refusal
        if refusal is not None:
            log.info("job %s: processes on GPU(s) %s but no registration; not adopted: %s", job, sorted(where), refusal)
            return None
        facts = registration_facts(job, int(slurm_job.user_id), slurm_job.user_name, sorted(where), slurm_job)
        entry = self.register(facts, by="agent-adopted")
        if entry.get("registered_by") != "agent-adopted":  # the Prolog was only late: its registration stands
            return entry
        self.counters["adopted"] += 1
        log.warning("job %s: running on GPU(s) %s without a registration (its Prolog did not run); adopted from "
                    "Slurm's record, cap %s MiB, backstop only", job, sorted(where),
                    (entry.get("caps") or {}).get("mem_limit_mib"))
        return entry

    def _guard(self, now: float, holders: frozenset[str] = frozenset()) -> None:
        """Backstop and forecaster (``gpushare.agent.guard``): record now; evidence, message and stop off the lock.

        A stop waits for its follow-up (milliseconds) so that the job's AdminComment carries the measured
        peak and its log the agent's message before the job ends: OOM recovery, which runs as soon as the
        job ends, then finds both (docs/agent.md). Without a Slurm client there is nothing to write first."""
        from gpushare.agent.enforce import stop_processes

        for action in self.guard.check(now, list(self.sampler.jobs.values()), holders, self._crowded()):
            record = dict(action.record)
            if action.kind == "oom":
                if record["action"] == "stop" and self.slurm is None:
                    record["pids"] = stop_processes(action.job, list(action.pids), self._owner(action.gpu))
                    self.counters["backstop_stops"] += 1
                elif record["action"] == "stop":
                    record["pids"] = []  # filled in when the follow-up stops them
                else:
                    self.counters["backstop_records"] += 1
                log.warning("job %s: %s", action.job, oom_message(action.job, record).strip())
                text = oom_message(action.job, record)
            else:
                self.counters["forecast_warnings"] += 1
                log.warning("job %s: %s", action.job, forecast_message(action.job, record).strip())
                text = forecast_message(action.job, record)
            field_name = action.kind
            self._update(action.job, _merged({field_name: record}))
            self._followups.put((Action(action.kind, action.job, action.gpu, record, action.pids), text))
        jobs = list(self.sampler.jobs.values())
        self._mark_collateral(now, self.guard.over_now(jobs, holders, self.sampler.unattributed))
        for action in self.guard.check_unattributed(now, self.sampler.unattributed, self._hold_reason):
            record = dict(action.record)
            if record["action"] == "hold":
                self.counters["unattributed_held"] += 1
            elif record["action"] == "stop":
                record["pids"] = stop_processes("", list(action.pids), self._owner(action.gpu, record["uid"]))
                self.counters["unattributed_stops"] += 1
            else:
                self.counters["unattributed_records"] += 1
            self.unattributed.append(record)
            log.warning("unattributed GPU memory: %s", unattributed_message(record))

    def _hold_reason(self, stranger: Any) -> str | None:
        """Why an unattributed process must not be stopped now (``gpushare.agent.failsafe``); None: it may."""
        claim = stranger.claim
        return hold_reason(claim, claim is not None and claim in self.sampler.jobs,
                           claim is not None and claim in self.adopter.refused, self.failsafe.reasons())

    def thread_trouble(self, detail: str) -> None:
        """A socket server could not start a thread: the agent is short of tasks (its unit's TasksMax)."""
        self.failsafe.hold("threads", detail, for_s=THREADS_HOLD_S)

    def _observe(self, now: float) -> None:
        """Observed jobs (``[policy] mode = "observe"`` at submit): log and record the stop the backstop would
        have made, and make none."""
        for acc in list(self.sampler.jobs.values()):
            if acc.job not in self._would:
                entry = self._entry(acc.job)
                self._would[acc.job] = int(entry.get("would_mib") or 0) << 20
            used = {gpu: b for gpu, b in acc.now_bytes.items() if acc.now_pids.get(gpu)}
            record = self.shadow.check(now, acc.job, self._would[acc.job], used)
            if record is None:
                continue
            self.counters["observe_would_stop"] += 1
            log.warning("%s", stop_message(acc.job, record))
            entry = self._update(acc.job, _merged({"would_stop": record})) or {}
            if self.slurm is not None and self.cfg.admin_comment == "yes":  # into its record now, while Slurm takes it
                self._annotate.put({"job": acc.job, "node": node_name(self.cfg),
                                    "would": observe_summary(entry.get("would_mib"), record),
                                    "gpus": {g: {"peak_bytes": int(v)} for g, v in acc.peak_bytes.items()}})

    def _crowded(self) -> frozenset[int]:
        """GPUs with more than one job (or process of no job) and less than the backstop's tolerance free."""
        crowded = set()
        for index, view in self.sampler.views.items():
            tenants = len(view.jobs) + len(self.sampler.unattributed.get(index, []))
            if tenants > 1 and not math.isnan(view.used) and view.total - view.used < self.guard.tolerance_bytes:
                crowded.add(index)
        return frozenset(crowded)

    def _mark_collateral(self, now: float, overruns: list[tuple[str, int]]) -> None:
        """Every other shared job on a GPU where a job (or a process of no job) is over its cap is marked as
        its possible victim, once per offender: ``collateral`` in its store entry (and so its run record)
        and, off the lock, in its AdminComment while Slurm still takes updates. An OOM of the victim soon
        after is then recovered on its own share at no cost to its user (gpushare.policy.oom_recovery)."""
        for offender, gpu in overruns:
            for acc in self.sampler.jobs_on(gpu):
                if acc.job == offender or not acc.shared or (acc.job, offender) in self._collateral:
                    continue
                self._collateral.add((acc.job, offender))
                record = {"by": offender, "gpu": gpu, "at": round(now, 3)}
                self._update(acc.job, _merged({"collateral": record}))
                log.warning("job %s: %s is over its GPU memory cap on GPU %d beside it; an OOM of job %s now "
                            "is collateral", acc.job, offender, gpu, acc.job)
                self._followups.put((Action("collateral", acc.job, gpu, record), ""))

    def _owner(self, gpu: int, uid: int | None = None) -> Callable[[int], str | None]:
        """What a pid is checked against just before its signal: the job on ``gpu`` it belongs to now, or ""
        when it is a process of ``uid`` that still belongs to no job (an unattributed one)."""
        def owner(pid: int) -> str | None:
            with self.lock:
                job = self.sampler.owner_now(pid, gpu)
            return "" if job is None and uid is not None and self.sampler.pid_uid(pid) == uid else job
        return owner

    def followup_pending(self, block_s: float = 0.0) -> int:
        """Carry out queued follow-ups (job-log messages, early requeues) off the sampling lock."""
        from gpushare.agent.enforce import requeue_early, write_job_message

        done = 0
        while True:
            try:
                action, text = (self._followups.get(timeout=block_s) if block_s and not done
                                else self._followups.get_nowait())
            except queue.Empty:
                return done
            done += 1
            if action.kind == "adopt" and self.slurm is not None:
                self.adopt(action.job, action.record["where"])
                continue
            if action.kind == "verify":
                self.verify_restored(action.job, int(action.record["restarts"]))
                continue
            if action.kind == "collateral":
                if self.slurm is not None:
                    from gpushare.node.comment import annotate_fields

                    annotate_fields(self.slurm, action.job, collateral=action.record)
                continue
            if self.slurm is None:
                log.warning("job %s: no Slurm client; message only in the agent log", action.job)
                continue
            entry = self._entry(action.job)
            stopping = action.kind == "oom" and action.record.get("action") == "stop"
            if stopping:
                self._leave_evidence(action, entry)
            write_job_message(self.slurm, action.job, int(entry.get("uid", -1)), text, node_name(self.cfg))
            if stopping:
                self._stop(action)
            if action.kind != "forecast":
                continue
            if action.record.get("action") != "requeue":
                self._forecast_outcome(action.job, "warned")
                continue
            # recorded before the requeue: the requeue runs the Epilog, which writes the run's record
            self._forecast_outcome(action.job, "requeued")
            if requeue_early(self.slurm, action.job, float(action.record["predicted_bytes"])):
                self.counters["oom_avoided"] += 1
            else:
                self._forecast_outcome(action.job, "requeue-failed")

    def _leave_evidence(self, action: Action, entry: dict[str, Any]) -> None:
        """The measured peak into the job's AdminComment (``run.peak_gib``) while Slurm still takes updates:
        what OOM recovery's corroboration reads on the controller (gpushare/policy/oom_recovery.py)."""
        from gpushare.node.comment import annotate

        gpu = str(action.gpu)
        peaks = {**(entry.get("peak_bytes") or {})}
        peaks[gpu] = max(int(peaks.get(gpu) or 0), int(action.record.get("peak_bytes") or 0))
        record = {"node": node_name(self.cfg), "caps": entry.get("caps"),
                  "gpus": {g: {"peak_bytes": value} for g, value in peaks.items()}}
        kernel, start = entry.get("kernel_at"), entry.get("start")
        if kernel is not None and start is not None and entry.get("ttfk_source") != "adopted":
            record["ttfk_s"] = round(float(kernel) - float(start), 3)
        annotate(self.slurm, action.job, record)

    def _stop(self, action: Action) -> None:
        from gpushare.agent.enforce import stop_processes

        stopped = stop_processes(action.job, list(action.pids), self._owner(action.gpu))
        self.counters["backstop_stops"] += 1
        with self.lock:
            self._update(action.job, lambda e: {**e, "oom": {**(e.get("oom") or {}), "pids": stopped}})

    def _forecast_outcome(self, job: str, outcome: str) -> None:
        with self.lock:
            self._update(job, lambda e: {**e, "forecast": {**(e.get("forecast") or {}), "outcome": outcome}})

    def annotate_pending(self, block_s: float = 0.0) -> int:
        """Write queued run summaries to Slurm (off the sampling lock); returns how many were tried."""
        from gpushare.node.comment import annotate

        done = 0
        while True:
            try:
                record = self._annotate.get(timeout=block_s) if block_s and not done else self._annotate.get_nowait()
            except queue.Empty:
                return done
            annotate(self.slurm, record["job"], record)
            done += 1

    def _withhold(self, now: float, force: bool = False) -> None:
        if self.feature is None:
            return
        # GPUs held by a whole-GPU job cannot receive a shared job anyway: they do not close the node
        whole = {g for acc in self.sampler.jobs.values() if not acc.shared for g in acc.gpus}
        flags = [any(self.sampler.withheld(i, now)) for i in self.sampler.views if i not in whole]
        want = node_open(flags, self.cfg.withhold_node_when)
        # assert-then-apply: scontrol only on a change, re-checked every 30 s (slurmd re-registration or an
        # admin may have reset the node's features)
        if force or want != self.open or now - self._last_assert >= 30.0:
            try:
                self.feature.apply(want)
            except Exception as exc:  # noqa: BLE001 - Slurm down must not stop sampling
                log.error("withhold: %s", exc)
                return
            self.open, self._last_assert = want, now

    def _ensure_mps(self, entry: dict[str, Any]) -> bool:
        """Start the MPS daemon an MPS job needs; False when it cannot run (the job must not use MPS)."""
        if (entry.get("caps") or {}).get("mode") != "mps":
            return True
        gpu = entry["gpus"][0]
        try:
            with self._mps_lock:
                if not self.mps.running(gpu):
                    self.mps.start(gpu)
                    log.info("MPS control daemon started for GPU %d", gpu)
            return True
        except GpuError as exc:
            log.error("MPS for GPU %d: %s; jobs there get the memory-fraction guard instead", gpu, exc)
            return False

    def _expire_warming(self, now: float) -> None:
        """A shared job with no process after MAX_WARMING_S (hung, or not a GPU program) stops pinning its GPU."""
        for acc in self.sampler.jobs.values():
            stuck = acc.shared and acc.kernel_at is None and now - acc.start > MAX_WARMING_S
            if stuck and acc.job not in self._expired:
                self._expired.add(acc.job)
                self.sampler.ttfk.job_ended(acc.job)
                log.warning("job %s: no GPU process after %.0f s; its GPU is no longer held warming", acc.job,
                            now - acc.start)

    def _stop_idle_mps(self, gpus: list[int]) -> None:
        for gpu in gpus:
            if any(acc.mode == "mps" for acc in self.sampler.jobs_on(gpu)):
                continue
            try:
                with self._mps_lock:
                    if self.mps.running(gpu):
                        self.mps.stop(gpu)
            except GpuError as exc:
                log.error("MPS stop for GPU %d: %s", gpu, exc)

    # -- API operations ----------------------------------------------------------------------------
    def register(self, raw: dict[str, Any], by: str = "agent") -> dict[str, Any]:
        """Track a job the Prolog announces (or the agent adopts). Starting an MPS daemon (up to tens of
        seconds) happens outside the sampling lock: the Prolog waits only a few seconds, and other jobs'
        Prologs and the sampling loop must not queue behind one slow MPS start. An adopted job is already
        running without an MPS pipe: it never gets one."""
        facts = clean_facts(raw)
        adopted = by == "agent-adopted"
        with self.lock:
            existing = self.store.get(facts["job"]) or self._unsaved.get(facts["job"])
            if existing is not None and not existing.get("closed") and existing.get("restarts") == facts["restarts"]:
                self.sampler.track(existing)  # a Prolog retried: idempotent
                self._withhold(self.clock())
                return existing
            entries = self.store.all()
            tenants = tenants_of(entries, facts["gpus"], facts["job"])
            corunners = mps_corunners(entries, facts["gpus"], facts["job"])
            entry = build_entry(facts, self.cfg, self.backend, tenants, self.clock(), by=by, mps_ok=not adopted,
                                corunners=corunners)
        mps_ok = adopted or self._ensure_mps(entry)  # its own lock; never hand out an MPS pipe in vain
        with self.lock:
            if not mps_ok:
                entry = build_entry(facts, self.cfg, self.backend, tenants, self.clock(), by=by, mps_ok=False)
            if adopted:  # its start was not seen: no TTFK, and its GPU is not "warming" for it
                entry = {**entry, "kernel_at": entry["start"], "ttfk_source": "adopted",
                         "caps": {**entry["caps"], "reason": "adopted running (its Prolog did not run): backstop only"}}
            try:
                self.store.put(entry)
                self._unsaved.pop(entry["job"], None)
                self._store_writable()
            except OSError as exc:  # a full disk: the job runs with its caps, watched from memory
                self._store_failed(exc)
                self._unsaved[entry["job"]] = {**entry, "v": STORE_VERSION}
            self.sampler.track(entry)
            self._withhold(self.clock())
            if entry.get("would_mib"):
                log.info("%s", cap_message(entry["job"], int(entry["would_mib"]), int(entry.get("would_shards") or 0)))
            return entry

    def close(self, job: str) -> dict[str, Any] | None:
        """Stop tracking a job; its entry (with final accumulators) stays for the Epilog to record."""
        job = check_job(job)
        with self.lock:
            acc = self.sampler.untrack(job)
            fields = acc.fields() if acc else {}
            unsaved = self._unsaved.pop(job, None)
            entry: dict[str, Any] | None
            try:
                if unsaved is not None:
                    with self.store.locked(job):
                        entry = self.store.put({**unsaved, **fields, "closed": True})
                else:
                    entry = self.store.update(job, lambda e: {**e, **fields, "closed": True})
            except OSError as exc:  # a full disk: the Epilog gets the entry from this answer all the same
                self._store_failed(exc)
                known = unsaved if unsaved is not None else self.store.get(job)
                entry = {**known, **fields, "closed": True} if known is not None else None
            if acc:
                self._stop_idle_mps(acc.gpus)
            self._annotated.discard(job)
            self._evidence.pop(job, None)
            self._shares.pop(job, None)
            self._expired.discard(job)
            self._collateral = {pair for pair in self._collateral if job not in pair}
            self.adopter.forget(job)
            self.guard.forget(job)
            self.shadow.forget(job)
            self._would.pop(job, None)
            self._withhold(self.clock())
        self.lanes.leave(job, "closed by its Epilog")  # after self.lock: lock order (lane_service.py)
        return entry

    # -- lanes (gpushare.agent.lanes) ----------------------------------------------------------------
    def lane_facts(self, job: str) -> LaneFacts:
        """A registered, open lane job's lane facts, with its GPU's memory left to lane jobs (the GPU's
        memory less the caps of the non-lane jobs on it) and its time limit left; LaneRefused otherwise."""
        with self.lock:
            entry = self.store.get(job) or self._unsaved.get(job)  # kept in memory on a full disk
            if entry is None or entry.get("closed"):
                raise LaneRefused(f"job {job} is not running here")
            if not entry.get("lanes") or len(entry.get("gpus") or []) != 1:
                raise LaneRefused(f"job {job} is not a single-GPU lane job (#GPUSHARE lanes)")
            gpu = int(entry["gpus"][0])
            try:
                total = int(self.backend.gpu(gpu).total_bytes)
            except GpuError as exc:
                raise LaneRefused(f"GPU {gpu} unreadable: {exc}") from None
            others = [e for e in self.store.all() if not e.get("closed") and not e.get("lanes")
                      and gpu in (e.get("gpus") or [])]
            held = 0
            for other in others:
                need = (other.get("caps") or {}).get("mem_limit_mib")
                held += int(need) << 20 if need else (total if not other.get("shared") else 0)
            return LaneFacts(job, int(entry.get("uid", -1)), gpu, int(entry.get("persistent_bytes") or 0),
                             int(entry.get("ephemeral_bytes") or 0), bool(entry.get("own_lane")),
                             max(0, total - held), time_left(entry, self.clock()))

    def lane_owner(self, job: str, uid: int, pid: int) -> str | None:
        """None when the peer (uid, pid from SO_PEERCRED) may act for lane job ``job``; else the refusal."""
        try:
            facts = self.lane_facts(job)
        except LaneRefused as exc:
            return str(exc)
        if uid != facts.uid:
            return f"job {job} belongs to another user"
        if self.pid_job(pid) != job:
            return f"the connecting process is not one of job {job}'s processes"
        return None

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            now = self.clock()
            gpus = []
            for index, view in self.sampler.views.items():
                risky, warming = self.sampler.withheld(index, now)
                gpus.append({"index": index, "memory_used": view.used, "memory_total": view.total,
                             "energy_mj": view.energy_mj, "power_w": view.power_w, "source": view.source,
                             "risk": {"smact": view.risk.smact, "smocc": view.risk.smocc, "drama": view.risk.drama},
                             "risky": risky, "warming": warming, "ready_at": self.sampler.ttfk.ready_at(index),
                             "jobs": list(view.jobs) or [a.job for a in self.sampler.jobs_on(index)],
                             "samples": view.samples, "error": view.error})
            jobs = [{"job": a.job, "uid": a.uid, "user": a.user, "gpus": a.gpus, "mode": a.mode, "start": a.start,
                     "now_bytes": dict(a.now_bytes), "cap_bytes": a.cap_bytes,
                     **{k: v for k, v in a.fields().items() if k not in ("series", "series_stride")}}
                    for a in self.sampler.jobs.values()]
            state = {"now": now, "node_open": self.open, "gpus": gpus, "jobs": jobs, "guard": dict(self.counters),
                     "unattributed": list(self.unattributed), "failsafe": self.failsafe.snapshot()}
        return {**state, "lanes": self.lanes.snapshot()}

    def live(self, job: str, uid: int) -> dict[str, Any]:
        """A running job's run summary so far, for root or the job's own user (gpushare.agent.live_api): what
        ``gpushare jobstats`` shows before the node Epilog stores the final one."""
        from gpushare.node.comment import run_summary

        unknown = {"ok": False, "error": f"job {str(job)[:20]}: not running on this node as yours"}
        try:
            job = check_job(job)
        except ValueError:
            return unknown
        with self.lock:
            acc = self.sampler.jobs.get(job)
            entry = (self.store.get(job) or self._unsaved.get(job)) if acc is not None else None
            if acc is None or entry is None or entry.get("closed") or uid not in (0, int(entry.get("uid", -1))):
                return unknown
            now = self.clock()
            record = final_record({**entry, **acc.fields()}, self.backend, end=now, node=node_name(self.cfg))
        return {"ok": True, "job": job, "node": node_name(self.cfg), "at": round(now, 3),
                "run": run_summary(record)}

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        try:
            if op == "ping":
                return {"ok": True}
            if op == "register":
                entry = self.register(request.get("job") or {})
                return {"ok": True, "caps": entry["caps"], "env": entry["env"]}
            if op == "close":
                closed = self.close(str(request.get("job", "")))  # None: the agent did not know the job
                return {"ok": True, "entry": closed}
            if op == "status":
                return {"ok": True, **self.snapshot()}
        except ValueError as exc:
            return {"ok": False, "error": str(exc)}
        return {"ok": False, "error": f"unknown op {str(op)[:30]!r} (known: ping, register, close, status)"}

    # -- daemon ------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        if self.slurm is not None:
            threading.Thread(target=self._annotator, args=(stop,), name="gpushare-annotate", daemon=True).start()
        if self.slurm is not None and self.cfg.admin_comment == "yes":
            threading.Thread(target=self._deliverer, args=(stop,), name="gpushare-deliver", daemon=True).start()
        threading.Thread(target=self._followup_loop, args=(stop,), name="gpushare-guard", daemon=True).start()
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


    def _followup_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.followup_pending(block_s=1.0)
            except Exception:  # noqa: BLE001
                log.exception("guard follow-up failed")

    def _deliverer(self, stop: threading.Event) -> None:
        """Run summaries the Epilog spooled while the accounting database was away, delivered once it is back:
        every DELIVER_S while some wait, backing off (jittered, at most DELIVER_MAX_S) while the database still
        refuses them. The delivery itself is the Epilog layer's (``python -m gpushare.epilog.stored_record``,
        one short process per round, only while the spool holds something)."""
        directory, delay = Path(self.cfg.state_dir) / SPOOL, DELIVER_S
        while not stop.wait(delay * random.uniform(0.8, 1.2)):
            try:
                if not any(directory.glob("*.json")):
                    delay = DELIVER_S
                    continue
                argv = [sys.executable, "-m", "gpushare.epilog.stored_record", "--state-dir", str(self.cfg.state_dir)]
                if self.slurm.conf_path:
                    argv += ["--slurm-conf", str(self.slurm.conf_path)]
                if self.slurm.bin_dir:
                    argv += ["--bin-dir", str(self.slurm.bin_dir)]
                done = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
                if done.stderr.strip():
                    log.info("spooled records: %s", done.stderr.strip()[-300:])
                delivered = done.returncode == 0  # 0: nothing left; 3: some still pending
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("spooled record delivery failed")
                delivered = False
            delay = DELIVER_S if delivered else min(DELIVER_MAX_S, delay * 2)

    def _annotator(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.annotate_pending(block_s=1.0)
            except Exception:  # noqa: BLE001
                log.exception("AdminComment update failed")


def main(argv: list[str] | None = None) -> int:
    from gpushare.agent.cli import run_agent

    return run_agent(argv if argv is not None else sys.argv[1:], Agent, open_backend)


if __name__ == "__main__":
    sys.exit(main())
