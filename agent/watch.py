"""The agent's sampling tick: the backstop and forecaster, observe mode, the victims of an overrun, adoptions,
warming that never ends, the AdminComment evidence OOM recovery reads, and withholding the node.

Each step runs under the agent's lock within one tick and only records and queues: what talks to Slurm or
signals a process is a follow-up (``gpushare.agent.followups``), carried out off the lock.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Callable

from gpushare.agent.backstop import forecast_message, oom_message, unattributed_message
from gpushare.agent.failsafe import hold_reason
from gpushare.agent.guard import Action
from gpushare.agent.job_registry import merged
from gpushare.node.api import node_name
from gpushare.node.jobs import share_bytes
from gpushare.policy.observe import stop_message, summary as observe_summary
from gpushare.policy.withhold import node_open

if TYPE_CHECKING:
    from gpushare.agent.daemon import Agent

log = logging.getLogger("gpushare.agent")
MAX_WARMING_S = 600.0  # CARMA's lesson: a job that never reaches its GPU must not pin it "warming" forever


class Watch:
    """What each sampling tick checks on the tracked jobs, with the per-job state those checks keep."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.cfg, self.lock, self.store, self.sampler = agent.cfg, agent.lock, agent.store, agent.sampler
        self.feature, self.guard, self.shadow, self.adopter = agent.feature, agent.guard, agent.shadow, agent.adopter
        self.failsafe, self.counters, self.unattributed = agent.failsafe, agent.counters, agent.unattributed
        # OOM recovery's corroboration on the controller ([oom] corroborate_fraction): a shared job's peak at or
        # above this share of its GPU share is written into its AdminComment while it runs (_queue_annotations)
        self.evidence_fraction = agent.evidence_fraction
        self._evidence: dict[str, int] = {}  # job -> the peak (bytes) last written into its AdminComment
        self._shares: dict[str, int | None] = {}  # job -> its GPU share in bytes (None: not a shared job)
        self._would: dict[str, int] = {}  # job -> its would-be cap in bytes (0: not an observed job)
        self._collateral: set[tuple[str, str]] = set()  # (victim, offender) pairs already marked
        self._annotated: set[str] = set()
        self._expired: set[str] = set()
        self.open: bool | None = None
        self._last_assert = -math.inf

    def tick(self) -> None:
        holders = self.agent.lanes.holders()  # the lane service's lock comes before the agent's, never inside it
        with self.lock:
            now = self.agent.clock()
            self.sampler.tick(now)
            self._queue_adoptions(now)
            self._guard(now, holders)
            self._observe(now)
            self._expire_warming(now)
            self._queue_annotations()
            if now - self.agent.jobs.last_flush >= self.cfg.flush_every_s:
                self.agent.jobs.flush()
            self.withhold(now)

    def forget(self, job: str) -> None:
        """A closed job's state in every check (under the agent's lock)."""
        self._annotated.discard(job)
        self._evidence.pop(job, None)
        self._shares.pop(job, None)
        self._expired.discard(job)
        self._collateral = {pair for pair in self._collateral if job not in pair}
        self.adopter.forget(job)
        self.guard.forget(job)
        self.shadow.forget(job)
        self._would.pop(job, None)

    def _queue_annotations(self) -> None:
        """Run summaries into AdminComment while the job runs (Slurm refuses updates to a finished job):
        once its first kernel is seen (TTFK), and whenever its measured peak is evidence OOM recovery needs.

        Why the peak travels this way: the controller decides on a GPU OOM in EpilogSlurmctld, which can run
        before the node's Epilog has written anything (measured: 7-96 ms before it on one host), and on a real
        cluster it cannot read the node's records at all. So a shared job whose peak reaches
        ``evidence_fraction`` of its share has ``run.peak_gib`` written at once, and again each time it grows by
        a further 5 % of the share (at most about 20 writes a job), so the record the controller reads is never
        more than one sample behind the device."""
        if self.agent.slurm is None or self.cfg.admin_comment != "yes":
            return
        for acc in self.sampler.jobs.values():
            peak = max(acc.peak_bytes.values(), default=0)
            evidence = self._evidence_due(acc.job, peak)
            if (acc.kernel_at is not None and acc.job not in self._annotated) or evidence:
                self._annotated.add(acc.job)
                entry = self.agent.jobs.entry(acc.job)
                record: dict[str, Any] = {"job": acc.job, "node": node_name(self.cfg), "caps": entry.get("caps"),
                                          "would": observe_summary(entry.get("would_mib"), entry.get("would_stop"))}
                if acc.kernel_at is not None:
                    record["ttfk_s"] = acc.fields()["ttfk_s"]
                if evidence:
                    self._evidence[acc.job] = peak
                    record["gpus"] = {g: {"peak_bytes": int(v)} for g, v in acc.peak_bytes.items()}
                self.agent.work.annotations.put(record)

    def _evidence_due(self, job: str, peak: int) -> bool:
        """Whether ``peak`` should be written now: at or above the evidence share, and new by 5 % of the share."""
        if job not in self._shares:  # read once per job: the store is a file per job
            self._shares[job] = share_bytes(self.agent.jobs.entry(job))
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
            if self.agent.slurm is not None:
                self.agent.work.followups.put((Action("adopt", job, min(where), {"where": where}), ""))

    def _guard(self, now: float, holders: frozenset[str] = frozenset()) -> None:
        """Backstop and forecaster (``gpushare.agent.guard``): record now; evidence, message and stop off the lock.

        A stop waits for its follow-up (milliseconds) so that the job's AdminComment carries the measured
        peak and its log the agent's message before the job ends: OOM recovery, which runs as soon as the
        job ends, then finds both (docs/agent.md). Without a Slurm client there is nothing to write first."""
        from gpushare.agent.enforce import stop_processes

        for action in self.guard.check(now, list(self.sampler.jobs.values()), holders, self._crowded()):
            record = dict(action.record)
            if action.kind == "oom":
                if record["action"] == "stop" and self.agent.slurm is None:
                    record["pids"] = stop_processes(action.job, list(action.pids), self.owner(action.gpu))
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
            self.agent.jobs.update(action.job, merged({field_name: record}))
            self.agent.work.followups.put((Action(action.kind, action.job, action.gpu, record, action.pids), text))
        jobs = list(self.sampler.jobs.values())
        self._mark_collateral(now, self.guard.over_now(jobs, holders, self.sampler.unattributed))
        for action in self.guard.check_unattributed(now, self.sampler.unattributed, self._hold_reason):
            record = dict(action.record)
            if record["action"] == "hold":
                self.counters["unattributed_held"] += 1
            elif record["action"] == "stop":
                record["pids"] = stop_processes("", list(action.pids), self.owner(action.gpu, record["uid"]))
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

    def _observe(self, now: float) -> None:
        """Observed jobs (``[policy] mode = "observe"`` at submit): log and record the stop the backstop would
        have made, and make none."""
        for acc in list(self.sampler.jobs.values()):
            if acc.job not in self._would:
                entry = self.agent.jobs.entry(acc.job)
                self._would[acc.job] = int(entry.get("would_mib") or 0) << 20
            used = {gpu: b for gpu, b in acc.now_bytes.items() if acc.now_pids.get(gpu)}
            record = self.shadow.check(now, acc.job, self._would[acc.job], used)
            if record is None:
                continue
            self.counters["observe_would_stop"] += 1
            log.warning("%s", stop_message(acc.job, record))
            entry = self.agent.jobs.update(acc.job, merged({"would_stop": record})) or {}
            if self.agent.slurm is not None and self.cfg.admin_comment == "yes":  # into its record now, while Slurm takes it
                self.agent.work.annotations.put({"job": acc.job, "node": node_name(self.cfg),
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
                self.agent.jobs.update(acc.job, merged({"collateral": record}))
                log.warning("job %s: %s is over its GPU memory cap on GPU %d beside it; an OOM of job %s now "
                            "is collateral", acc.job, offender, gpu, acc.job)
                self.agent.work.followups.put((Action("collateral", acc.job, gpu, record), ""))

    def owner(self, gpu: int, uid: int | None = None) -> Callable[[int], str | None]:
        """What a pid is checked against just before its signal: the job on ``gpu`` it belongs to now, or ""
        when it is a process of ``uid`` that still belongs to no job (an unattributed one)."""
        def owner(pid: int) -> str | None:
            with self.lock:
                job = self.sampler.owner_now(pid, gpu)
            return "" if job is None and uid is not None and self.sampler.pid_uid(pid) == uid else job
        return owner

    def withhold(self, now: float, force: bool = False) -> None:
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

    def _expire_warming(self, now: float) -> None:
        """A shared job with no process after MAX_WARMING_S (hung, or not a GPU program) stops pinning its GPU."""
        for acc in self.sampler.jobs.values():
            stuck = acc.shared and acc.kernel_at is None and now - acc.start > MAX_WARMING_S
            if stuck and acc.job not in self._expired:
                self._expired.add(acc.job)
                self.sampler.ttfk.job_ended(acc.job)
                log.warning("job %s: no GPU process after %.0f s; its GPU is no longer held warming", acc.job,
                            now - acc.start)
