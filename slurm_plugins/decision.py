"""The submit-time decision: keep a whole GPU, or turn ``gpu:1`` into a right-sized shared request.

Pure: request, estimate and config in, a Decision out. No I/O and no clock, so it is unit-tested and
fuzzed directly, and the service around it stays a thin transport.

Why shards sized in GiB: each GPU's ``shard`` count equals its memory in GiB (gres.conf from
``gpushare slurm-config``), so a job asking for ``shard:<estimate + margin>`` lets Slurm's own GRES
accounting guarantee that the estimates placed on one GPU never sum past its memory (docs/architecture.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gpushare.config import Config
from gpushare.gpus import GiB, GpuModel, MigProfile
from gpushare.policy.share_gate import Pressure, compute_shards, gate, share_shards
from gpushare.estimate.directives import Directives
from gpushare.estimate.source import Estimate
from gpushare.slurm import record as record_format
from gpushare.slurm.gres_request import GresItem, format_gres, parse_gres
from gpushare.estimate.script_discovery import NotFound, describe, find_training_command

RECORD_VERSION = record_format.VERSION
parse_record = record_format.parse


@dataclass(frozen=True)
class SubmitRequest:
    """The fields of a job_desc the decision needs (all optional: Slurm leaves most unset)."""

    user_id: int = -1
    tres_per_node: str | None = None
    tres_per_job: str | None = None
    tres_per_task: str | None = None
    min_nodes: int | None = None
    array: bool = False
    het_offset: int | None = None  # set for components of heterogeneous jobs
    script: str = ""
    partition: str | None = None  # the job's --partition list as given; None: the default partition
    default_partition: str | None = None  # the default partition's name, when the shim could tell it
    account: str | None = None  # --account as given; None: the user's default account
    qos: str | None = None  # --qos as given; None: the default QOS


@dataclass
class Decision:
    action: str  # "accept" (unchanged), "modify", "reject"
    tres_per_node: str | None = None  # the new value when action == "modify"
    record: dict[str, Any] = field(default_factory=dict)
    user_message: str = ""
    reject_message: str = ""
    hold: bool = False  # held (priority 0) by the shim until the asynchronous estimate lands

    @property
    def admin_comment(self) -> str:
        return (record_format.render(self.record) or "") if self.record else ""


def _gib(value: int) -> float:
    return round(value / GiB, 2)


def smallest_cluster_gpu_gib(cfg: Config) -> int:
    """Shards of the smallest GPU a shared job may land on: the limit a shard request must fit."""
    names = [group.gpu for group in cfg.nodes] or list(cfg.estimator.gpus)
    sizes = [cfg.gpu(name.partition(":")[0]).shards for name in names]
    return min(sizes) if sizes else 0


@dataclass(frozen=True)
class Queue:
    """The queue as gpushare-submitd last saw it in the job's partitions (slurm_plugins/queue_view.py):
    ``pressure`` None when it has no fresh view; ``claimed``: GPUs promised to jobs kept whole since."""

    pressure: Pressure | None = None
    claimed: int = 0


def decide(request: SubmitRequest, directives: Directives, estimate: Estimate | None, cfg: Config,
           queue: Queue | None = None) -> Decision:
    """Choose what happens to one submitted job. Never raises on job content."""
    try:
        per_node = parse_gres(request.tres_per_node)
        per_job = parse_gres(request.tres_per_job)
        per_task = parse_gres(request.tres_per_task)
    except ValueError as exc:
        return _keep(request, "unparsed", f"GRES not understood ({exc}); request left as is")
    gpu_items = [i for i in per_node if i.name == "gpu"]
    shared_items = [i for i in per_node + per_job + per_task if i.name in ("shard", "mps")]
    any_gpu = gpu_items or any(i.name == "gpu" for i in per_job + per_task)
    if not any_gpu and not shared_items:
        return Decision(action="accept")  # not a GPU job: no record, no message

    if directives.problems:
        problem = directives.first_problem or "bad directive"
        if cfg.submit.on_bad_directive == "reject":
            return Decision(action="reject", reject_message=f"gpushare: {problem}; fix it or remove the line")
        keep = _keep(request, "bad-directive", problem)
        keep.user_message = f"gpushare: ignoring the job's #GPUSHARE lines ({problem}); GPU request unchanged"
        return keep

    reason = _not_shareable(request, per_node, per_job, per_task, gpu_items, shared_items)
    if reason:
        return _keep(request, reason[0], reason[1], estimate)
    if directives.mode == "exclusive":
        return _keep(request, "exclusive", "the script asks for a whole GPU (#GPUSHARE mode=exclusive)", estimate)
    if cfg.policy.shared == "none":
        return _keep(request, "annotate", "sharing is off ([policy] shared = none)", estimate)

    if estimate is None:
        mode, why = cfg.policy.without_estimate, ""
        if mode == "async":
            held = _hold_for_estimation(request, per_node, gpu_items[0], directives, cfg)
            if isinstance(held, Decision):
                return held
            mode, why = cfg.estimation.fallback, held
        return without_estimate(request, per_node, gpu_items[0], mode, why, cfg, _gate(directives, queue))
    return _size_shared(request, per_node, gpu_items[0], estimate, cfg, lanes=directives.lanes,
                        queue=_gate(directives, queue), compute=directives.compute)


def _gate(directives: Directives, queue: Queue | None) -> Queue | None:
    """The queue to gate sharing on; None (share) when the script itself asks to share (mode=shared)."""
    return None if directives.mode == "shared" else (queue or Queue())


# A lane job is charged its persistent memory plus 1/LANE_SHARE of its ephemeral memory: Slurm's shards
# assume each lane is shared by this many jobs. The node agent's admission is what keeps the GPU safe when
# more lane jobs land on a GPU than its lanes hold: the surplus waits at its first turn (docs/submit-path.md).
LANE_SHARE = 2


def lane_charge(estimate: Estimate) -> tuple[int, dict[str, Any]]:
    """Bytes a lane job is charged in shards (before the margin) and the record's ``lanes`` field.

    Without a persistent/ephemeral split the whole estimate counts as ephemeral, and the job gets a lane of
    its own (``own``): sharing a lane is only safe when the persistent part, which stays resident between
    turns, is known. So it is charged in full: no discount without the split."""
    p, e = estimate.persistent_bytes, estimate.ephemeral_bytes
    if p is None or e is None:
        return estimate.total_bytes, {"p_gib": 0.0, "e_gib": _gib(estimate.total_bytes), "own": True}
    return p + math.ceil(e / LANE_SHARE), {"p_gib": _gib(p), "e_gib": _gib(e)}


def without_estimate(request: SubmitRequest, per_node: list[GresItem], gpu: GresItem, mode: str, why: str,
                     cfg: Config, queue: Queue | None = None) -> Decision:
    """``exclusive``: keep the whole GPU; ``recover``: share with the default size, OOM recovery behind it."""
    if mode != "recover":
        decision = _keep(request, "exclusive",
                         why or "no memory estimate: add a '#GPUSHARE mem' line or run gpu-estimate")
        decision.user_message = ("gpushare: no GPU memory estimate for this job; it keeps a whole GPU "
                                 f"({why + '; ' if why else ''}run gpu-estimate, or add '#GPUSHARE mem=12G' to the script)")
        return decision
    estimate = Estimate(int(cfg.policy.recover_default_gib * GiB), "default",
                        "default size; an OOM is recovered on a whole GPU")
    decision = _size_shared(request, per_node, gpu, estimate, cfg, queue=queue)
    if why:
        decision.record["why"] = f"{why[:300]}; {decision.record.get('why', '')}"
    return decision


def _hold_for_estimation(request: SubmitRequest, per_node: list[GresItem], gpu: GresItem, directives: Directives,
                         cfg: Config) -> Decision | str:
    """Hold the job on all shards of the smallest GPU (same as exclusive) until its estimate lands.

    Why shards now: Slurm refuses gpu→shard changes on a pending job but allows shard:40→shard:7, so the
    job is rewritten to the exclusive-equivalent shard request at submit time and only shrinks later.
    Returns the reason as a string when the job cannot be estimated asynchronously.
    """
    if request.user_id == 0:
        return "root's jobs are not estimated asynchronously (user code never runs as root)"
    if request.array:
        return "array jobs are not held for estimation (estimate once with gpu-estimate --annotate)"
    found = find_training_command(request.script, directives.script)
    if isinstance(found, NotFound):
        return found.reason
    gpu_gib = smallest_cluster_gpu_gib(cfg)
    if gpu_gib <= 0:
        return "no GPU nodes configured"
    new_value = format_gres([gpu.replaced("shard", None, gpu_gib) if item is gpu else item for item in per_node])
    record = {"v": RECORD_VERSION, "decision": "estimating", "old": request.tres_per_node, "new": new_value,
              "script": describe(found)[:160],
              "why": f"held until gpu-estimate runs as the user on partition {cfg.estimation.partition}"}
    message = (f"gpushare: no GPU memory estimate; job held while gpu-estimate {describe(found)[:80]} runs as you "
               f"on partition {cfg.estimation.partition} ('gpushare estimates' shows it); it is then released "
               "with a right-sized GPU share")
    return Decision(action="modify", tres_per_node=new_value, record=record, user_message=message, hold=True)


def _not_shareable(request: SubmitRequest, per_node: list[GresItem], per_job: list[GresItem],
                   per_task: list[GresItem], gpu_items: list[GresItem],
                   shared_items: list[GresItem]) -> tuple[str, str] | None:
    if shared_items:
        return "explicit", f"the job already asks for {format_gres(shared_items)}"
    if request.het_offset is not None:
        return "heterogeneous", "heterogeneous job components keep their GPUs"
    if any(i.name == "gpu" for i in per_job + per_task) or not gpu_items:
        return "per-job", "--gpus/--gpus-per-task requests are kept; use --gres=gpu:1 to allow sharing"
    if len(gpu_items) > 1 or gpu_items[0].count != 1:
        return "multi-gpu", f"{sum(i.count for i in gpu_items)} GPUs per node are kept exclusive"
    if request.min_nodes is not None and request.min_nodes > 1:
        return "multi-node", f"{request.min_nodes}-node jobs keep whole GPUs"
    if gpu_items[0].type:
        return "typed", f"typed request gpu:{gpu_items[0].type} kept (shards carry no GPU type)"
    return None


def mig_models_for(partition: str | None, cfg: Config) -> list[GpuModel]:
    """The GPU models of the job's partitions when every node there is a gpushare MIG node, else [].

    Why only then: a slice request (``gpu:3g.20gb:1``) cannot run on a shard node and a shard request cannot
    run on a MIG node, so the choice is made only where the job's partitions leave no doubt. A job that
    names no partition goes to the default one, which the hook cannot see: it keeps the shard path."""
    wanted = {name.strip() for name in (partition or "").split(",") if name.strip()}
    groups = [group for group in cfg.nodes if group.partition in wanted]
    if not groups or not all(group.mig for group in groups):
        return []
    return [cfg.gpu(name) for name in sorted({group.gpu for group in groups})]


def mig_profile_for(need_bytes: int, models: list[GpuModel]) -> tuple[MigProfile | None, MigProfile | None]:
    """(the smallest slice whose usable memory holds ``need_bytes``, the largest slice) among the profiles
    every one of ``models`` has: the request names one profile, so it must exist on each GPU model the job
    may land on. Media-extension variants are left out (they exist for video work and are scarcer)."""
    if not models:
        return None, None
    names = set.intersection(*({p.name for p in m.mig_profiles if not p.media_extensions} for m in models))
    variants = {name: [p for m in models if (p := m.find_mig_profile(name))] for name in names}

    def rank(name: str) -> tuple[int, int]:
        return min(p.usable_bytes for p in variants[name]), max(p.compute_slices for p in variants[name])

    ranked = sorted(names, key=rank)
    if not ranked:
        return None, None
    fits = next((name for name in ranked if rank(name)[0] >= need_bytes), None)
    smallest = min(variants[fits], key=lambda p: p.usable_bytes) if fits else None
    return smallest, min(variants[ranked[-1]], key=lambda p: p.usable_bytes)


def _size_mig(request: SubmitRequest, per_node: list[GresItem], gpu: GresItem, estimate: Estimate, margin: float,
              models: list[GpuModel]) -> Decision:
    """A single-GPU job on MIG-only partitions: the smallest slice that holds its estimate + margin."""
    base = {"est_gib": _gib(estimate.total_bytes), "src": estimate.source, "margin_gib": _gib(int(margin))}
    profile, largest = mig_profile_for(int(estimate.total_bytes + margin), models)
    why = f"fits {profile.name} ({profile.usable_gib:.1f} GiB usable)" if profile else ""
    if profile is None:
        if largest is None:
            return _keep(request, "typed", "the partition's GPUs share no MIG profile; request unchanged", estimate)
        # an untyped gpu:1 would land on whichever slice is free, small ones included: the largest is the best bet
        profile, why = largest, f"needs more than any slice; the largest, {largest.name}, is the closest"
    new_value = format_gres([gpu.replaced("gpu", profile.name, 1) if item is gpu else item for item in per_node])
    record = {"v": RECORD_VERSION, "decision": "mig", **base, "old": request.tres_per_node, "new": new_value,
              "why": why}
    if estimate.detail:
        record["detail"] = estimate.detail[:120]
    message = (f"gpushare: estimated {base['est_gib']} GiB ({estimate.source}) + {base['margin_gib']} GiB margin "
               f"-> MIG slice gpu:{profile.name}:1")
    return Decision(action="modify", tres_per_node=new_value, record=record, user_message=message)


def _size_shared(request: SubmitRequest, per_node: list[GresItem], gpu: GresItem, estimate: Estimate,
                 cfg: Config, lanes: bool = False, queue: Queue | None = None, compute: str | None = None) -> Decision:
    """Shards for the estimate + margin (more than half the GPU for a heavy job), unless the job needs most
    of a GPU, or the queue has idle GPUs for it (``[policy] share_when``): then it keeps ``gpu:1``.
    ``queue`` None: shared whatever the queue (the script asked to share, or no gate applies)."""
    margin = max(estimate.total_bytes * cfg.policy.margin_fraction, cfg.policy.margin_min_gib * GiB)
    models = mig_models_for(request.partition, cfg)
    if models:  # a slice is isolated in hardware: lanes (a shard-side mechanism) do not apply there
        return _size_mig(request, per_node, gpu, estimate, margin, models)
    charged, lane_field = lane_charge(estimate) if lanes else (estimate.total_bytes, None)
    shards = max(1, math.ceil((charged + margin) / GiB))
    gpu_gib = smallest_cluster_gpu_gib(cfg)
    base = {"est_gib": _gib(estimate.total_bytes), "src": estimate.source, "margin_gib": _gib(int(margin))}
    if gpu_gib <= 0 or shards > cfg.policy.exclusive_above_fraction * gpu_gib:
        decision = _keep(request, "exclusive",
                         f"estimate+margin {shards} GiB exceeds {cfg.policy.exclusive_above_fraction:.0%} "
                         f"of a {gpu_gib} GiB GPU", estimate)
        decision.record.update(base)
        decision.user_message = (f"gpushare: estimated {base['est_gib']} GiB ({estimate.source}) "
                                 f"+ {base['margin_gib']} GiB margin needs most of a GPU; keeping gpu:1")
        return decision
    verdict = gate(cfg.policy.share_when, queue.pressure, queue.claimed) if queue is not None else None
    if verdict is not None and not verdict.share:
        decision = _keep(request, "idle-gpus", verdict.why, estimate)
        decision.record.update(base)
        decision.user_message = (f"gpushare: whole GPUs are free now, so this job keeps gpu:1 (it would be "
                                 f"shared with shard:{shards} when it has to wait)")
        return decision
    memory_shards = shards
    if cfg.policy.compute_sizing:
        shards = min(gpu_gib, max(shards, compute_shards(compute, gpu_gib)))
    sized = shards
    shards = share_shards(shards, gpu_gib, cfg.policy.max_jobs_per_gpu)
    new_items = [gpu.replaced("shard", None, shards) if item is gpu else item for item in per_node]
    new_value = format_gres(new_items)
    why = f"fits {memory_shards} of {gpu_gib} GiB"
    if sized > memory_shards:
        why += f"; compute heavy: {sized} shards, so no other heavy job pairs with it"
    if shards > sized:
        why += f"; {shards} shards, so at most {cfg.policy.max_jobs_per_gpu} jobs share the GPU"
    record = {"v": RECORD_VERSION, "decision": "shared", **base, "old": request.tres_per_node,
              "new": new_value, "why": why}
    if verdict is not None and queue is not None and queue.pressure is not None and cfg.policy.share_when != "always":
        record["queue"] = verdict.why[:160]
    if request.array:
        record["array"] = True
    if lane_field is not None:
        record["lanes"] = lane_field
    if estimate.detail:
        record["detail"] = estimate.detail[:120]
    message = shared_message(_gib(estimate.total_bytes), _gib(int(margin)), estimate.source, shards, cfg)
    if lane_field is not None:
        message += (f"; lanes: persistent {lane_field['p_gib']} GiB + ephemeral {lane_field['e_gib']} GiB"
                    + (" (no split known: a lane of its own)" if lane_field.get("own")
                       else f", charged 1/{LANE_SHARE} of its ephemeral memory"))
    return Decision(action="modify", tres_per_node=new_value, record=record, user_message=message)


def shared_message(est_gib: float, margin_gib: float, source: str, shards: int, cfg: Config) -> str:
    """What sbatch prints for a shared job, in one sentence a researcher can act on: that the GPU is
    shared (possibly with other users), the memory cap, what happens above it, how to keep a whole GPU."""
    above = ("it stops with a CUDA out-of-memory error and gpushare requeues it once on a whole GPU"
             if cfg.oom.max_retries > 0 else "it stops with a CUDA out-of-memory error")
    return (f"gpushare: this job now shares a GPU, possibly with other users' jobs: its GPU memory is capped at "
            f"{round(est_gib + margin_gib, 1)} GiB (estimated {est_gib} GiB from {source} + {margin_gib} GiB margin; "
            f"request shard:{shards}, 1 shard = 1 GiB); above the cap {above}; to keep a whole GPU, add "
            "'#GPUSHARE mode=exclusive' to the script")


def _keep(request: SubmitRequest, decision: str, why: str, estimate: Estimate | None = None) -> Decision:
    record: dict[str, Any] = {"v": RECORD_VERSION, "decision": decision, "old": request.tres_per_node, "why": why}
    if estimate is not None:
        record["est_gib"] = _gib(estimate.total_bytes)
        record["src"] = estimate.source
    return Decision(action="accept", record=record)
