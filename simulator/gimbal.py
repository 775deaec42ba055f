"""Gimbal in the simulator: jobs packed two per GPU, MPS thread caps chosen by ``gpushare.agent.gimbal``.

Why a subclass of the placement engine: placement, TTFK, OOMs, devices and energy stay the engine's; what
changes is each job's speed, which now depends on the thread caps of the jobs sharing its GPU
(``gimbal.thread_share_speeds``: a cap slows the capped job along its speed-vs-thread-share curve and
lowers the over-subscription its co-runner suffers; measured pairwise extra times from Gavel's table
where known, as the engine's ``gavel`` interference mode; with every cap at 100 % it is exactly that
mode, which is the free-competition baseline ``gimbal-free``).

When caps change: at job start/end boundaries on a GPU (a job's first kernel, a completion or an OOM),
as the node agent would do with stock MPS, where a percentage is fixed when a process starts. A running
job whose cap changes loses ``RECONFIG_S`` (Gimbal §7.4: 3.6 s per switch with its CUDA context pool;
without that pool a change means a restart from a checkpoint, so this is a lower bound). Gimbal's
runtime recalibration (measure, adjust, repeat while a job runs) is not modelled; docs/simulator.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpushare.agent import gimbal as gb
from gpushare.simulator.engine import SimConfig, Simulation
from gpushare.simulator.interference import Interference
from gpushare.simulator.trace import JobSpec
from gpushare.simulator.workload import UTIL_CLASSES

RECONFIG_S = 3.6  # Gimbal §7.4: mean overhead of one thread-limit switch


class GimbalSimulation(Simulation):
    """``GimbalSimulation(jobs, config).run()`` with ``config.policy`` one of gimbal-jct|makespan|free."""

    def __init__(self, jobs: list[JobSpec], config: SimConfig, interference: Interference | None = None):
        super().__init__(jobs, config, interference)
        name = getattr(self.policy, "objective", None)
        self.objective: gb.Objective | None = gb.Objective(name) if name else None
        self.caps: dict[int, dict[str, int]] = {g.index: {} for g in self.gpus}  # current plan per GPU
        self.cap_log: list[tuple[float, int, str, int]] = []  # (time, gpu, job, percent) at every decision
        self.reconfigurations = 0
        self._shown: dict[tuple[int, str], float] = {}

    def features(self, job_id: str) -> gb.GimbalJob:
        job = self.jobs[job_id]
        return gb.GimbalJob(job_id, remaining_s=job.remaining, demand=UTIL_CLASSES[job.spec.util][0],
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

    def _update_rates(self) -> None:
        speeds: dict[str, list[float]] = {}
        for gpu in self.gpus:
            running = [r.job_id for r in gpu.residents.values() if r.active and self.jobs[r.job_id].state == "running"]
            jobs = [self.features(j) for j in sorted(running)]
            old = self.caps[gpu.index]
            if set(old) != set(running):
                plan = gb.coordinate(jobs, self.objective, self._speeds) if self.objective else \
                    {j.job_id: gb.MAX_PERCENT for j in jobs}
                for job_id, percent in plan.items():
                    if job_id in old and old[job_id] != percent:
                        self.reconfigurations += 1
                        self.jobs[job_id].remaining += RECONFIG_S
                    self.cap_log.append((self.now, gpu.index, job_id, percent))
                self.caps[gpu.index] = dict(plan)
            for job_id, speed in self._speeds(jobs, self.caps[gpu.index]).items():
                speeds.setdefault(job_id, []).append(speed)
            self._sync_activity(gpu.index)
        for job in self.jobs.values():
            if job.state == "running":
                job.rate = min(speeds.get(job.spec.job_id, [0.0]))

    def _sync_activity(self, index: int) -> None:
        """Backend SMACT of a capped job: its solo SMACT, at most its cap (DCGM sees fewer SMs busy)."""
        for job_id, percent in self.caps[index].items():
            resident = self.gpus[index].residents.get(job_id)
            if resident is None:
                continue
            smact = min(resident.util[0], percent / 100.0)
            if self._shown.get((index, job_id)) != smact:
                self.cluster.backend.update_process(resident.pid, smact=smact)
                self._shown[(index, job_id)] = smact
                self.cluster.record(index)
