"""Salus' GPU lanes: admission, lane assignment and per-iteration turn choice, as pure functions.

Why a module of its own: the simulator models Salus with it, and the node agent's live lane service
chooses turns with the same ``next_turn`` (``gpushare.agent.lanes.salus_policy``), so both make exactly
the same decisions; nothing here reads a clock, a device or a file.

Model (Salus, "Fine-Grained GPU Sharing Primitives for Deep Learning Applications", §3.2–§4):

* A job has *persistent* memory (model parameters and framework-internal state, kept on the GPU for its
  whole life) and *ephemeral* memory (scratch of one iteration, released between iterations).
* The GPU's ephemeral region is cut into *lanes*. A lane's size is the largest ephemeral need of its jobs;
  iterations in one lane run one after another, lanes run side by side.
* Safety condition (§3.3.2): ``Σ_jobs P_i + Σ_lanes L_j ≤ C`` with ``L_j = max_{i in j} E_i``. Every
  admitted set keeps it, so an iteration can always allocate its ephemeral memory without paging.
* Lane assignment (Algorithm 1, FINDLANE): open a new lane if the safety condition allows; else put the
  job in the existing lane with the smallest size that already holds its ephemeral need ("best match");
  else grow the smallest lane that can be grown to the job's need within capacity; else the job waits.
  ``reuse_first=True`` tries the best-matching existing lane before opening one (fewer, fuller lanes:
  less interference between lanes, more time sharing within them).
* Turn choice within a lane, per iteration (§4): PACK runs the lane's jobs in admission order, each to
  completion (packing is across lanes, never time slicing within one); SRTF gives the turn to the job
  with the shortest remaining time (pre-emptive at iteration boundaries); FAIR gives it to the job with
  the least service, where a job joining a lane starts at the lane's least service (a virtual clock, as
  a fair-share CPU scheduler does) so the members share the lane equally from then on — Salus Fig. 11,
  where each job's throughput halves when a second job joins.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum


class LanePolicy(str, Enum):
    """Which job of a lane runs the lane's next iteration (Salus §4)."""

    PACK = "pack"
    SRTF = "srtf"
    FAIR = "fair"


@dataclass(frozen=True)
class LaneJob:
    """What admission needs to know about a job: its two kinds of memory, in bytes."""

    job_id: str
    persistent_bytes: int
    ephemeral_bytes: int

    def __post_init__(self) -> None:
        if self.persistent_bytes < 0 or self.ephemeral_bytes < 0:
            raise ValueError(f"{self.job_id}: memory cannot be negative")


@dataclass(frozen=True)
class Lane:
    """One lane: its id, its size (bytes reserved in the ephemeral region) and its jobs in admission order."""

    lane_id: int
    size_bytes: int
    job_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class GpuLanes:
    """The lane layout of one GPU: capacity, admitted jobs and lanes. Immutable; operations return new ones."""

    capacity_bytes: int
    jobs: Mapping[str, LaneJob] = field(default_factory=dict)
    lanes: tuple[Lane, ...] = ()
    next_lane_id: int = 0

    @property
    def persistent_bytes(self) -> int:
        return sum(job.persistent_bytes for job in self.jobs.values())

    @property
    def lane_bytes(self) -> int:
        return sum(lane.size_bytes for lane in self.lanes)

    @property
    def admitted_bytes(self) -> int:
        """Σ persistent + Σ lane sizes: what the safety condition bounds by the capacity."""
        return self.persistent_bytes + self.lane_bytes

    def lane_of(self, job_id: str) -> Lane:
        for lane in self.lanes:
            if job_id in lane.job_ids:
                return lane
        raise KeyError(job_id)


def safe(capacity_bytes: int, jobs: Iterable[LaneJob], lanes: Iterable[Lane]) -> bool:
    """Salus' safety condition over a proposed layout, lane sizes as given."""
    return sum(j.persistent_bytes for j in jobs) + sum(lane.size_bytes for lane in lanes) <= capacity_bytes


def find_lane(gpu: GpuLanes, job: LaneJob, reuse_first: bool = False) -> tuple[str, int | None] | None:
    """Where ``job`` would go, without changing anything: ``("new", None)``, ``("reuse", lane_id)``,
    ``("grow", lane_id)``, or None when it must wait (Salus Algorithm 1, FINDLANE)."""
    if job.job_id in gpu.jobs:
        raise ValueError(f"{job.job_id} is already admitted")
    base = gpu.admitted_bytes + job.persistent_bytes
    fits_new = base + job.ephemeral_bytes <= gpu.capacity_bytes
    fitting = [lane for lane in gpu.lanes if lane.size_bytes >= job.ephemeral_bytes]
    best = min(fitting, key=lambda lane: (lane.size_bytes, lane.lane_id), default=None)
    reuse_ok = best is not None and base <= gpu.capacity_bytes
    order = (("reuse", reuse_ok), ("new", fits_new)) if reuse_first else (("new", fits_new), ("reuse", reuse_ok))
    for kind, ok in order:
        if ok:
            return (kind, None) if kind == "new" else (kind, best.lane_id)  # type: ignore[union-attr]
    for lane in sorted(gpu.lanes, key=lambda item: (item.size_bytes, item.lane_id)):
        # only a lane smaller than the job's need grows (a lane it already fits was ruled out above)
        if lane.size_bytes < job.ephemeral_bytes and base - lane.size_bytes + job.ephemeral_bytes <= gpu.capacity_bytes:
            return ("grow", lane.lane_id)
    return None


def admit(gpu: GpuLanes, job: LaneJob, reuse_first: bool = False) -> GpuLanes | None:
    """The layout with ``job`` admitted, or None when it must wait. The result always satisfies ``safe``."""
    where = find_lane(gpu, job, reuse_first)
    if where is None:
        return None
    kind, lane_id = where
    jobs = {**gpu.jobs, job.job_id: job}
    if kind == "new":
        lane = Lane(gpu.next_lane_id, job.ephemeral_bytes, (job.job_id,))
        return replace(gpu, jobs=jobs, lanes=(*gpu.lanes, lane), next_lane_id=gpu.next_lane_id + 1)
    lanes = tuple(
        replace(lane, size_bytes=max(lane.size_bytes, job.ephemeral_bytes), job_ids=(*lane.job_ids, job.job_id))
        if lane.lane_id == lane_id else lane
        for lane in gpu.lanes
    )
    return replace(gpu, jobs=jobs, lanes=lanes)


def release(gpu: GpuLanes, job_id: str) -> GpuLanes:
    """The layout without ``job_id``: its lane shrinks to its remaining members' largest need (Salus' auto
    defragmentation at the next iteration boundary), and disappears when empty (Algorithm 1, JOBFINISH)."""
    if job_id not in gpu.jobs:
        raise KeyError(job_id)
    jobs = {k: v for k, v in gpu.jobs.items() if k != job_id}
    lanes = []
    for lane in gpu.lanes:
        members = tuple(j for j in lane.job_ids if j != job_id)
        if members:
            lanes.append(replace(lane, job_ids=members, size_bytes=max(jobs[j].ephemeral_bytes for j in members)))
    return replace(gpu, jobs=jobs, lanes=tuple(lanes))


def admit_queue(gpu: GpuLanes, queue: Sequence[LaneJob], reuse_first: bool = False) -> tuple[GpuLanes, list[str]]:
    """Admit what fits from ``queue``, in its order, skipping what does not (Algorithm 1, PROCESSREQUESTS:
    every queued request is tried, so a large job at the head does not block small ones behind it)."""
    admitted = []
    for job in queue:
        after = admit(gpu, job, reuse_first)
        if after is not None:
            gpu = after
            admitted.append(job.job_id)
    return gpu, admitted


@dataclass(frozen=True)
class TurnState:
    """What turn choice knows about a lane member: its admission order, remaining time and service."""

    job_id: str
    admitted_seq: int
    remaining_s: float
    service_s: float = 0.0


def next_turn(policy: LanePolicy, members: Sequence[TurnState]) -> str | None:
    """The job that runs the lane's next iteration under ``policy`` (ties: earlier admission)."""
    if not members:
        return None

    def key(m: TurnState) -> tuple[float, int]:
        if policy is LanePolicy.PACK:
            return (0.0, m.admitted_seq)
        return (m.remaining_s if policy is LanePolicy.SRTF else m.service_s, m.admitted_seq)

    return min(members, key=key).job_id


def joining_service(members: Sequence[TurnState]) -> float:
    """FAIR's starting service for a job joining a lane: the lane's least service, so it shares from now on
    instead of monopolising the lane until it has caught up with jobs that ran before it came."""
    return min((m.service_s for m in members), default=0.0)


def time_shares(policy: LanePolicy, members: Sequence[TurnState]) -> dict[str, float]:
    """Long-run fraction of the lane's iterations each member gets between two membership changes.

    PACK and SRTF give the whole lane to ``next_turn``'s pick (it keeps the turn until a member joins or
    leaves: SRTF's remaining times all shrink only while running, so the pick does not change in between).
    FAIR equalises service among members, so each gets an equal share.
    """
    if not members:
        return {}
    if policy is LanePolicy.FAIR:
        return {m.job_id: 1.0 / len(members) for m in members}
    chosen = next_turn(policy, members)
    return {m.job_id: 1.0 if m.job_id == chosen else 0.0 for m in members}
