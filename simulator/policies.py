"""GPU-selection policies for shared jobs: which GPU(s) of a node a job should go to.

Pure: each policy gets a snapshot of per-GPU state and a job's request and returns GPU indices or None
("not now"). The node agent builds the snapshot from NVML telemetry, the risk window and the TTFK
table; the simulator builds it from simulated GPUs. Only round-robin keeps state (its cursor), and that
state is advanced by ``choose`` itself, never by a clock.

Policies (CARMA §2.4 and §3.2; "Slurm first-fit on shards" is what Slurm 22.05's own GRES selection
does with ``shard`` GRES, which knows nothing of telemetry):

=============  ==========================================================================================
exclusive      idle GPUs only (no job at all), lowest index first
rr             cyclic over GPUs; no memory or risk precondition, only the TTFK window (CARMA's RR)
ff             first eligible GPU by index                         (eligible: see below)
bf             eligible GPU with the *least* free memory that still fits (tightest packing)
magm           eligible GPU with the *most* free memory (CARMA's default)
lug            eligible GPU with the lowest SMACT risk score
slurm-shards   lowest-index GPU whose free shards (GiB accounting of requests) fit; no telemetry
slurm-shards-  the same over the GPUs the agent has not withheld (risky or warming): the agent filters,
withheld       Slurm still picks
slurm-shards-  Slurm 24.11+ with ``LL_SHARED_GRES``: the GPU with the fewest shards allocated that fits
ll
salus-pack     Salus lanes (see ``SalusLanes``): admission by lane safety, turns by PACK / SRTF / FAIR
salus-srtf,
salus-fair
gimbal-jct,    Gimbal packing (see ``GimbalPacking``): two jobs per GPU, MPS thread caps by Gimbal's
gimbal-        Algorithm 1 for JCT / makespan, set as the agent does (a starting job's share only);
makespan,      ``-runtime``: Gimbal's runtime recalibration of every job's cap (simulator only);
gimbal-jct-    ``gimbal-free``: the same packing, caps at 100 %
runtime,
gimbal-
makespan-
runtime,
gimbal-free
=============  ==========================================================================================

Eligible (ff, bf, magm, lug): not holding an exclusive job, not warming (TTFK), not risky (CARMA §2.3;
``risk_filter=False`` turns that off, as in CARMA's "without filtering" runs), and free memory at least
the job's need, which is its estimate + margin when known and CARMA's 2 GB precondition otherwise
(§2.6). A job marked ``exclusive`` (an OOM recovery, CARMA §2.5) always gets idle GPUs, whatever the
policy. Multi-GPU jobs get all their GPUs on one node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpushare.gpus import GiB

MIN_FREE_BYTES = 2 * GiB  # CARMA §2.6: "GPU memory precondition is 2 GB"


@dataclass(frozen=True)
class GpuState:
    """What a policy may know about one GPU at decision time."""

    index: int  # position in the snapshot's GPU list; what ``choose`` returns
    total_bytes: int
    free_bytes: int  # telemetry: total − memory in use now (nvidia-smi's view)
    jobs: int = 0  # jobs placed on it, warming or running
    node: int = 0
    exclusive: bool = False  # holds a job that must not be shared (exclusive or recovery)
    risky: bool = False  # RiskAssessment.risky of its last window
    warming: bool = False  # TtfkTable.warming
    smact: float = 0.0  # SMACT risk score, LUG's key
    shards_total: int = 0  # Slurm shard GRES count (GiB of memory)
    shards_free: int = 0  # shards not allocated to jobs (Slurm's accounting of requests)


@dataclass(frozen=True)
class JobRequest:
    """What a policy may know about a job."""

    job_id: str
    gpus: int = 1
    mem_bytes: int | None = None  # per-GPU need: estimate + margin; None when no estimate exists
    shards: int = 0  # per-GPU shard request (GiB) as Slurm would see it
    exclusive: bool = False  # whole GPUs only (exclusive policy or OOM recovery)


def _by_node(candidates: list[GpuState], n: int, key: Callable[[GpuState], tuple]) -> list[int] | None:
    """The best ``n`` candidates by ``key`` on one node: the node of the best candidate that has ``n``."""
    ranked = sorted(candidates, key=key)
    for first in ranked:
        same = [g for g in ranked if g.node == first.node]
        if len(same) >= n:
            return [g.index for g in same[:n]]
    return None


class Policy:
    """Base class: ``choose(job, gpus) -> list[int] | None``."""

    name = "policy"
    collocates = True
    engine = "placement"  # which simulation runs it: placement (engine.py), salus (salus.py), gimbal (gimbal.py)
    needs_telemetry = False  # whether GpuState.risky/smact matter (drivers may skip computing them)

    def choose(self, job: JobRequest, gpus: Sequence[GpuState]) -> list[int] | None:
        if job.exclusive or not self.collocates:
            idle = [g for g in gpus if g.jobs == 0 and not g.exclusive]
            return _by_node(idle, job.gpus, key=lambda g: (g.index,))
        return self._choose_shared(job, list(gpus))

    def _choose_shared(self, job: JobRequest, gpus: list[GpuState]) -> list[int] | None:
        raise NotImplementedError


class Exclusive(Policy):
    """One job per GPU: the traditional mapping and the baseline everything is compared with."""

    name = "exclusive"
    collocates = False


class _Telemetry(Policy):
    """Shared filter of the telemetry-aware policies (ff, bf, magm, lug)."""

    needs_telemetry = True

    def __init__(self, risk_filter: bool = True, ttfk: bool = True, min_free_bytes: int = MIN_FREE_BYTES):
        self.risk_filter = risk_filter
        self.ttfk = ttfk
        self.min_free_bytes = min_free_bytes

    def eligible(self, job: JobRequest, gpu: GpuState) -> bool:
        need = max(job.mem_bytes or 0, self.min_free_bytes)
        return (  # cheap tests first: warming and risk may be computed on demand (the simulator's views)
            not gpu.exclusive
            and gpu.free_bytes >= need
            and not (self.ttfk and gpu.warming)
            and not (self.risk_filter and gpu.risky)
        )

    def key(self, gpu: GpuState) -> tuple:
        raise NotImplementedError

    def _choose_shared(self, job: JobRequest, gpus: list[GpuState]) -> list[int] | None:
        return _by_node([g for g in gpus if self.eligible(job, g)], job.gpus, self.key)


class FirstFit(_Telemetry):
    name = "ff"

    def key(self, gpu: GpuState) -> tuple:
        return (gpu.index,)


class BestFit(_Telemetry):
    """Least free memory that fits: packs tightly, which CARMA found drives GPUs to peak power."""

    name = "bf"

    def key(self, gpu: GpuState) -> tuple:
        return (gpu.free_bytes, gpu.index)


class MostAvailableMemory(_Telemetry):
    """MAGM: the most free memory, to keep OOMs away (CARMA's default with recovery)."""

    name = "magm"

    def key(self, gpu: GpuState) -> tuple:
        return (-gpu.free_bytes, gpu.index)


class LeastUtilised(_Telemetry):
    """LUG: the lowest SMACT risk score, to keep interference down."""

    name = "lug"

    def key(self, gpu: GpuState) -> tuple:
        return (gpu.smact, gpu.index)


class RoundRobin(Policy):
    """Cyclic placement with no memory or risk precondition (CARMA's RR); TTFK-warming GPUs are skipped."""

    name = "rr"

    def __init__(self, ttfk: bool = True) -> None:
        self.ttfk = ttfk
        self._cursor = 0

    def _choose_shared(self, job: JobRequest, gpus: list[GpuState]) -> list[int] | None:
        if not gpus:
            return None
        count = len(gpus)
        order = [gpus[(self._cursor + k) % count] for k in range(count)]
        usable = [g for g in order if not g.exclusive and not (self.ttfk and g.warming)]
        rank = {g.index: k for k, g in enumerate(order)}
        chosen = _by_node(usable, job.gpus, key=lambda g: (rank[g.index],))
        if chosen is not None:
            self._cursor = (max(rank[i] for i in chosen) + self._cursor + 1) % count
        return chosen


class SlurmShardFirstFit(Policy):
    """What Slurm 22.05 itself picks for ``--gres=shard:N``: the lowest-index GPU with N free shards.

    Slurm sees only its own accounting of requests (shards), never memory in use, risk or TTFK.
    """

    name = "slurm-shards"

    def _choose_shared(self, job: JobRequest, gpus: list[GpuState]) -> list[int] | None:
        fits = [g for g in gpus if not g.exclusive and g.shards_free >= max(job.shards, 1)]
        return _by_node(fits, job.gpus, key=lambda g: (g.index,))


class SlurmShardWithheld(SlurmShardFirstFit):
    """Slurm's first-fit on shards over the GPUs the agent has not withheld (risky or TTFK-warming).

    This is the deployment where the agent only filters (node features / typed GRES) and Slurm still
    picks among what is left; comparing it with MAGM/LUG measures what per-GPU steering adds.
    """

    name = "slurm-shards-withheld"
    needs_telemetry = True

    def _choose_shared(self, job: JobRequest, gpus: list[GpuState]) -> list[int] | None:
        fits = [g for g in gpus if not g.exclusive and g.shards_free >= max(job.shards, 1)]  # Slurm's test first
        return super()._choose_shared(job, [g for g in fits if not g.warming and not g.risky])


class SlurmShardLeastLoaded(Policy):
    """What Slurm 24.11+ picks with ``SelectTypeParameters=LL_SHARED_GRES``: the GPU with the fewest shards
    already allocated that still has N free (lowest index on ties). Still only Slurm's accounting of
    requests, but it spreads jobs instead of stacking them on the first GPU."""

    name = "slurm-shards-ll"

    def _choose_shared(self, job: JobRequest, gpus: list[GpuState]) -> list[int] | None:
        fits = [g for g in gpus if not g.exclusive and g.shards_free >= max(job.shards, 1)]
        return _by_node(fits, job.gpus, key=lambda g: (g.shards_total - g.shards_free, g.index))


class SalusLanes(Policy):
    """Salus' GPU lanes (``gpushare.agent.lane_policy``): the simulation offers only GPUs whose lane layout
    admits the job (safety condition); among them the one with the fewest jobs, then the most free memory,
    so lanes spread over GPUs before they time-share. ``lane_policy`` picks the turn inside a lane."""

    name = "salus-pack"
    engine = "salus"
    lane_policy = "pack"

    def _choose_shared(self, job: JobRequest, gpus: list[GpuState]) -> list[int] | None:
        usable = [g for g in gpus if not g.exclusive]
        return _by_node(usable, job.gpus, key=lambda g: (g.jobs, -g.free_bytes, g.index))


class SalusSrtf(SalusLanes):
    name = "salus-srtf"
    lane_policy = "srtf"


class SalusFair(SalusLanes):
    name = "salus-fair"
    lane_policy = "fair"


GIMBAL_MAX_JOBS = 2  # Gimbal §5.1: at most two workers on one GPU


class GimbalPacking(Policy):
    """Gimbal's aggressive packing: at most two jobs per GPU, no risk filter (interference is what the
    thread caps of ``gpushare.agent.gimbal`` tame), free memory ≥ the job's need; most free memory first.
    ``objective`` None is free competition (every cap 100 %), the baseline Gimbal compares with.
    ``runtime`` False: caps as the node agent sets them with stock MPS (only a starting job's share is
    chosen); True: Gimbal's runtime recalibration of running jobs (``gpushare.simulator.gimbal``)."""

    name = "gimbal-jct"
    engine = "gimbal"
    objective: str | None = "jct"
    runtime = False

    def _choose_shared(self, job: JobRequest, gpus: list[GpuState]) -> list[int] | None:
        need = max(job.mem_bytes or 0, MIN_FREE_BYTES)
        fits = [g for g in gpus if not g.exclusive and g.jobs < GIMBAL_MAX_JOBS and g.free_bytes >= need]
        return _by_node(fits, job.gpus, key=lambda g: (-g.free_bytes, g.index))


class GimbalMakespan(GimbalPacking):
    name = "gimbal-makespan"
    objective = "makespan"


class GimbalJctRuntime(GimbalPacking):
    name = "gimbal-jct-runtime"
    runtime = True


class GimbalMakespanRuntime(GimbalPacking):
    name = "gimbal-makespan-runtime"
    objective = "makespan"
    runtime = True


class FreeCompetition(GimbalPacking):
    name = "gimbal-free"
    objective = None


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (Exclusive, RoundRobin, FirstFit, BestFit, MostAvailableMemory, LeastUtilised, SlurmShardFirstFit,
                SlurmShardWithheld, SlurmShardLeastLoaded, SalusLanes, SalusSrtf, SalusFair, GimbalPacking,
                GimbalMakespan, GimbalJctRuntime, GimbalMakespanRuntime, FreeCompetition)
}


def make_policy(name: str, **options: object) -> Policy:
    """Build a policy by name; ``magm-nofilter``/``lug-nofilter`` turn the risk filter off."""
    lowered = name.lower()
    nofilter = lowered.endswith("-nofilter")
    base = lowered.removesuffix("-nofilter")
    if base not in POLICIES or (nofilter and base not in {"ff", "bf", "magm", "lug"}):
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)} (and ff|bf|magm|lug-nofilter)")
    if nofilter:
        options.setdefault("risk_filter", False)
    return POLICIES[base](**options)  # type: ignore[arg-type]
