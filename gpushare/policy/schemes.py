"""Queue schedulers over MIG GPUs: MIGM §4.3 Scheme A (by size) and Scheme B (in arrival order).

Both take a batch queue of jobs — (job id, memory need, arrival) plus a simulated duration — and a number
of identical GPUs that start unpartitioned, map each job to its tightest profile
(:func:`~gpushare.policy.profiles.tightest_profile`), and simulate the run on a virtual clock (no clock reads),
asking :func:`~gpushare.policy.planner.plan` for every layout change.

- **Scheme A** sorts the queue by profile size and runs it in phases, one profile per phase: at the start
  of a phase each GPU the phase needs is reconfigured once (one planner call for as many instances as the
  phase can use), and the phase's jobs cycle through those instances until all have finished; then the
  next larger profile. Few reconfigurations; GPUs may idle while a phase drains.
- **Scheme B** takes jobs strictly in arrival order (head-of-line blocking, for fairness): reuse an idle
  instance of the job's profile, else one planner call for that job (create, fusion or fission) on the
  GPU where it costs the fewest actions; if no GPU can serve it, wait for a job to finish.

A *reconfiguration* is one planner call that changes a GPU's layout (one drain/apply/resume cycle on a
Slurm node); creates and destroys are counted separately too. On one GPU that starts empty, Scheme A never
needs more reconfigurations than Scheme B: A makes at most one per distinct profile, and B must create
each distinct profile at least once, one call per job. With several GPUs this is an empirical property of
realistic mixes, not a theorem (A may reconfigure a second GPU for a phase that B would have run serially).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from gpushare.gpus import GpuModel

from gpushare.policy.fsm import Placement
from gpushare.policy.layout import Instance
from gpushare.policy.planner import Plan, plan
from gpushare.policy.profiles import tightest_profile


@dataclass(frozen=True)
class Job:
    job_id: str
    memory_bytes: int  # the job's memory need; the margin is applied by the scheme's sizing
    arrival: float = 0.0  # queue order (Scheme B's order, and the tie-break within a size for A)
    duration: float = 1.0  # simulated run time, in the same unit as the result's times


@dataclass(frozen=True)
class Start:
    job_id: str
    gpu: int
    profile: str
    start: int  # memory slice of the instance
    time: float


@dataclass(frozen=True)
class SchemeResult:
    scheme: str  # "A" or "B"
    starts: tuple[Start, ...]
    reconfigurations: int  # planner calls that changed some GPU's layout
    creates: int
    destroys: int
    planner_calls: int
    makespan: float
    unschedulable: tuple[str, ...]  # job ids no profile can hold


class _Sim:
    """Mutable simulation state, private to one scheme run."""

    def __init__(self, model: GpuModel, gpus: int) -> None:
        self.model = model
        self.layouts: list[dict[Placement, bool]] = [{} for _ in range(gpus)]  # placement -> busy
        self.running: list[tuple[float, int, int, Placement]] = []  # (end, seq, gpu, placement)
        self.now = 0.0
        self.seq = 0
        self.starts: list[Start] = []
        self.reconfigurations = self.creates = self.destroys = self.calls = 0

    def instances(self, gpu: int) -> tuple[Instance, ...]:
        return tuple(Instance(p[0], p[1], busy) for p, busy in self.layouts[gpu].items())

    def plan(self, gpu: int, wants: Sequence[str]) -> Plan:
        self.calls += 1
        return plan(self.model, self.instances(gpu), wants, in_order=True)

    def apply(self, gpu: int, result: Plan) -> None:
        """Take the plan's final layout; assigned instances stay idle until a job is started in them."""
        if result.actions:
            self.reconfigurations += 1
            self.creates += sum(a.kind == "create" for a in result.actions)
            self.destroys += sum(a.kind == "destroy" for a in result.actions)
        before = self.layouts[gpu]
        self.layouts[gpu] = {i.placement: before.get(i.placement, False) for i in result.final}

    def idle(self, profile: str) -> tuple[int, Placement] | None:
        for gpu, layout in enumerate(self.layouts):
            free = sorted((p for p, busy in layout.items() if p[0] == profile and not busy),
                          key=lambda p: -p[1])
            if free:
                return gpu, free[0]
        return None

    def run(self, job: Job, gpu: int, placement: Placement) -> None:
        self.layouts[gpu][placement] = True
        self.seq += 1
        heapq.heappush(self.running, (self.now + job.duration, self.seq, gpu, placement))
        self.starts.append(Start(job.job_id, gpu, placement[0], placement[1], self.now))

    def advance(self) -> None:
        """Move the clock to the next completion and free every instance finishing then."""
        end = self.running[0][0]
        while self.running and self.running[0][0] == end:
            _, _, gpu, placement = heapq.heappop(self.running)
            self.layouts[gpu][placement] = False
        self.now = end

    def result(self, scheme: str, unschedulable: tuple[str, ...]) -> SchemeResult:
        return SchemeResult(scheme, tuple(self.starts), self.reconfigurations, self.creates,
                            self.destroys, self.calls, self.now, unschedulable)


def _sized(model: GpuModel, jobs: Sequence[Job], margin_fraction: float, margin_min_bytes: int
           ) -> tuple[list[tuple[Job, str]], tuple[str, ...]]:
    sized, too_big = [], []
    for job in sorted(jobs, key=lambda j: (j.arrival, j.job_id)):
        profile = tightest_profile(model, job.memory_bytes, margin_fraction=margin_fraction,
                                   margin_min_bytes=margin_min_bytes)
        if profile is None:
            too_big.append(job.job_id)
        else:
            sized.append((job, profile.name))
    return sized, tuple(too_big)


def scheme_a(model: GpuModel, jobs: Sequence[Job], gpus: int = 1, *,
             margin_fraction: float = 0.0, margin_min_bytes: int = 0) -> SchemeResult:
    """MIGM Scheme A: phases by increasing profile size, one reconfiguration per GPU per phase."""
    sized, too_big = _sized(model, jobs, margin_fraction, margin_min_bytes)
    sim = _Sim(model, gpus)
    order = {p.name: (p.usable_bytes, p.compute_slices, p.memory_slices) for p in model.mig_profiles}
    for profile in sorted({name for _, name in sized}, key=order.__getitem__):
        queue = deque(job for job, name in sized if name == profile)
        remaining = len(queue)
        for gpu in range(gpus):
            if remaining <= 0:
                break
            want = min(remaining, model.mig_profile(profile).max_count)
            result = sim.plan(gpu, [profile] * want)
            sim.apply(gpu, result)
            remaining -= want - len(result.unmet)
        while queue or sim.running:
            while queue and (slot := sim.idle(profile)) is not None:
                sim.run(queue.popleft(), *slot)
            if sim.running:
                sim.advance()
    return sim.result("A", too_big)


def scheme_b(model: GpuModel, jobs: Sequence[Job], gpus: int = 1, *,
             margin_fraction: float = 0.0, margin_min_bytes: int = 0) -> SchemeResult:
    """MIGM Scheme B: strict arrival order; reuse, else create/fuse/split for this job, else wait."""
    sized, too_big = _sized(model, jobs, margin_fraction, margin_min_bytes)
    sim = _Sim(model, gpus)
    queue = deque(sized)
    while queue or sim.running:
        while queue:
            job, profile = queue[0]
            slot = sim.idle(profile)
            if slot is None:
                options = []
                for gpu in range(gpus):
                    result = sim.plan(gpu, [profile])
                    if result.assignments[0] is not None:
                        cost = (len(result.actions), -result.reach_after, gpu)
                        options.append((cost, gpu, result))
                if not options:
                    break  # head-of-line blocking: wait for a completion
                _, gpu, result = min(options, key=lambda o: o[0])
                sim.apply(gpu, result)
                placement = result.assignments[0]
                assert placement is not None  # options holds only plans that place the job
                slot = (gpu, placement)
            queue.popleft()
            sim.run(job, *slot)
        if sim.running:
            sim.advance()
        elif queue:  # cannot happen: an all-idle GPU can always be reshaped
            raise RuntimeError(f"scheme B stuck on job {queue[0][0].job_id}")
    return sim.result("B", too_big)
