"""The discrete-event core: replay jobs against simulated GPUs through a real placement policy.

Why event-driven: between arrivals, first kernels and completions nothing changes, so a 4-hour trace
takes thousands of steps, not millions of seconds. The policy objects are the agent's own
(``gpushare.simulator.policies``), fed with the same inputs the agent builds from NVML: free memory,
CARMA's risk verdict over a 1 Hz 30-sample window (``gpushare.policy.risk``) and the TTFK table.

Why its cost grows with events, not jobs × events (a month of a 1,000-GPU cluster is 100,000 jobs): a
running job's finish time is an event in the queue, recomputed only when its rate changes, and rates are
recomputed only for the jobs on GPUs whose processes changed (``SimCluster.changed``); a job's remaining
work is kept as of its last rate change (``JobRun.since``). Placement reads one persistent view per GPU
(``GpuView``), refreshed when that GPU changes; the time-dependent fields (TTFK warming, the risk window)
are computed when a policy reads them, and a queue head that failed without reading any of them is not
retried until a GPU changes, since the policy would see the same inputs. Same results as the
per-event engine it replaced: ``tests/simulator/test_golden_tables.py``.

Life of a job: queued → dispatched (CUDA context only, no progress) → first kernel after its TTFK: memory
grows to its peak; if the GPU's memory is now over capacity the *new* job dies with an OOM (CARMA §2.5:
co-runners survive). With ``caps`` set (False or True), a job whose peak exceeds its share (estimate +
margin) first runs within its share and outgrows it after ``GROW_AFTER`` of its work: without caps it
takes whatever memory is free (the room reserved for neighbours still starting), with caps it hits its
own cap and OOMs alone. An OOM of a job within its own share was caused by a neighbour
(``neighbour_ooms``): with caps that count is 0 by construction, without caps it is what caps prevent.
A job that OOMs, with recovery on, goes once to the recovery queue, which is served first and only onto
idle GPUs (exclusive, raised priority) → running at the interference-reduced speed → done.
Queues are FIFO with head-of-line blocking, as CARMA's; ``poll_s`` is how often a blocked head retries
while telemetry changes (risk windows and TTFK windows expire without an event of their own).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from gpushare.gpus import GiB, capacity_bytes, parse_target
from gpushare.policy import risk
from gpushare.simulator.policies import GpuState, JobRequest, Policy, make_policy
from gpushare.simulator import estimators
from gpushare.simulator.device import CONTEXT_GIB, SimCluster, SimGpu, noise_bound, noise_scores
from gpushare.simulator.interference import Interference
from gpushare.simulator.live import LiveSetup
from gpushare.policy.share_gate import Pressure, compute_shards, gate, share_shards
from gpushare.simulator.trace import JobSpec
from gpushare.simulator.workload import UTIL_PROFILES


GROW_AFTER = 0.2  # fraction of its solo run time after which an offender outgrows its share


@dataclass
class SimConfig:
    nodes: int = 1
    gpus_per_node: int = 3
    gpu: str = "a100-40gb"
    policy: str = "magm"
    estimator: str = "oracle"
    seed: int = 0
    recovery: bool = True
    poll_s: float = 5.0
    window_s: float = risk.WINDOW_SAMPLES * risk.SAMPLE_PERIOD_S
    throughputs: Path | None = None
    interference: str = "gavel"  # or "share" (gpushare.simulator.interference)
    util: str = "carma-fit"  # solo utilisation per class: a key of workload.UTIL_PROFILES ("classes": assumed)
    # None: memory reaches its peak at the first kernel (the model the published tables use). False/True:
    # a job that outgrew its share first runs within it and grows past it later (GROW_AFTER of its work),
    # without / with per-job caps (framework caps, MPS limit, the agent's backstop)
    caps: bool | None = None
    live: LiveSetup | None = None  # --policy live: the deployed stack's settings (gpushare.simulator.live)

    def policy_options(self) -> dict[str, object]:
        """What ``make_policy`` needs beyond the name: the live stack's placement settings."""
        if self.live is None:
            return {}
        return {"least_loaded": self.live.least_loaded, "withhold": self.live.withhold,
                "withhold_when": self.live.withhold_when, "thread_policy": self.live.thread_policy}


@dataclass
class JobRun:
    spec: JobSpec
    request: int | None  # per-GPU bytes the policy sees
    shards: int
    remaining: float  # solo seconds of work left at ``since`` (``Simulation.remaining`` gives it now)
    queued_since: float
    state: str = "queued"  # queued | starting | running | done | failed
    gpus: list[int] = field(default_factory=list)
    recovered: bool = False  # this attempt is an OOM recovery (exclusive)
    whole: bool = False  # its request keeps a whole GPU (the live stack's exclusive_above_fraction)
    ooms: int = 0
    neighbour_ooms: int = 0  # OOMs this job suffered while within its own request (a neighbour's fault)
    rate: float = 0.0
    since: float = 0.0  # when ``remaining`` was last brought up to date (its rate is constant since)
    finish_seq: int = 0  # the sequence number of its pending finish event; 0: none
    dispatched_t: float = 0.0
    first_start: float | None = None
    end: float | None = None
    wait_s: float = 0.0
    exec_s: float = 0.0
    reason: str = ""


class GpuView(GpuState):
    """What a policy sees of one GPU: a :class:`GpuState` kept up to date by the engine.

    Why not a fresh ``GpuState`` per GPU and attempt: on a 1,000-GPU cluster that is the whole cost of a
    run. The fields from the GPU's own state are refreshed when it changes (``refresh``); ``warming``,
    ``risky`` and ``smact`` depend on the clock too and are computed when first read at a given time,
    which also tells the engine whether a failed attempt depended on the clock (``Simulation._clocked``).
    """

    _sim: Simulation
    _gpu: SimGpu
    _at: float  # the time the clock-dependent fields below were computed for
    _warming: bool | None
    _verdict: risk.RiskAssessment | None
    _window_key: tuple[int, int] | None
    _window_verdict: risk.RiskAssessment

    def __init__(self, sim: Simulation, gpu: SimGpu) -> None:
        object.__setattr__(self, "_sim", sim)
        object.__setattr__(self, "_gpu", gpu)
        object.__setattr__(self, "_at", -math.inf)
        object.__setattr__(self, "_window_key", None)
        self.refresh()

    def refresh(self) -> None:
        gpu, sim = self._gpu, self._sim
        fields = self.__dict__  # the frozen dataclass's own storage: what object.__setattr__ writes, at less cost
        fields["index"], fields["node"], fields["total_bytes"] = gpu.index, gpu.node, gpu.capacity_bytes
        fields["free_bytes"] = gpu.capacity_bytes - sim.cluster.used_bytes(gpu.index)
        fields["jobs"], fields["exclusive"] = len(gpu.residents), gpu.exclusive
        fields["shards_total"], fields["shards_free"] = gpu.shards_total, gpu.shards_free
        fields["_at"] = -math.inf

    def _now(self) -> None:
        sim = self._sim
        sim._clocked = True
        if self._at != sim.now:
            object.__setattr__(self, "_at", sim.now)
            object.__setattr__(self, "_warming", None)
            object.__setattr__(self, "_verdict", None)

    @property  # type: ignore[override]
    def warming(self) -> bool:
        self._now()
        if self._warming is None:
            object.__setattr__(self, "_warming", self._sim.ttfk.warming(self._gpu.index, self._sim.now))
        return bool(self._warming)

    def _settled(self) -> bool | None:
        """The verdict without a window where the noise cannot change it: every sample is below a
        threshold it must reach (not risky) or above all of them (risky); None when it might. Safe because
        each score is a weighted mean of statistics of the window, none outside its lowest and highest
        sample."""
        if not self._sim.policy.needs_telemetry:
            return False
        (a_lo, a_hi), (o_lo, o_hi), (d_lo, d_hi) = self._gpu.window_range(self._sim.now, risk.WINDOW_SAMPLES)
        noise, limit = self._sim.noise + 1e-9, risk.Thresholds()
        if a_hi + noise < limit.smact or (o_hi + noise < limit.smocc and d_hi + noise < limit.drama):
            return False
        if a_lo - noise >= limit.smact and (o_lo - noise >= limit.smocc or d_lo - noise >= limit.drama):
            return True
        steady = self._gpu.steady(self._sim.now, risk.WINDOW_SAMPLES)
        if steady is None or any(v - noise <= 0.0 or v + noise >= 1.0 for v in steady[0]):
            return None  # the window spans a change, or the noise may be clipped: only the window can tell
        scores = [v + s for v, s in zip(steady[0], noise_scores(self._sim.config.seed, steady[1], risk.WINDOW_SAMPLES))]
        margins = [score - threshold for score, threshold in zip(scores, (limit.smact, limit.smocc, limit.drama))]
        if any(abs(m) < 1e-9 for m in margins):
            return None  # too close to call to rounding
        return margins[0] >= 0 and (margins[1] >= 0 or margins[2] >= 0)

    def _assess(self) -> risk.RiskAssessment:
        self._now()
        if self._verdict is None:
            verdict = risk.RiskAssessment(0.0, 0.0, 0.0, False)
            if self._sim.policy.needs_telemetry:
                # the window is the same within one second of an unchanged GPU
                key = (int(self._sim.now), self._gpu.version)
                if self._window_key != key:
                    object.__setattr__(self, "_window_key", key)
                    object.__setattr__(self, "_window_verdict", risk.assess(*self._gpu.window_series(
                        self._sim.now, risk.WINDOW_SAMPLES, self._sim.config.seed)))
                verdict = self._window_verdict
            object.__setattr__(self, "_verdict", verdict)
            return verdict
        return self._verdict

    @property  # type: ignore[override]
    def risky(self) -> bool:
        self._now()
        if self._verdict is None:
            settled = self._settled()
            if settled is not None:
                return settled
        return self._assess().risky

    @property  # type: ignore[override]
    def smact(self) -> float:
        return self._assess().smact


class Simulation:
    """One run: ``Simulation(jobs, config).run()`` returns itself with ``jobs`` and ``gpus`` filled."""

    # events that change no telemetry the placement policy reads, so they do not restart the risk and
    # TTFK settling that keeps polling a blocked queue head (``_maybe_poll``)
    quiet_events: frozenset[str] = frozenset({"poll"})

    def __init__(self, jobs: list[JobSpec], config: SimConfig, interference: Interference | None = None):
        self.config = config
        model, profile = parse_target(config.gpu)
        self.now = 0.0
        self.cluster = SimCluster(model, capacity_bytes(model, profile), config.nodes, config.gpus_per_node,
                                  clock=lambda: self.now)
        self.gpus = self.cluster.gpus
        self.energy_j: list[float] = [0.0] * len(self.gpus)  # per GPU, first arrival to last completion
        self._energy_start: list[float] | None = None
        self.policy = make_policy(config.policy, **config.policy_options())
        self.interference = interference or Interference.load(config.throughputs, config.interference)
        self.util = UTIL_PROFILES[config.util]  # class -> solo (SMACT, SMOCC, DRAMA)
        self._active_ids: dict[int, list[str]] = {}  # per GPU: its loading processes at the last rate update
        self._kinds: dict[str, int] = {}  # job -> its interference kind (``Interference.kind``)
        self.ttfk = risk.TtfkTable(config.window_s)
        total = self.gpus[0].shards_total
        self.jobs: dict[str, JobRun] = {}
        live = config.live
        margin = (live.margin_fraction, live.margin_min_gib) if live else (0.10, 1.0)
        for spec in jobs:
            request = estimators.request_bytes(config.estimator, spec.mem_gib, spec.job_id, config.seed, margin)
            self.jobs[spec.job_id] = JobRun(spec, request, estimators.shards_for(request, total), spec.solo_s,
                                            spec.submit_s)
            if live and request is not None and request > live.exclusive_above * self.gpus[0].capacity_bytes:
                self.jobs[spec.job_id].whole = True
            elif live:
                run = self.jobs[spec.job_id]
                if live.compute_sizing:  # the class is known to the simulation (its trace column)
                    run.shards = max(run.shards, compute_shards(spec.util, total))
                run.shards = share_shards(run.shards, total, live.max_jobs_per_gpu)
        self.queue: deque[JobRun] = deque()
        self.recovery: deque[JobRun] = deque()
        self._view: tuple[float, Pressure] | None = None  # --policy live: the queue view and when it was taken
        self._claimed = 0  # GPUs promised to jobs kept whole since that view
        # (time, 0 = a finish / 1 = any other event, tie-break, kind, job id, sequence number): finishes
        # first at equal times, among them by job id; other events in the order they were pushed
        self._events: list[tuple[float, int, str | int, str, str, int]] = []
        self._seq = 0
        self._poll_pending = False
        self._last_change = 0.0
        self.noise = noise_bound(config.seed)  # how far telemetry noise moves a sample
        self._views = [GpuView(self, gpu) for gpu in self.gpus]
        self._stale: set[int] = set()  # GPUs whose view needs a refresh
        self._clocked = False  # the current placement attempt read a clock-dependent field
        self._blocked: tuple[str, bool, int] | None = None  # a failed attempt that would fail again
        self._head_key: tuple[str, bool] | None = None  # the job ``_head`` was computed for
        self._head: set[int] = set()  # GPUs the policy's prefilter keeps for it
        self._head_stale: set[int] = set()  # GPUs changed since
        self._walked = ""  # the last job whose first try walked the ranked GPUs
        # every GPU as (policy key, index), sorted, where the key reads only what the GPU holds
        self._keys: list[tuple] = [self.policy.key(v) for v in self._views] if self.policy.static_key else []
        self._ranked = sorted((k, i) for i, k in enumerate(self._keys)) if self.policy.static_key else None
        # the GPUs that hold no job, by index, for whole-GPU requests, where the policy's choice of them is
        # the base class's (every policy of this engine today; a policy that chooses otherwise is asked)
        self._idle: list[int] | None = ([v.index for v in self._views if v.jobs == 0 and not v.exclusive]
                                        if type(self.policy).choose is Policy.choose else None)

    # --- event plumbing -----------------------------------------------------------------------------
    def _push(self, t: float, kind: str, job_id: str = "") -> int:
        self._seq += 1
        tie: str | int = job_id if kind == "finish" else self._seq
        heapq.heappush(self._events, (t, 0 if kind == "finish" else 1, tie, kind, job_id, self._seq))
        return self._seq

    def _drop(self, kind: str, job_id: str) -> None:
        """Remove pending events of one kind and id (rare: a cancelled measurement window)."""
        kept = [e for e in self._events if not (e[3] == kind and e[4] == job_id)]
        if len(kept) != len(self._events):
            self._events[:] = kept
            heapq.heapify(self._events)

    def run(self) -> Simulation:
        for job in sorted(self.jobs.values(), key=lambda j: (j.spec.submit_s, j.spec.job_id)):
            if job.spec.gpus > self.config.gpus_per_node:
                job.state, job.reason = "failed", f"asks for {job.spec.gpus} GPUs; nodes have {self.config.gpus_per_node}"
                continue
            self._push(job.spec.submit_s, "arrive", job.spec.job_id)
        for gpu in self.gpus:
            self.cluster.record(gpu.index)
        self.cluster.changed.clear()
        while self._events:
            t, _, _, kind, job_id, seq = heapq.heappop(self._events)
            if kind == "finish":
                job = self.jobs[job_id]
                if job.finish_seq != seq:
                    continue  # superseded by a rate change, or the job left the GPU
                self.now = t
                self._finish(job)
                self._last_change = self.now
            else:
                self.now = t
                getattr(self, f"_on_{kind}")(job_id)
                if kind not in self.quiet_events:
                    self._last_change = self.now
            self._schedule()
            self._update_rates()
            self._maybe_poll()
        for job in [*self.recovery, *self.queue]:  # an idle cluster that could not place them never will
            job.state, job.reason = "failed", "does not fit an idle node"
        start = self._energy_start or [0.0] * len(self.gpus)
        self.energy_j = [self.cluster.energy_j(g.index) - start[g.index] for g in self.gpus]
        return self

    # --- remaining work -------------------------------------------------------------------------------
    def remaining(self, job: JobRun) -> float:
        """Solo seconds of work the job has left now."""
        if job.state != "running":
            return job.remaining
        return max(0.0, job.remaining - job.rate * (self.now - job.since))

    def _sync(self, job: JobRun) -> None:
        job.remaining, job.since = self.remaining(job), self.now

    def set_rate(self, job: JobRun, rate: float) -> None:
        """A running job's speed changes: its finish event moves."""
        if rate == job.rate and job.finish_seq:
            return
        self._sync(job)
        job.rate = rate
        self._plan_finish(job)

    def add_work(self, job: JobRun, seconds: float) -> None:
        """Charge a running job extra solo seconds (a context switch, a cap change)."""
        self._sync(job)
        job.remaining += seconds
        self._plan_finish(job)

    def _plan_finish(self, job: JobRun) -> None:
        job.finish_seq = 0
        if job.state == "running" and job.rate > 0:
            job.finish_seq = self._push(self.now + job.remaining / job.rate, "finish", job.spec.job_id)

    def _maybe_poll(self) -> None:
        """Retry a blocked head while telemetry can still change without an event of its own.

        Risk and TTFK windows settle at most one window after the last change (a dispatch, a first
        kernel, a completion); after that only a new event can unblock the head, so polling stops.
        """
        settling = self.now - self._last_change <= self.config.window_s + self.config.poll_s
        if (self.queue or self.recovery) and settling and not self._poll_pending:
            self._poll_pending = True
            self._push(self.now + self.config.poll_s, "poll")

    def _on_poll(self, _: str) -> None:
        self._poll_pending = False

    def _on_arrive(self, job_id: str) -> None:
        if self._energy_start is None:  # CARMA §3.1: energy counters read at the start of the trace
            self._energy_start = [self.cluster.energy_j(g.index) for g in self.gpus]
        job = self.jobs[job_id]
        if self.config.live is not None and not job.whole:
            self._gate(job)
        self.queue.append(job)

    def _gate(self, job: JobRun) -> None:
        """The submit-time choice of the deployed stack (``gpushare.policy.share_gate``): keep a whole GPU
        while idle ones exceed the pending demand, from a view refreshed every ``queue_view_s`` as
        gpushare-submitd's is. A job of several GPUs keeps them whole, as the submit decision does."""
        live = self.config.live
        assert live is not None
        if job.spec.gpus > 1:
            job.whole = True
            return
        if live.share_when == "always":
            return
        if self._view is None or self.now - self._view[0] >= live.queue_view_s:
            idle = sum(1 for g in self.gpus if not g.residents and not g.exclusive)
            pending = sum(j.spec.gpus for j in (*self.recovery, *self.queue))
            self._view, self._claimed = (self.now, Pressure(idle, pending)), 0
        if not gate(live.share_when, self._view[1], self._claimed).share:
            job.whole = True
            self._claimed += 1

    # --- job transitions ----------------------------------------------------------------------------
    def _schedule(self) -> None:
        while self.recovery:
            if not self._attempt(self.recovery[0]):
                return  # CARMA §2.5: the recovery queue pre-empts normal scheduling
            self.recovery.popleft()
        while self.queue and self._attempt(self.queue[0]):
            self.queue.popleft()

    def _attempt(self, job: JobRun) -> bool:
        """``_try_place``, unless the same head failed before without reading the clock and no GPU has
        changed since: the policy would see the same inputs and fail again."""
        key = (job.spec.job_id, job.recovered, self.cluster.changes)
        if key == self._blocked:
            return False
        self._clocked = False
        if self._try_place(job):
            return True
        self._blocked = None if self._clocked else key
        return False

    def _candidates(self, request: JobRequest) -> list[GpuState]:
        """The policy's ``prefilter`` of every GPU for this job, kept between attempts for the same job and
        re-tested only on the GPUs that changed since (``choose`` answers the same on it as on all)."""
        views = self.snapshot()
        key = (request.job_id, request.exclusive)
        if key != self._head_key:
            self._head_key = key
            self._head = {g.index for g in self.policy.prefilter(request, views)}
        else:
            for index in self._head_stale:
                if self.policy.prefilter(request, [views[index]]):
                    self._head.add(index)
                else:
                    self._head.discard(index)
        self._head_stale.clear()
        return [views[index] for index in sorted(self._head)]

    def _choose(self, request: JobRequest) -> list[int] | None:
        """The policy's choice. A job's first try walks the GPUs in the policy's order as far as needed
        (``choose_ranked``); a job that waits keeps its prefiltered GPUs between tries (``_candidates``)."""
        shared = self.policy.collocates and not request.exclusive
        if self._ranked is not None and shared and request.job_id != self._walked:
            self._walked = request.job_id
            views = self.snapshot()
            per_node = self.config.gpus_per_node
            return self.policy.choose_ranked(request, (views[i] for _, i in self._ranked),
                                             lambda node: views[node * per_node:(node + 1) * per_node])
        if self._idle is not None and (request.exclusive or not self.policy.collocates):
            return self._choose_idle(request.gpus)
        return self.policy.choose(request, self._candidates(request))

    def _choose_idle(self, n: int) -> list[int] | None:
        """``Policy.choose`` for whole GPUs — the lowest-index idle GPUs of one node — from the idle GPUs
        the engine keeps sorted (``_idle``), instead of filtering every GPU of the cluster per attempt."""
        self.snapshot()  # brings ``_idle`` up to date
        idle, per_node = self._idle, self.config.gpus_per_node
        assert idle is not None
        at = 0
        while at < len(idle):  # node by node, lowest first: the first with n idle GPUs gives its lowest n
            end = bisect.bisect_left(idle, (idle[at] // per_node + 1) * per_node, at)
            if end - at >= n:
                return idle[at:at + n]
            at = end
        return None

    def _try_place(self, job: JobRun) -> bool:
        request = JobRequest(job.spec.job_id, job.spec.gpus, job.request, job.shards,
                             exclusive=job.recovered or job.whole)
        chosen = self._choose(request)
        if not chosen:
            return False
        exclusive = job.recovered or job.whole or not self.policy.collocates
        util = self.util[job.spec.util]
        for index in chosen:
            gpu = self.gpus[index]
            shards = gpu.shards_total if exclusive else job.shards
            gpu.exclusive = gpu.exclusive or exclusive
            self.cluster.launch(index, job.spec.job_id, int(job.spec.mem_gib * GiB), util, shards)
            self.ttfk.dispatched(index, job.spec.job_id, self.now)
        self._mark_started(job, chosen)
        return True

    def _mark_started(self, job: JobRun, chosen: Sequence[int]) -> None:
        """Bookkeeping of a job placed on ``chosen``: waiting ends, its first kernel is due after its TTFK."""
        job.state, job.gpus, job.dispatched_t = "starting", list(chosen), self.now
        job.wait_s += self.now - job.queued_since
        job.first_start = self.now if job.first_start is None else job.first_start
        self._push(self.now + job.spec.ttfk_s, "kernel", job.spec.job_id)

    def _share(self, job: JobRun) -> int:
        """The job's own memory share: estimate + margin, else its shards; the whole GPU when recovered or whole
        (never more than the GPU: a job bigger than its GPU has only itself to blame)."""
        capacity = min(self.gpus[i].capacity_bytes for i in job.gpus)
        if job.recovered or job.whole:
            return capacity
        return min(capacity, job.request if job.request is not None else job.shards * GiB)

    def _oom(self, job: JobRun, own: bool) -> None:
        job.ooms += 1
        if not own:  # within its share, yet no room: a neighbour took memory beyond its own share
            job.neighbour_ooms += 1
        self._release(job)
        if self.config.recovery and not job.recovered:
            job.state, job.recovered, job.queued_since = "queued", True, self.now
            job.remaining = job.spec.solo_s
            self.recovery.append(job)
        else:
            job.state, job.end, job.reason = "failed", self.now, "out of memory"

    def _on_kernel(self, job_id: str) -> None:
        job = self.jobs[job_id]
        if job.state != "starting":
            return
        peak = int(job.spec.mem_gib * GiB)
        share = self._share(job)
        own = peak > share  # it outgrew its own share
        hold = peak if self.config.caps is None or not own else share  # growth model: its share first
        grow = hold - int(CONTEXT_GIB * GiB)
        if any(self.cluster.used_bytes(i) + grow > self.gpus[i].capacity_bytes for i in job.gpus):
            self._oom(job, own and hold == peak)
            return
        for index in job.gpus:
            self.cluster.first_kernel(index, job_id, hold)
            self.ttfk.kernel_seen(index, job_id, self.now)
        self._start_running(job)
        if hold < peak:
            self._push(self.now + GROW_AFTER * job.spec.solo_s, "grow", job_id)

    def _start_running(self, job: JobRun) -> None:
        """Past its first kernel: its work starts counting down at the rate ``_update_rates`` gives it."""
        job.state, job.rate, job.since, job.finish_seq = "running", 0.0, self.now, 0

    def _on_grow(self, job_id: str) -> None:
        """An offender outgrows its share: its cap stops it, or (no caps) it takes whatever room is free."""
        job = self.jobs[job_id]
        if job.state != "running":
            return
        peak = int(job.spec.mem_gib * GiB)
        extra = peak - self._share(job)
        if self.config.caps or any(self.cluster.used_bytes(i) + extra > self.gpus[i].capacity_bytes
                                   for i in job.gpus):
            self._oom(job, True)
            return
        for index in job.gpus:
            self.cluster.grow(index, job_id, peak)

    def _finish(self, job: JobRun) -> None:
        self._release(job)
        job.state, job.end, job.remaining = "done", self.now, 0.0

    def _release(self, job: JobRun) -> None:
        job.exec_s += self.now - job.dispatched_t
        job.finish_seq = 0
        for index in job.gpus:
            if job.spec.job_id in self.gpus[index].residents:
                self.cluster.end(index, job.spec.job_id)
        self.ttfk.job_ended(job.spec.job_id, job.gpus)

    def _update_rates(self) -> None:
        """New rates for the running jobs on GPUs whose processes changed (the others' are unchanged)."""
        touched: dict[str, JobRun] = {}
        active: dict[int, tuple[list[str], list[int]]] = {}  # per GPU, built once per update
        for index in sorted(self.cluster.changed):
            here = active[index] = self._loading(index)
            ids = here[0]
            if self._active_ids.get(index) == ids:
                continue  # a launch (not yet loading) or memory growth: every speed here is what it was
            self._active_ids[index] = ids
            for job_id in ids:
                job = self.jobs[job_id]
                if job.state == "running":
                    touched[job_id] = job
        self.cluster.changed.clear()
        speed = self.interference.speed_among
        for job_id, job in touched.items():
            me = self._kind(job_id)
            speeds = []
            for index in job.gpus:
                found = active.get(index)
                if found is None:
                    found = active[index] = self._loading(index)
                ids, kinds = found
                speeds.append(speed(me, kinds, ids.index(job_id) if job_id in ids else -1))
            self.set_rate(job, min(speeds))

    def _loading(self, index: int) -> tuple[list[str], list[int]]:
        """The GPU's jobs past their first kernel, in residence order, and their interference kinds."""
        ids = [r.job_id for r in self.gpus[index].residents.values() if r.active]
        kinds, kind = self._kinds, self._kind
        return ids, [kinds[j] if j in kinds else kind(j) for j in ids]

    def _kind(self, job_id: str) -> int:
        """The job's (Gavel proxy, solo SMACT) as the interference model's number for it."""
        found = self._kinds.get(job_id)
        if found is None:
            spec = self.jobs[job_id].spec
            found = self._kinds[job_id] = self.interference.kind(spec.gavel, self.util[spec.util][0])
        return found

    # --- what the policy sees -------------------------------------------------------------------------
    def snapshot(self) -> list[GpuState]:
        """One view per GPU, current as of now (see :class:`GpuView`)."""
        for index in self.cluster.touched:
            view = self._views[index]
            if self._ranked is not None:
                del self._ranked[bisect.bisect_left(self._ranked, (self._keys[index], index))]
            view.refresh()
            if self._ranked is not None:
                self._keys[index] = self.policy.key(view)
                bisect.insort(self._ranked, (self._keys[index], index))
            if self._idle is not None:
                at = bisect.bisect_left(self._idle, index)
                held = at < len(self._idle) and self._idle[at] == index
                if (view.jobs == 0 and not view.exclusive) != held:
                    if held:
                        del self._idle[at]
                    else:
                        self._idle.insert(at, index)
        self._head_stale |= self.cluster.touched
        self.cluster.touched.clear()
        return self._views  # type: ignore[return-value]
