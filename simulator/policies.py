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

from collections.abc import Callable, Iterable, Sequence
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


def _by_node(candidates: list[GpuState], n: int, key: Callable[[GpuState], tuple],
             ok: Callable[[GpuState], bool] | None = None) -> list[int] | None:
    """The best ``n`` candidates by ``key`` on one node: the node of the best candidate that has ``n``.

    ``ok``: a further test, applied only to the candidates that can still decide the answer (the driver
    may compute what it reads — warming, risk — on demand); the same answer as filtering first.
    """
    ranked = sorted(candidates, key=key)
    return _walk(ranked, n, ok or (lambda g: True), lambda node: [g for g in ranked if g.node == node])


def _walk(ranked: Iterable[GpuState], n: int, ok: Callable[[GpuState], bool],
          node: Callable[[int], list[GpuState]]) -> list[int] | None:
    """``_by_node`` over GPUs already in rank order; ``node(i)`` gives node i's GPUs in rank order."""
    seen: set[int] = set()
    for first in ranked:
        if first.node in seen or not ok(first):
            continue
        if n == 1:  # the best GPU that passes: nothing ranked above it on its node passed
            return [first.index]
        seen.add(first.node)
        same = [g for g in node(first.node) if ok(g)]
        if len(same) >= n:
            return [g.index for g in same[:n]]
    return None


class Policy:
    """Base class: ``choose(job, gpus) -> list[int] | None``.

    A collocating policy is three functions: ``fits`` (the job's request against what the GPU holds),
    ``ready`` (what changes with the clock alone: TTFK warming, risk) and ``key`` (rank, lowest first); it
    picks the best-ranked GPUs that pass both, on one node.
    """

    name = "policy"
    collocates = True
    engine = "placement"  # which simulation runs it: placement (engine.py), salus (salus.py), gimbal (gimbal.py)
    needs_telemetry = False  # whether GpuState.risky/smact matter (drivers may skip computing them)
    static_key = True  # ``key`` reads only what the GPU holds (no clock): a driver may keep GPUs sorted by it

    def choose(self, job: JobRequest, gpus: Sequence[GpuState]) -> list[int] | None:
        if job.exclusive or not self.collocates:
            return _by_node(self.prefilter(job, gpus), job.gpus, key=lambda g: (g.index,))
        return self._choose_shared(job, self.prefilter(job, gpus))

    def choose_ranked(self, job: JobRequest, ranked: Iterable[GpuState],
                      node: Callable[[int], Sequence[GpuState]]) -> list[int] | None:
        """``choose`` for a shared request (not ``exclusive``) from every GPU in ``key`` order, reading
        only as far as the answer needs; ``node(i)``: node i's GPUs. Only for a ``static_key`` policy."""
        def ok(g: GpuState) -> bool:
            return self.fits(job, g) and self.ready(g)

        return _walk(ranked, job.gpus, ok, lambda n: sorted(node(n), key=self.key))

    def prefilter(self, job: JobRequest, gpus: Sequence[GpuState]) -> list[GpuState]:
        """The GPUs ``choose`` could pick for ``job`` whatever the clock says: those that fail only on
        fields that change without the GPU changing (``warming``, ``risky``, ``smact``) stay in. ``choose``
        gives the same answer on this list as on all GPUs, so a driver retrying a blocked job may keep it
        and re-test only the GPUs that changed."""
        if job.exclusive or not self.collocates:
            return [g for g in gpus if g.jobs == 0 and not g.exclusive]
        return [g for g in gpus if self.fits(job, g)]

    def fits(self, job: JobRequest, gpu: GpuState) -> bool:
        return True

    def ready(self, gpu: GpuState) -> bool:
        return True

    def key(self, gpu: GpuState) -> tuple:
        return (gpu.index,)

    def _choose_shared(self, job: JobRequest, gpus: list[GpuState]) -> list[int] | None:
        return _by_node(gpus, job.gpus, self.key, self.ready)


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
        return self.fits(job, gpu) and self.ready(gpu)

    def fits(self, job: JobRequest, gpu: GpuState) -> bool:
        return not gpu.exclusive and gpu.free_bytes >= max(job.mem_bytes or 0, self.min_free_bytes)

    def ready(self, gpu: GpuState) -> bool:
        """Not warming (TTFK) and not risky: the tests that depend on the clock."""
        return not (self.ttfk and gpu.warming) and not (self.risk_filter and gpu.risky)


class FirstFit(_Telemetry):
    name = "ff"


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
    static_key = False

    def key(self, gpu: GpuState) -> tuple:
        return (gpu.smact, gpu.index)


class RoundRobin(Policy):
    """Cyclic placement with no memory or risk precondition (CARMA's RR); TTFK-warming GPUs are skipped."""

    name = "rr"
    static_key = False  # the rank moves with the cursor

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

    def fits(self, job: JobRequest, gpu: GpuState) -> bool:
        return not gpu.exclusive and gpu.shards_free >= max(job.shards, 1)


class SlurmShardWithheld(SlurmShardFirstFit):
    """Slurm's first-fit on shards over the GPUs the agent has not withheld (risky or TTFK-warming).

    This is the deployment where the agent only filters (node features / typed GRES) and Slurm still
    picks among what is left; comparing it with MAGM/LUG measures what per-GPU steering adds.
    """

    name = "slurm-shards-withheld"
    needs_telemetry = True

    def ready(self, gpu: GpuState) -> bool:
        return not gpu.warming and not gpu.risky


class SlurmShardLeastLoaded(SlurmShardFirstFit):
    """What Slurm 24.11+ picks with ``SelectTypeParameters=LL_SHARED_GRES``: the GPU with the fewest shards
    already allocated that still has N free (lowest index on ties). Still only Slurm's accounting of
    requests, but it spreads jobs instead of stacking them on the first GPU."""

    name = "slurm-shards-ll"

    def key(self, gpu: GpuState) -> tuple:
        return (gpu.shards_total - gpu.shards_free, gpu.index)


class LivePlacement(Policy):
    """``--policy live`` (``gpushare.simulator.live``): Slurm's own shard selection — first-fit, or
    least-loaded with ``LL_SHARED_GRES`` — over the nodes the agent's withholding leaves open
    (``gpushare.policy.withhold.node_open`` over each GPU's risky-or-warming flag, GPUs held whole left
    out, as the agent does). With a ``gimbal-*`` thread policy it runs on the Gimbal engine (live caps)."""

    name = "live"
    static_key = False  # withholding reads every GPU of a node

    def __init__(self, least_loaded: bool = False, withhold: str = "none", withhold_when: str = "any",
                 thread_policy: str = "fixed") -> None:
        self.least_loaded, self.withhold, self.withhold_when = least_loaded, withhold, withhold_when
        self.needs_telemetry = withhold == "feature"
        # without withholding the rank reads only what the GPU holds (its index, its shards): the driver may
        # keep the GPUs sorted and walk them only as far as the answer needs, as for FF/BF/MAGM
        self.static_key = withhold != "feature"
        gimbal = thread_policy.startswith("gimbal-")
        self.engine = "gimbal" if gimbal else "placement"
        self.objective = thread_policy.removeprefix("gimbal-") if gimbal else None
        self.runtime = False

    def fits(self, job: JobRequest, gpu: GpuState) -> bool:
        return not gpu.exclusive and gpu.shards_free >= max(job.shards, 1)

    def key(self, gpu: GpuState) -> tuple:
        return (gpu.shards_total - gpu.shards_free, gpu.index) if self.least_loaded else (gpu.index,)

    def prefilter(self, job: JobRequest, gpus: Sequence[GpuState]) -> list[GpuState]:
        if self.withhold == "feature" and not job.exclusive:
            return list(gpus)  # a full GPU still closes its node
        return super().prefilter(job, gpus)

    def _choose_shared(self, job: JobRequest, gpus: list[GpuState]) -> list[int] | None:
        if self.withhold == "feature":
            from gpushare.policy.withhold import node_open

            nodes: dict[int, list[bool]] = {}
            for g in gpus:
                nodes.setdefault(g.node, [])
                if not g.exclusive:
                    nodes[g.node].append(g.risky or g.warming)
            gpus = [g for g in gpus if node_open(nodes[g.node], self.withhold_when)]
        return _by_node([g for g in gpus if self.fits(job, g)], job.gpus, self.key)


class SalusLanes(Policy):
    """Salus' GPU lanes (``gpushare.policy.lane_policy``): the simulation offers only GPUs whose lane layout
    admits the job (safety condition); among them the one with the fewest jobs, then the most free memory,
    so lanes spread over GPUs before they time-share. ``lane_policy`` picks the turn inside a lane."""

    name = "salus-pack"
    engine = "salus"
    lane_policy = "pack"

    def fits(self, job: JobRequest, gpu: GpuState) -> bool:
        return not gpu.exclusive

    def key(self, gpu: GpuState) -> tuple:
        return (gpu.jobs, -gpu.free_bytes, gpu.index)


class SalusSrtf(SalusLanes):
    name = "salus-srtf"
    lane_policy = "srtf"


class SalusFair(SalusLanes):
    name = "salus-fair"
    lane_policy = "fair"


GIMBAL_MAX_JOBS = 2  # Gimbal §5.1: at most two workers on one GPU


class GimbalPacking(Policy):
    """Gimbal's aggressive packing: at most two jobs per GPU, no risk filter (interference is what the
    thread caps of ``gpushare.policy.gimbal`` tame), free memory ≥ the job's need; most free memory first.
    ``objective`` None is free competition (every cap 100 %), the baseline Gimbal compares with.
    ``runtime`` False: caps as the node agent sets them with stock MPS (only a starting job's share is
    chosen); True: Gimbal's runtime recalibration of running jobs (``gpushare.simulator.gimbal``)."""

    name = "gimbal-jct"
    engine = "gimbal"
    objective: str | None = "jct"
    runtime = False

    def fits(self, job: JobRequest, gpu: GpuState) -> bool:
        need = max(job.mem_bytes or 0, MIN_FREE_BYTES)
        return not gpu.exclusive and gpu.jobs < GIMBAL_MAX_JOBS and gpu.free_bytes >= need

    def key(self, gpu: GpuState) -> tuple:
        return (-gpu.free_bytes, gpu.index)


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
                SlurmShardWithheld, SlurmShardLeastLoaded, LivePlacement, SalusLanes, SalusSrtf, SalusFair, GimbalPacking,
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
