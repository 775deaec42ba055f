"""Gimbal in the simulator: jobs packed two per GPU, MPS thread caps chosen by ``gpushare.policy.gimbal``.

Why a subclass of the placement engine: placement, TTFK, OOMs, devices and energy stay the engine's; what
changes is each job's speed, which now depends on the thread caps of the jobs sharing its GPU
(``gimbal.thread_share_speeds``: a cap slows the capped job along its speed-vs-thread-share curve and
lowers the over-subscription its co-runner suffers; measured pairwise extra times from Gavel's table
where known, as the engine's ``gavel`` interference mode; with every cap at 100 % it is exactly that
mode, which is the free-competition baseline ``gimbal-free``).

Two ways to set the caps, both with the policy math of ``gpushare.policy.gimbal`` and nothing of their own:

* ``gimbal-jct`` / ``gimbal-makespan``: what the node agent does with stock MPS, where a percentage is
  fixed when a process starts. At a job's first kernel ``gimbal.starting_share`` picks its share with the
  running co-runners' shares fixed (the function ``gpushare.node.jobs.thread_percentage_for`` calls);
  a running job's cap never changes, even when its co-runner leaves, and nothing is charged.
* ``gimbal-jct-runtime`` / ``gimbal-makespan-runtime``: Gimbal's runtime recalibration, which needs its
  rewritten CUDA context pool inside PyTorch and so exists only here. At every start/end boundary on a
  GPU, and again ``RECALIBRATE_S`` after each search ends, Algorithm 1 runs on all the GPU's jobs one
  trial plan per ``WINDOW_S`` measurement window (``gimbal.Search``); each change of a running job's cap
  costs it ``RECONFIG_S`` of work (Gimbal §7.4). Assumptions: docs/simulator.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpushare.policy import gimbal as gb
from gpushare.simulator.engine import SimConfig, Simulation
from gpushare.simulator.interference import Interference
from gpushare.simulator.trace import JobSpec

RECONFIG_S = 3.6  # Gimbal §7.4: mean overhead of one thread-limit switch with its CUDA context pool
WINDOW_S = 60.0  # Gimbal §5.2: runtime information for one search step is collected for at most 60 s
RECALIBRATE_S = 600.0  # runtime: a converged GPU searches again this long after its last search (assumption)


class GimbalSimulation(Simulation):
    """``GimbalSimulation(jobs, config).run()`` with ``config.policy`` a ``GimbalPacking`` policy."""

    quiet_events = frozenset({"poll", "window"})

    def __init__(self, jobs: list[JobSpec], config: SimConfig, interference: Interference | None = None):
        super().__init__(jobs, config, interference)
        name = getattr(self.policy, "objective", None)
        self.objective: gb.Objective | None = gb.Objective(name) if name else None
        self.runtime: bool = bool(getattr(self.policy, "runtime", False))
        self.caps: dict[int, dict[str, int]] = {g.index: {} for g in self.gpus}  # current plan per GPU
        self.cap_log: list[tuple[float, int, str, int]] = []  # (time, gpu, job, percent) at every decision
        self.switch_log: list[tuple[float, str, int, int]] = []  # (time, job, old, new): charged changes
        self.reconfigurations = 0
        self.decisions: list[tuple[float, gb.GimbalJob, list[tuple[gb.GimbalJob, int]], int]] = []  # live
        self._live_share: dict[str, int] = {}  # live: each running job's share, fixed at its start
        self._members: dict[int, frozenset[str]] = {}  # runtime: the job set each GPU's plan was made for
        self._search: dict[int, tuple[gb.Search, list[gb.GimbalJob]]] = {}  # runtime: search, jobs at its start
        self._due: dict[int, float] = {}  # runtime: when the GPU's next window ends or next search starts
        self._charged_at: dict[str, float] = {}  # runtime: when each job last paid a switch
        self._shown: dict[tuple[int, str], float] = {}

    def features(self, job_id: str) -> gb.GimbalJob:
        """What Gimbal knows of a job here: true remaining work and its utilisation class's solo SMACT."""
        job = self.jobs[job_id]
        return gb.GimbalJob(job_id, remaining_s=self.remaining(job), demand=self.util[job.spec.util][0],
                            world_size=job.spec.gpus)

    def pair_extra(self, a: gb.GimbalJob, b: gb.GimbalJob) -> float:
        """x(a, b): Gavel's measured extra time of a next to b at full contention, 1 when unmeasured."""
        factor = self.interference.measured_factor(self.jobs[a.job_id].spec.gavel, self.jobs[b.job_id].spec.gavel)
        if factor is None:
            self.interference.fallback_pairs.add((self.jobs[a.job_id].spec.gavel or "custom",
                                                  self.jobs[b.job_id].spec.gavel or "custom"))
            return 1.0
        return 1.0 / max(factor, 1e-6) - 1.0

    def _speeds(self, jobs: Sequence[gb.GimbalJob], plan: gb.Plan) -> dict[str, float]:
        return gb.thread_share_speeds(jobs, plan, self.pair_extra)

    def _running(self, index: int) -> list[str]:
        return sorted(r.job_id for r in self.gpus[index].residents.values()
                      if r.active and self.jobs[r.job_id].state == "running")

    def _on_window(self, _: str) -> None:
        """A measurement window ended somewhere (runtime); ``_update_rates`` advances the searches."""

    def _update_rates(self) -> None:
        running = {gpu.index: self._running(gpu.index) for gpu in self.gpus}
        if self.objective is None:
            for index, jobs in running.items():
                if set(self.caps[index]) != set(jobs):
                    self._apply(index, {j: gb.MAX_PERCENT for j in jobs})
        elif not self.runtime:
            self._live(running)
        else:
            for index, jobs in running.items():
                self._recalibrate(index, jobs)
        speeds: dict[str, list[float]] = {}
        for gpu in self.gpus:
            features = [self.features(j) for j in running[gpu.index]]
            for job_id, speed in self._speeds(features, self.caps[gpu.index]).items():
                speeds.setdefault(job_id, []).append(speed)
            self._sync_activity(gpu.index)
        for job in self.jobs.values():
            if job.state == "running":
                self.set_rate(job, min(speeds.get(job.spec.job_id, [0.0])))
        self.cluster.changed.clear()

    # --- live: the starting job's share only ----------------------------------------------------------
    def _live(self, running: dict[int, list[str]]) -> None:
        """Shares as the node agent sets them: a job that just started gets ``starting_share`` against the
        running jobs on any of its GPUs (the agent's ``mps_corunners``), which keep theirs; jobs starting
        at the same instant are taken in job-id order, each seeing the ones before it."""
        now_running = {j for jobs in running.values() for j in jobs}
        self._live_share = {j: p for j, p in self._live_share.items() if j in now_running}
        for job_id in sorted(now_running - set(self._live_share)):
            corunners = sorted({o for i in self.jobs[job_id].gpus for o in running[i]
                                if o != job_id and o in self._live_share})
            others = [(self.features(o), self._live_share[o]) for o in corunners]
            starting = self.features(job_id)
            share = gb.starting_share(starting, others, self.objective or gb.Objective.JCT, self._speeds)
            self._live_share[job_id] = share
            self.decisions.append((self.now, starting, others, share))
            for index in self.jobs[job_id].gpus:
                self.cap_log.append((self.now, index, job_id, share))
        for index, jobs in running.items():
            self.caps[index] = {j: self._live_share[j] for j in jobs}

    # --- runtime: Algorithm 1 one window at a time, on every job --------------------------------------
    def _recalibrate(self, index: int, jobs: list[str]) -> None:
        """Start a search at a boundary or when a converged GPU is due again; advance one at a window end."""
        members = frozenset(jobs)
        if members != self._members.get(index):
            self._members[index] = members
            self._begin(index, jobs, resume=False)
            return
        if index not in self._search or self.now < self._due[index] - 1e-9:
            return
        search, snapshot = self._search[index]
        if search.done:
            self._begin(index, jobs, resume=True)
            return
        # the window's measurement: the model's speeds under the trial plan, remaining work as at the
        # search's start so that successive steps compare like with like
        value = gb.objective_value(snapshot, self._speeds(snapshot, search.plan), self.objective or gb.Objective.JCT)
        search = search.measured(value)
        self._search[index] = (search, snapshot)
        self._apply(index, search.plan)
        self._wake(index, RECALIBRATE_S if search.done else WINDOW_S)

    def _begin(self, index: int, jobs: list[str], resume: bool) -> None:
        """Lines 1–5 of Algorithm 1 on the GPU's jobs from their current caps (new jobs at 100 %). A
        periodic search (``resume``) first swells the squeezed side one step, then squeezes while the
        objective improves: the runtime search can move a cap either way."""
        features = [self.features(j) for j in jobs]
        current = {j: self.caps[index].get(j, gb.MAX_PERCENT) for j in jobs}
        if len(features) < 2:
            self._search.pop(index, None)
            self._cancel(index)
            self._apply(index, {j: gb.MAX_PERCENT for j in jobs})
            return
        objective = self.objective or gb.Objective.JCT
        search = gb.start_search(features, objective, self._speeds(features, current), current)
        if resume and search.squeezed:
            level = min(gb.MAX_PERCENT, search.level + gb.STEP)
            search = gb.Search(search.base, search.squeezed, level, level)
        self._search[index] = (search, features)
        self._apply(index, search.plan)
        self._wake(index, WINDOW_S)

    def _wake(self, index: int, after: float) -> None:
        self._cancel(index)
        self._due[index] = self.now + after
        self._push(self._due[index], "window", str(index))

    def _cancel(self, index: int) -> None:
        """Drop the GPU's pending window: a stale one would move the clock past the last completion and
        add idle energy to the run."""
        self._drop("window", str(index))

    def _apply(self, index: int, plan: gb.Plan) -> None:
        """Set a GPU's caps; a running job whose cap changes pays ``RECONFIG_S`` of work once per instant
        (its workers on several GPUs switch contexts in parallel, Gimbal §7.4)."""
        old = self.caps[index]
        for job_id, percent in plan.items():
            if job_id in old and old[job_id] != percent:
                if self._charged_at.get(job_id) != self.now:
                    self._charged_at[job_id] = self.now
                    self.reconfigurations += 1
                    self.add_work(self.jobs[job_id], RECONFIG_S)
                    self.switch_log.append((self.now, job_id, old[job_id], percent))
            if old.get(job_id) != percent:
                self.cap_log.append((self.now, index, job_id, percent))
        self.caps[index] = dict(plan)

    def _sync_activity(self, index: int) -> None:
        """Backend SMACT of a capped job: its solo SMACT, at most its cap (DCGM sees fewer SMs busy)."""
        for job_id, percent in self.caps[index].items():
            resident = self.gpus[index].residents.get(job_id)
            if resident is None:
                continue
            smact = min(resident.util[0], percent / 100.0)
            if self._shown.get((index, job_id)) != smact:
                self.cluster.show(index, job_id, smact=smact)
                self._shown[(index, job_id)] = smact
