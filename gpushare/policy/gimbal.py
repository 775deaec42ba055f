"""Gimbal's coordination policy for jobs packed on one GPU: an MPS active-thread percentage per job.

Why a pure module: the node agent calls ``starting_share`` when a job on a shared GPU starts or restarts
(MPS fixes a process's ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` at its start), and the simulator calls the
same function at the same boundaries, so both take the same decisions from the same inputs.

Source: "Taming Flexible Job Packing in Deep Learning Training Clusters" (Gimbal), §4.1 (low-level GPU
resource restriction through MPS, 10 % steps, sums above 100 % allowed: 200 % is free competition) and
§5.2 (local objectives, job priorities, Algorithm 1). What is kept and what is not:

* Objectives: JCT, ``mean_j remaining_j / throughput_j`` (Eq. 1), with priority ``−utilisation_j``
  (Eq. 2: squeezing a busy job costs it less than it gives its co-runner); makespan,
  ``max_j remaining_j / throughput_j`` (Eq. 5), where the text says "shorter jobs are squeezed to speed up
  the completion of longer jobs" — so the longer job gets the higher priority here (Eq. 6 prints the
  priority with a minus sign, which would squeeze the longer job instead; the text's intent is followed).
* Algorithm 1 on one GPU: J_max (largest world size) against the rest; the higher-priority side is
  swelled (100 %), the other squeezed 10 points at a time while the objective improves; the search
  stops after three consecutive steps without gain, and the best plan seen is kept. Gimbal measures each
  step on the running jobs (up to 60 s or 5 steps); here a step is evaluated with a speed model
  (``SpeedModel``), the live agent can pass one backed by its measurements instead.
* Live (``starting_share``): with stock MPS a process's percentage is fixed when it starts, so the
  agent moves only the starting job's share, the running jobs' shares being fixed inputs. Runtime
  recalibration of running jobs (``Search`` one measurement window at a time) needs Gimbal's rewritten
  CUDA context pool inside PyTorch; only the simulator models it (``gimbal-*-runtime``).
* Not kept: input-sample stealing between workers of one distributed job (LISS) — per-GPU decisions
  have no straggler to rebalance.

Default speed model (``thread_share_speeds``; an assumption shaped like Gimbal Fig. 2a, stated in
docs/simulator.md): job i with solo SM demand ``d_i`` under a cap ``c_i`` uses ``e_i = min(d_i, c_i)``;
its own speed is ``curve_i(c_i) = min(1, c_i/d_i)^β`` (β = 0.5: a slight squeeze of a busy job costs
little, Gimbal §5.2); co-runners slow it by ``Σ_j x_ij · clip(e_i + e_j − 1, 0, 1)``, with ``x_ij`` the
extra time per unit of work at full contention (measured pairs where known, 1 otherwise)::

    speed_i = overhead · curve_i(c_i) / (1 + Σ_j x_ij · clip(e_i + e_j − 1, 0, 1))

With every cap at 100 % this is the simulator's free-competition collocation model.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

STEP = 10  # percentage points per squeeze (Gimbal §4.1 / §7.4)
MIN_PERCENT = 10
MAX_PERCENT = 100
PATIENCE = 3  # consecutive steps without gain before the search stops (Algorithm 1, line 9)
CURVE_EXPONENT = 0.5  # β of the default speed-vs-thread-share curve (assumption)
OVERHEAD = 0.95  # paid by any co-running job; the simulator's collocation overhead


class Objective(str, Enum):
    JCT = "jct"
    MAKESPAN = "makespan"


@dataclass(frozen=True)
class GimbalJob:
    """Per-job features the node can know.

    ``remaining_s``: estimated solo seconds of work left (steps left × solo step time). ``demand``: solo SM
    utilisation (0..1; DCGM SMACT of the job alone). ``world_size``: GPUs of the job. ``curve``: its solo
    speed at 10, 20, …, 100 % of the threads (10 values, relative to uncapped), measured or None to use
    the default curve from ``demand``. ``sensitivity``: extra time per unit of work at full contention
    (x in the model above) when no pairwise value is supplied.
    """

    job_id: str
    remaining_s: float
    demand: float
    world_size: int = 1
    curve: tuple[float, ...] | None = None
    sensitivity: float = 1.0

    def own_speed(self, percent: int) -> float:
        """Speed alone under a cap of ``percent`` (relative to uncapped)."""
        if self.curve is not None:
            if len(self.curve) != MAX_PERCENT // STEP:
                raise ValueError(f"{self.job_id}: curve needs {MAX_PERCENT // STEP} values (10 %..100 %)")
            return self.curve[percent // STEP - 1]
        return min(1.0, (percent / 100.0) / max(self.demand, 1e-6)) ** CURVE_EXPONENT


Plan = Mapping[str, int]
PairExtra = Callable[[GimbalJob, GimbalJob], float]
SpeedModel = Callable[[Sequence[GimbalJob], Plan], Mapping[str, float]]


def thread_share_speeds(jobs: Sequence[GimbalJob], plan: Plan, pair_extra: PairExtra | None = None,
                        overhead: float = OVERHEAD) -> dict[str, float]:
    """Each job's speed (relative to running alone, uncapped) under ``plan`` with the model above."""
    used = {j.job_id: min(j.demand, plan[j.job_id] / 100.0) for j in jobs}
    speeds = {}
    for job in jobs:
        others = [o for o in jobs if o.job_id != job.job_id]
        if not others:
            speeds[job.job_id] = job.own_speed(plan[job.job_id])
            continue
        extra = sum((pair_extra(job, o) if pair_extra else job.sensitivity)
                    * min(1.0, max(0.0, used[job.job_id] + used[o.job_id] - 1.0)) for o in others)
        speeds[job.job_id] = overhead * job.own_speed(plan[job.job_id]) / (1.0 + extra)
    return speeds


def objective_value(jobs: Sequence[GimbalJob], speeds: Mapping[str, float], objective: Objective | str) -> float:
    """Gimbal's local objective (Eq. 1 or Eq. 5) for the given speeds; lower is better (``"jct"`` is
    taken as ``Objective.JCT``: a plain string must not silently mean makespan)."""
    times = [j.remaining_s / max(speeds[j.job_id], 1e-9) for j in jobs]
    if not times:
        return 0.0
    return sum(times) / len(times) if Objective(objective) is Objective.JCT else max(times)


def priority(job: GimbalJob, speed: float, objective: Objective) -> float:
    """Higher runs swelled. JCT: −utilisation (Eq. 2). Makespan: the expected duration (see module doc)."""
    if objective is Objective.JCT:
        return -job.demand
    return job.remaining_s / max(speed, 1e-9)


@dataclass(frozen=True)
class Search:
    """Algorithm 1's iterative form on one GPU: one trial plan at a time, judged by its measured objective.

    Why a state machine: Gimbal applies a plan, measures the objective on the running jobs (up to 60 s or
    5 steps), then squeezes the low-priority side 10 points further or stops after ``PATIENCE`` steps
    without gain and keeps the best plan. ``coordinate`` runs the whole search at once with a speed model
    standing in for the measurements; the simulator's runtime recalibration runs it one measurement
    window at a time. Both walk the same states, so a plan is the same whichever way it is reached.

    ``plan`` is the plan to apply (and measure) now; ``measured(value)`` returns the next state.
    """

    base: Mapping[str, int]  # every job's percentage except the squeezed ones
    squeezed: tuple[str, ...]  # the low-priority side, minus jobs whose share is fixed
    level: int  # the squeezed jobs' percentage in the plan being measured
    best_level: int
    best_value: float = float("inf")
    failures: int = 0
    done: bool = False

    @property
    def plan(self) -> dict[str, int]:
        return {**self.base, **{job_id: self.level for job_id in self.squeezed}}

    def measured(self, value: float) -> Search:
        """The state after measuring ``plan``'s objective ``value`` (lower is better)."""
        best_level, best_value, failures = self.best_level, self.best_value, self.failures
        if value < best_value - 1e-9:
            best_level, best_value, failures = self.level, value, 0
        else:
            failures += 1
        following = self.level - STEP
        if failures >= PATIENCE or following < MIN_PERCENT or not self.squeezed:
            return Search(self.base, self.squeezed, best_level, best_level, best_value, failures, True)
        return Search(self.base, self.squeezed, following, best_level, best_value, failures, False)


def start_search(jobs: Sequence[GimbalJob], objective: Objective | str, speeds: Mapping[str, float],
                 current: Plan | None = None, fixed: Collection[str] = ()) -> Search:
    """Lines 1–5 of Algorithm 1: split the GPU's jobs, swell the high-priority side, squeeze the other.

    ``speeds``: each job's speed under ``current`` (every job at 100 % when None), for the priorities.
    ``fixed``: jobs whose share cannot change (stock MPS: a running process keeps the share it started
    with); they keep their ``current`` percentage on either side, and when both sides have the same
    priority the side with a job that can move is the one squeezed. The squeezed side starts from the
    highest current percentage among its movable jobs, so a search that resumes continues from where the
    last one left the GPU.
    """
    objective = Objective(objective)
    now = {j.job_id: (current or {}).get(j.job_id, MAX_PERCENT) for j in jobs}
    base = {j.job_id: now[j.job_id] if j.job_id in fixed else MAX_PERCENT for j in jobs}
    if len(jobs) < 2:
        return Search(base, (), MAX_PERCENT, MAX_PERCENT)
    j_max = max(jobs, key=lambda j: (j.world_size, -jobs.index(j)))
    subset1 = [j_max]
    subset2 = [j for j in jobs if j is not j_max]

    def side_priority(side: list[GimbalJob]) -> float:
        return max(priority(j, speeds[j.job_id], objective) for j in side)

    high, low = side_priority(subset2), side_priority(subset1)
    movable = [any(j.job_id not in fixed for j in side) for side in (subset1, subset2)]
    # on a tie either side may be squeezed; squeeze one that can move (a starting job beside fixed ones)
    if high < low or (high == low and movable == [False, True]):
        subset1, subset2 = subset2, subset1
    squeezed = tuple(j.job_id for j in subset1 if j.job_id not in fixed)
    level = max((now[job_id] for job_id in squeezed), default=MAX_PERCENT)
    return Search(base, squeezed, level, level)


def coordinate(jobs: Sequence[GimbalJob], objective: Objective | str = Objective.JCT,
               speed_model: SpeedModel | None = None, current: Plan | None = None,
               fixed: Collection[str] = ()) -> dict[str, int]:
    """Thread percentages for the jobs sharing one GPU (Gimbal Algorithm 1 on one GPU, run to its end).

    Returns ``{job_id: percent}``, every value a multiple of 10 in 10..100. One job alone gets 100 (or
    its fixed share). ``current``/``fixed``: see ``start_search``; by default every job may move and the
    search starts from free competition.
    """
    objective = Objective(objective)
    model: SpeedModel = speed_model or thread_share_speeds
    now = {j.job_id: (current or {}).get(j.job_id, MAX_PERCENT) for j in jobs}
    if len(jobs) < 2:
        return {j.job_id: now[j.job_id] if j.job_id in fixed else MAX_PERCENT for j in jobs}
    speeds = model(jobs, now)
    search = start_search(jobs, objective, speeds, now, fixed)
    first = speeds if search.plan == now else model(jobs, search.plan)
    search = search.measured(objective_value(jobs, first, objective))
    while not search.done:
        search = search.measured(objective_value(jobs, model(jobs, search.plan), objective))
    return search.plan


def starting_share(starting: GimbalJob, running: Sequence[tuple[GimbalJob, int]],
                   objective: Objective | str = Objective.JCT, speed_model: SpeedModel | None = None) -> int:
    """The share of a job starting beside ``running`` (each with the share it started with), which stay.

    What the node agent can do with stock MPS: a process's percentage is fixed when it starts, so only
    the starting job moves. Algorithm 1 with the running jobs fixed: if the starting job is on the
    high-priority side it is swelled (100 %); otherwise it is squeezed while the objective improves. The
    agent (``gpushare.node.jobs.thread_percentage_for``) and the simulator's ``gimbal-jct`` /
    ``gimbal-makespan`` both call this (equal priorities: the starting job is the one squeezed), so the same inputs give the same share.
    """
    if not running:
        return MAX_PERCENT
    jobs = [job for job, _ in running] + [starting]
    current = {job.job_id: percent for job, percent in running}
    return coordinate(jobs, objective, speed_model, current=current, fixed=set(current))[starting.job_id]
