"""Salus in the simulator: lane admission, lanes side by side, iteration-granularity turns within a lane.

Why a subclass of the placement engine: arrivals, TTFK, the simulated devices, energy and the report stay
the engine's; what changes is admission (``gpushare.policy.lane_policy``: a job is placed only where the
safety condition holds, so no OOM can happen), queueing (Salus' PROCESSREQUESTS tries every queued job,
no head-of-line blocking; SRTF tries the shortest first) and speeds:

* Lanes run side by side. A running job's speed next to the other lanes is the engine's interference
  model, each other-lane job weighted by its time share of its lane (one job per lane: exactly the
  engine's collocation model), and never above the GPU's compute: ``overhead / Σ shares·SMACT`` over the
  lanes (many small lanes saturate the SMs — Salus §5.2's resnet50 sweep, where "computation likely
  becomes the bottleneck").
* Jobs in one lane take turns per iteration: the lane's speed is split by ``lane_policy.time_shares``.
* Costs (docs/simulator.md): every job pays ``EXECUTION_OVERHEAD`` (Salus Fig. 14: under 10 % per
  iteration for most CNNs; 5 % taken); a turn switch costs ``SWITCH_S`` — under FAIR every iteration of
  a shared lane is a switch, so the lane runs at ``ITERATION_S / (ITERATION_S + SWITCH_S)``; under PACK
  and SRTF a switch happens only when a job pre-empts another running one, and the new holder loses
  ``SWITCH_S``.
"""

from __future__ import annotations

from gpushare.policy import lane_policy as lp
from gpushare.simulator.engine import JobRun, SimConfig, Simulation
from gpushare.simulator.interference import OVERHEAD, Interference
from gpushare.simulator.memory_split import Splitter, split
from gpushare.simulator.policies import JobRequest
from gpushare.simulator.trace import JobSpec

EXECUTION_OVERHEAD = 0.95  # Salus Fig. 14: per-iteration time within 10 % of TensorFlow for most CNNs
ITERATION_S = 0.5  # Salus §3.2.2: iterations take "tens of milliseconds to a few seconds"
SWITCH_S = 0.01  # Salus Fig. 9b/11: the next job's iteration starts "immediately"; aggregate throughput flat


class SalusSimulation(Simulation):
    """``SalusSimulation(jobs, config).run()`` with ``config.policy`` one of salus-pack|srtf|fair."""

    def __init__(self, jobs: list[JobSpec], config: SimConfig, interference: Interference | None = None,
                 splitter: Splitter = split, reuse_first: bool = False):
        super().__init__(jobs, config, interference)
        self.lane_policy = lp.LanePolicy(getattr(self.policy, "lane_policy", "pack"))
        self.reuse_first = reuse_first
        self.memory = {spec.job_id: splitter(spec) for spec in jobs}
        self.lanes = {g.index: lp.GpuLanes(g.capacity_bytes) for g in self.gpus}
        self.admitted_seq: dict[str, int] = {}
        self.holders: dict[tuple[int, int], str] = {}  # (gpu, lane) -> job holding the turn
        self.switches = 0
        self._held: dict[tuple[int, str], int] = {}  # memory last sent to the backend
        self._shown: dict[tuple[int, str], tuple[float, float, float]] = {}  # utilisation last sent to the backend
        self.max_admitted_fraction = 0.0  # highest Σ P + Σ L over capacity seen on any GPU (≤ 1 by design)

    def lane_job(self, job: JobRun) -> lp.LaneJob:
        persistent, ephemeral = self.memory[job.spec.job_id]
        return lp.LaneJob(job.spec.job_id, persistent, ephemeral)

    # --- admission --------------------------------------------------------------------------------------
    def _schedule(self) -> None:
        waiting = list(self.queue)
        if self.lane_policy is lp.LanePolicy.SRTF:
            waiting.sort(key=lambda j: (self.remaining(j), j.spec.submit_s))
        for job in waiting:
            if self._try_place(job):
                self.queue.remove(job)

    def _try_place(self, job: JobRun) -> bool:
        entry = self.lane_job(job)
        admissible = [s for s in self.snapshot() if lp.find_lane(self.lanes[s.index], entry, self.reuse_first)]
        request = JobRequest(job.spec.job_id, job.spec.gpus, job.request, job.shards)
        chosen = self.policy.choose(request, admissible) if admissible else None
        if not chosen:
            return False
        self.admitted_seq[job.spec.job_id] = len(self.admitted_seq)
        util = self.util[job.spec.util]
        for index in chosen:
            after = lp.admit(self.lanes[index], entry, self.reuse_first)
            assert after is not None, "find_lane said it fits"
            self.lanes[index] = after
            self.cluster.launch(index, job.spec.job_id, entry.persistent_bytes + entry.ephemeral_bytes, util, 0)
            self.ttfk.dispatched(index, job.spec.job_id, self.now)
            self._sync_memory(index)
        self._mark_started(job, chosen)
        return True

    def _sync_memory(self, index: int) -> None:
        """Backend memory = the lane layout: each job its persistent bytes, a lane's first job its lane."""
        layout = self.lanes[index]
        self.max_admitted_fraction = max(self.max_admitted_fraction, layout.admitted_bytes / layout.capacity_bytes)
        for lane in layout.lanes:
            for k, job_id in enumerate(lane.job_ids):
                held = layout.jobs[job_id].persistent_bytes + (lane.size_bytes if k == 0 else 0)
                if self._held.get((index, job_id)) != held:
                    self.cluster.grow(index, job_id, held)
                    self._held[(index, job_id)] = held

    # --- transitions ------------------------------------------------------------------------------------
    def _on_kernel(self, job_id: str) -> None:
        job = self.jobs[job_id]
        if job.state != "starting":
            return
        for index in job.gpus:
            self.cluster.first_kernel(index, job_id, self._held.get((index, job_id)))
            self.ttfk.kernel_seen(index, job_id, self.now)
        self._start_running(job)

    def _release(self, job: JobRun) -> None:
        super()._release(job)
        for index in job.gpus:
            if job.spec.job_id in self.lanes[index].jobs:
                self.lanes[index] = lp.release(self.lanes[index], job.spec.job_id)
                self._sync_memory(index)

    # --- speeds -----------------------------------------------------------------------------------------
    def _shares(self, index: int) -> dict[int, dict[str, float]]:
        """Per lane of a GPU, the time share of each running member."""
        out = {}
        for lane in self.lanes[index].lanes:
            members = [lp.TurnState(j, self.admitted_seq[j], self.remaining(self.jobs[j]))
                       for j in lane.job_ids if self.jobs[j].state == "running"]
            out[lane.lane_id] = lp.time_shares(self.lane_policy, members)
        return out

    def _update_rates(self) -> None:
        speeds: dict[str, list[float]] = {}
        for gpu in self.gpus:
            shares = self._shares(gpu.index)
            for lane_id, lane_shares in shares.items():
                self._note_holder(gpu.index, lane_id, lane_shares)
                switch = ITERATION_S / (ITERATION_S + SWITCH_S) if (
                    self.lane_policy is lp.LanePolicy.FAIR and len(lane_shares) > 1) else 1.0
                others = [(job_id, share) for other, members in shares.items() if other != lane_id
                          for job_id, share in members.items() if share > 0]
                for job_id, share in lane_shares.items():
                    speed = self._lane_speed(job_id, others) * EXECUTION_OVERHEAD * switch
                    speeds.setdefault(job_id, []).append(share * speed)
            self._sync_activity(gpu.index, shares)
        for job in self.jobs.values():
            if job.state == "running":
                self.set_rate(job, min(speeds.get(job.spec.job_id, [0.0])))
        self.cluster.changed.clear()

    def _lane_speed(self, job_id: str, others: list[tuple[str, float]]) -> float:
        """Speed of a lane's turn holder next to the other lanes (each weighted by its time share)."""
        if not others:
            return 1.0
        spec = self.jobs[job_id].spec
        smact = self.util[spec.util][0]
        load = smact + sum(share * self.util[self.jobs[o].spec.util][0] for o, share in others)
        compute = OVERHEAD * min(1.0, 1.0 / load)
        if self.interference.mode == "share":
            return compute
        extra = sum(share * self.interference.extra(spec.gavel, smact, self.jobs[o].spec.gavel,
                                                    self.util[self.jobs[o].spec.util][0]) for o, share in others)
        return min(compute, OVERHEAD / (1.0 + extra))

    def _note_holder(self, index: int, lane_id: int, lane_shares: dict[str, float]) -> None:
        """PACK/SRTF: a new turn holder in a lane that had another one pays one switch."""
        if self.lane_policy is lp.LanePolicy.FAIR or not lane_shares:
            return
        holder = max(lane_shares, key=lambda j: lane_shares[j])
        previous = self.holders.get((index, lane_id))
        if previous is not None and previous != holder and self.jobs[previous].state == "running":
            self.switches += 1
            self.add_work(self.jobs[holder], SWITCH_S)  # one lost switch, in solo seconds
        self.holders[(index, lane_id)] = holder

    def _sync_activity(self, index: int, shares: dict[int, dict[str, float]]) -> None:
        """Backend utilisation follows the turns: a job's solo SMACT/SMOCC/DRAMA times its time share."""
        for lane_shares in shares.values():
            for job_id, share in lane_shares.items():
                resident = self.gpus[index].residents.get(job_id)
                if resident is None:
                    continue
                smact, smocc, drama = (round(v * share, 4) for v in resident.util)
                if self._shown.get((index, job_id)) != (smact, smocc, drama):
                    self.cluster.show(index, job_id, smact=smact, smocc=smocc, drama=drama)
                    self._shown[(index, job_id)] = (smact, smocc, drama)
