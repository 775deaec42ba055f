"""OOM recovery's decision: requeue a job that ran out of GPU memory on a whole GPU (or a bigger MIG slice),
re-run a neighbour's victim on its own share, leave it failed, or nothing. Pure: one evidence record and the
settings in, an Action out; no I/O, no clock.

Recovery is gather → decide → act. The EpilogSlurmctld gathers (gpushare.epilog.oom_evidence: Slurm's record
of the job and the hook's environment, the logs' tail read as the job's user, the node agent's run records, the
ledger's counts, the cluster's GPU types and Slurm's release) into one :class:`OomEvidence`; :func:`decide`
judges it here; the hook and its executor act (gpushare.epilog.executor: hold, GRES, record, release, boost; the
user's note), and ``--finish`` and ``--resume`` continue that act from the ledger's entry, never deciding again.

Why these actions (docs/compatibility.md): a held job's GRES may change only within the same name and typed
form, so a ``shard`` job is re-sized to *all the shards of one GPU* (exclusive in effect, since shard
count = GiB of the GPU) rather than turned back into ``gpu:1``, and a MIG job moves to the next larger
profile of the same model. Requeue keeps the job id, so the user sees one job. A negative nice raises the
priority in both priority/basic and priority/multifactor, and survives ``scontrol release`` (a directly
set priority does not). Retries are bounded by ``[oom] max_retries``; the count comes from the ledger
and from the job's own record, whichever is higher, so neither a lost ledger nor a rewritten comment can
unbound it.

Why corroboration: a log line is the user's text. A ``shard:1`` job that prints PyTorch's OOM message and exits
1 would otherwise be re-run on a whole GPU, and many cheap jobs could repeat that. So the whole-GPU (or larger
MIG) re-run is granted only when root-written records agree that the job really filled its share
(:func:`corroborate`):

- the job was sized by gpushare (its ``gpushare:`` AdminComment record says ``decision: shared``); a job
  that asked for shards itself gets no free upgrade (MIG slices are exempt from this part: their memory
  limit is enforced by the hardware, and the upgrade is one profile);
- and the node agent measured the job's device memory at least ``[oom] corroborate_fraction`` of its share
  (gpushare.config.CORROBORATE_FRACTION by default, the fraction the agent also writes a job's peak at),
  either in the record's ``run.peak_gib`` (written by the agent and the node Epilog) or in the agent's run
  record of the job when the controller can read it (co-located or shared).

NVML reports no per-process "out of memory" event, so the device itself cannot testify; peak memory near
the cap is the evidence a real OOM leaves. ``[oom] corroborate = "no"`` restores trust in the log alone.

A *collateral* OOM (:func:`collateral_note`) is the other case: the job did not fill its share, but a
neighbour on its GPU was over its own cap when the job failed. The node agent, which saw the neighbour
over, wrote ``collateral: {by, gpu, at}`` into the job's record (AdminComment, and its run record); the
job is then re-run on its own share, the first time at no cost to its user, unless :func:`own_overrun`
shows the job was over its own cap as well: an offender is never a victim.
"""

from __future__ import annotations

import re
from collections.abc import Set
from dataclasses import dataclass, field
from typing import Any, Mapping, TypeGuard

from gpushare.config import Config
from gpushare.gpus import GiB, MigProfile, find_mig_profile
from gpushare.slurm import record as record_format
from gpushare.slurm.record import parse as parse_record
from gpushare.slurm.jobs import Job, log_paths
from gpushare.slurm.hostlist import expand_hostlist, first_host
from gpushare.slurm.gres_request import GresItem, GresRequest, format_gres

# EpilogSlurmctld sees the job while it is still COMPLETING; the exit status then tells failure apart.
RECOVERABLE_STATES = ("FAILED", "COMPLETING", "")
MAX_FREE_COLLATERAL = 1  # free collateral re-runs of one job; a later OOM, collateral or not, is charged
# How long after the agent first saw a neighbour over its cap a job's OOM still counts as collateral, on top of
# the backstop's grace: the neighbour is stopped by then, and a victim fails within seconds of its allocation.
COLLATERAL_SLACK_S = 60.0


@dataclass(frozen=True)
class OomVerdict:
    """What the job's log tails (or its TaskEpilog's report) say: gpushare.epilog.oom_detect.classify."""

    is_oom: bool
    reason: str  # one line, for the log and the ledger
    family: str | None = None
    message: str | None = None  # the matched line, cleaned and shortened
    source: str | None = None  # which log file it came from
    problems: tuple[str, ...] = field(default=())  # files we could not read, and why
    unread: bool = False  # it failed and no log could be read here (they may be on another host's disk)


def _int(text: str | None, default: int = 0) -> int:
    try:
        return int(str(text).strip())
    except (TypeError, ValueError):
        return default


def _exit_pair(text: str | None) -> tuple[int, int] | None:
    match = re.match(r"^\s*(\d+):(\d+)\s*$", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


@dataclass(frozen=True)
class JobFacts:
    """What the decision needs from ``scontrol show job`` (falling back to the hook's environment)."""

    job_id: str
    state: str  # JobState, e.g. FAILED, COMPLETED, CANCELLED, TIMEOUT
    exit_code: int
    exit_signal: int
    restarts: int
    gres: GresRequest  # its per-node GRES request ("gres:shard:12"), parsed once at Slurm's edge
    node: str  # first node the job ran on ("" unknown)
    uid: int | None
    gid: int | None
    log_paths: tuple[str, ...]  # StdErr first, then StdOut (absolute, deduplicated)
    record: dict[str, Any] | None  # our gpushare:{...} admin-comment record
    requeue_allowed: bool = True  # False for --no-requeue jobs: Slurm refuses requeuehold for them
    nice: int | None = None  # the job's own nice, given back after the requeue (release resets it)
    work_dir: str = ""  # its working directory (the OOM lesson of its training command is keyed with it)
    comment: str = ""  # the user's Comment: the TaskEpilog's OOM report from the node (gpushare.epilog.task_epilog)

    @classmethod
    def from_job(cls, job: Job | None, env: Mapping[str, str]) -> "JobFacts":
        """Combine the two views of a job, each used where it can be trusted.

        ``env`` is set by slurmctld itself (uid, gid, exit status, restart count, nodes): trusted.
        ``job`` is Slurm's structured record (gpushare.slurm.jobs.Job, from JSON on every release): state,
        GRES, admin comment, log paths. Text of ``scontrol show job`` is never read here: a job name or
        (26.05) the submit line can imitate its fields. None when Slurm no longer knows the job.
        """
        exit_pair = _exit_pair(env.get("SLURM_JOB_EXIT_CODE2"))
        if exit_pair is None and env.get("SLURM_JOB_EXIT_CODE"):  # raw wait status
            raw = _int(env.get("SLURM_JOB_EXIT_CODE"), 0)
            exit_pair = (raw >> 8 & 0xFF, raw & 0x7F)
        if exit_pair is None and job is not None and job.exit_status is not None:
            exit_pair = (job.exit_status, job.exit_signal or 0)
        exit_pair = exit_pair or (0, 0)
        node = first_host(env.get("SLURM_JOB_NODELIST") or (job.batch_host or job.nodes if job else ""))
        restarts = env.get("SLURM_JOB_RESTART_COUNT")
        return cls(
            job_id=env.get("SLURM_JOB_ID") or (job.job_id if job else ""),
            state=job.state if job else "",
            exit_code=exit_pair[0], exit_signal=exit_pair[1],
            restarts=_int(restarts, job.restarts if job else 0),
            gres=job.gres_per_node if job else GresRequest(),
            node=node,
            uid=_owner(env.get("SLURM_JOB_UID"), job.user_id if job else None),
            gid=_owner(env.get("SLURM_JOB_GID"), job.group_id if job else None),
            log_paths=log_paths(job, node) if job else (),
            record=parse_record(job.admin_comment) if job else None,
            requeue_allowed=job.requeue is not False if job else True,
            nice=job.nice if job else None,
            work_dir=job.work_dir if job else "",
            comment=job.comment if job else "",
        )


def _owner(env_value: str | None, json_value: Any) -> int | None:
    """A uid/gid from the hook's environment or squeue's JSON; None (never a guess) otherwise."""
    if env_value is not None and env_value.strip().isdigit():
        return int(env_value)
    if isinstance(json_value, int) and not isinstance(json_value, bool) and json_value >= 0:
        return json_value
    return None


@dataclass(frozen=True)
class Action:
    kind: str  # "requeue" | "stay_failed" | "none"
    reason: str
    new_gres: str | None = None
    nice: int | None = None  # scontrol nice= (negative raises priority)
    retry: int = 0  # which recovery this is (1-based) or how many were spent
    max_retries: int = 0
    oom: dict[str, Any] | None = None  # our entry in the job's gpushare: AdminComment record
    user_message: str = ""
    learn: bool = True  # False: the OOM was not corroborated, so the estimate cache must not learn from it
    charged: bool = True  # counts against the user's daily budget (False: collateral, the neighbour's doing)


@dataclass(frozen=True)
class OomEvidence:
    """Everything :func:`decide` judges one ended run of a job by, gathered once (gpushare.epilog.oom_evidence).

    Only ``job`` and ``verdict`` come from text the user can shape (the logs, through the verdict); the run
    records are the node agent's, in a folder only root writes, and the counts are the ledger's."""

    job: JobFacts  # Slurm's structured record and the hook's environment, with our gpushare: record
    verdict: OomVerdict  # the logs' tail as the job's user reads it, or the TaskEpilog's report from the node
    run_records: tuple[Mapping[str, Any], ...] = ()  # the agent's records of this run (``[agent] records_dir``)
    retries_used: int = 0  # the ledger's charged requeues of the job (Ledger.retries_used)
    free_reruns: int = 0  # the ledger's free collateral re-runs of the job (Ledger.free_reruns)
    user_recoveries: int = 0  # the ledger's requeues of this user's jobs in the last 24 hours
    mig_available: Set[str] | None = None  # GPU types the cluster's nodes offer (``sinfo``); None: unknown
    whole_gpu_as_gpu: bool = False  # the release accepts shard -> gpu on a held job (held_gres_across_names)
    ended_at: float = 0.0  # when the job ended (slurmctld's SLURM_JOB_END_TIME, else when the hook ran)


# --- the agent's evidence: measured peak, own overrun, a neighbour's overrun --------------------------------


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def failed_size_bytes(request: GresRequest, cfg: Config) -> int | None:
    """GPU memory the job had when it ran out: shards (1 GiB each) or its MIG slice; None if unknown."""
    for item in request.items:
        if item.name == "shard":
            return item.count * GiB
        if item.name == "gpu" and (profile := find_mig_profile(cfg.gpus.values(), item.type)):
            return profile.usable_bytes
    return None


def measured_peak_bytes(record: Mapping[str, Any] | None, run_records: tuple[Mapping[str, Any], ...]) -> int | None:
    """The largest device memory gpushare measured for this run of the job; None when nobody measured it."""
    peaks: list[int] = []
    run = (record or {}).get("run")
    if isinstance(run, dict) and _number(run.get("peak_gib")):
        peaks.append(int(float(run["peak_gib"]) * GiB))
    for entry in run_records:
        for gpu in (entry.get("gpus") or {}).values():
            value = gpu.get("peak_bytes") if isinstance(gpu, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                peaks.append(value)
    return max(peaks) if peaks else None


def collateral_note(record: Mapping[str, Any] | None, run_records: tuple[Mapping[str, Any], ...],
                    ended_at: float, window_s: float) -> dict[str, Any] | None:
    """The agent's note that a neighbour was over its cap on this job's GPU, when the job ended within
    ``window_s`` after the agent first saw it (and not before it, less a few seconds of clock skew
    between node and controller); None otherwise. Only root writes either place it is read from."""
    found: list[Any] = [(record or {}).get("collateral"), *(entry.get("collateral") for entry in run_records)]
    for note in found:
        if not isinstance(note, dict) or not isinstance(note.get("by"), str):
            continue
        at = note.get("at")
        if _number(at) and at - 5.0 <= ended_at <= at + window_s:
            return note
    return None


def own_overrun(record: Mapping[str, Any] | None, run_records: tuple[Mapping[str, Any], ...],
                request: GresRequest, cfg: Config) -> str | None:
    """What shows that this run of the job was itself over its GPU memory cap, from records only root writes:
    the node agent's backstop acted on it (``run.stop``, or an ``oom`` entry in its run record), or its
    measured peak exceeded its cap (``run.cap_gib`` / the run record's ``caps.mem_limit_mib``; its share when
    neither is known) by more than the backstop's tolerance, the agent's own test for an offender. None when
    nothing shows it.

    Why: two jobs over their caps on one GPU are each marked as the other's victim; a job over its own cap is
    an offender, never collateral."""
    run = (record or {}).get("run")
    run = run if isinstance(run, dict) else {}
    if run.get("stop") == "agent-backstop":
        return "the node agent's backstop acted on it"
    caps: list[int] = []
    cap_gib = run.get("cap_gib")
    if _number(cap_gib) and cap_gib > 0:
        caps.append(int(cap_gib * GiB))
    for entry in run_records:
        oom = entry.get("oom")
        if isinstance(oom, dict) and oom.get("source") == "agent-backstop":
            return "the node agent's backstop acted on it"
        limit = (entry.get("caps") or {}).get("mem_limit_mib") if isinstance(entry.get("caps"), dict) else None
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            caps.append(limit << 20)
    cap = min(caps) if caps else failed_size_bytes(request, cfg)
    peak = measured_peak_bytes(record, run_records)
    tolerance = cfg.agent.backstop_tolerance_mib << 20
    if cap and peak is not None and peak > cap + tolerance:
        return f"its measured GPU memory peaked at {peak / GiB:.1f} GiB, over its {cap / GiB:.1f} GiB cap"
    return None


def _is_mig(request: GresRequest, cfg: Config) -> bool:
    return any(find_mig_profile(cfg.gpus.values(), item.type) for item in request.named("gpu"))


def corroborate(cfg: Config, record: Mapping[str, Any] | None, request: GresRequest,
                run_records: tuple[Mapping[str, Any], ...]) -> tuple[bool, str]:
    """(True, evidence) when the OOM is backed by our own records, else (False, what is missing)."""
    if cfg.oom.corroborate == "no":
        return True, "not checked ([oom] corroborate = no)"
    if not _is_mig(request, cfg) and (record or {}).get("decision") != "shared":
        return False, "its GPU share was not sized by gpushare (no 'shared' decision in its record)"
    share = failed_size_bytes(request, cfg)
    if not share:
        return False, f"the size of its GPU share ({request.text[:60]!r}) is unknown"
    peak = measured_peak_bytes(record, run_records)
    if peak is None:
        return False, "no measurement of its GPU memory (node agent) backs the message"
    need = cfg.oom.corroborate_fraction * share
    if peak < need:
        return False, (f"its measured GPU memory peaked at {peak / GiB:.1f} GiB, below "
                       f"{cfg.oom.corroborate_fraction:.0%} of its {share / GiB:.1f} GiB share")
    return True, f"measured peak {peak / GiB:.1f} GiB of a {share / GiB:.1f} GiB share"


# --- hostlists and GPU sizes ------------------------------------------------------------------------


def whole_gpu_shards(cfg: Config, node: str) -> int:
    """Shards of one GPU of ``node`` (= its GiB); unknown node: the largest configured GPU's."""
    sizes = []
    for group in cfg.nodes:
        shards = cfg.gpu(group.gpu).shards
        if node and node in expand_hostlist(group.names):
            return shards
        sizes.append(shards)
    if not sizes:
        sizes = [cfg.gpu(name.partition(":")[0]).shards for name in cfg.estimator.gpus]
    return max(sizes) if sizes else 0


def node_model(cfg: Config, node: str) -> str | None:
    """Catalogue name of the GPU model of ``node`` per ``[[nodes]]`` (None when not listed)."""
    for group in cfg.nodes:
        if node and node in expand_hostlist(group.names):
            return group.gpu.lower()
    return None


def next_mig_profile(cfg: Config, profile_name: str, available: Set[str] | None = None,
                     model_name: str | None = None) -> MigProfile | None:
    """The smallest profile with more memory than ``profile_name`` on the same GPU model (None: none).

    Profile names repeat across models (``1g.10gb`` is an A100-40GB 1g.2x and an A100-80GB 1g), so the
    node's own model is tried first, and only types the cluster offers (``available``) are chosen.
    """
    models = sorted(cfg.gpus.values(), key=lambda m: m.name != model_name)
    for model in models:
        current = model.find_mig_profile(profile_name)
        if current is None:
            continue
        bigger = [p for p in model.mig_profiles if p.usable_bytes > current.usable_bytes
                  and not p.media_extensions and (available is None or p.name in available)]
        if bigger:
            return min(bigger, key=lambda p: (p.usable_bytes, p.compute_slices))
    return None


def is_mig_type(cfg: Config, type_name: str | None) -> bool:
    return find_mig_profile(cfg.gpus.values(), type_name) is not None


# --- the decision -----------------------------------------------------------------------------------


def _bigger_request(job: JobFacts, cfg: Config, mig_available: Set[str] | None,
                    whole_gpu_as_gpu: bool = False) -> tuple[str | None, str]:
    """(new tres_per_node, why) or (None, why not).

    A shard job's larger run is a whole GPU: ``gpu:1`` where Slurm lets a held job change GRES across
    names (24.11+, measured on the requeuehold path), so it may land on a GPU of any size; on 22.05, which
    refuses that, all the shards of the largest GPU it could land on (exclusive in effect).
    """
    if job.gres.error:
        return None, f"GRES {job.gres.text!r} not understood ({job.gres.error})"
    new_items: list[GresItem] = []
    changed = []
    for item in job.gres.items:
        if item.name == "shard":
            whole = whole_gpu_shards(cfg, job.node)
            if whole <= item.count:
                return None, f"it already had all {item.count} shards of a GPU"
            if whole_gpu_as_gpu:
                new_items.append(item.replaced("gpu", None, 1))
                changed.append(f"shard:{item.count} -> gpu:1")
            else:
                new_items.append(item.replaced("shard", item.type, whole))
                changed.append(f"shard:{item.count} -> shard:{whole}")
        elif item.name == "gpu" and is_mig_type(cfg, item.type):
            bigger = next_mig_profile(cfg, str(item.type), mig_available, node_model(cfg, job.node))
            if bigger is None:
                return None, f"no larger MIG profile than {item.type} is available"
            new_items.append(item.replaced("gpu", bigger.name, item.count))
            changed.append(f"gpu:{item.type} -> gpu:{bigger.name}")
        elif item.name == "gpu":
            return None, f"it already had whole GPUs ({item.format()}); it needs more memory than one GPU"
        elif item.name == "mps":
            return None, f"{item.format()} carries no memory size to enlarge (only shard and MIG jobs are)"
        else:
            new_items.append(item)
    if not changed:
        return None, "it asked for no shared GPU or MIG slice"
    return format_gres(new_items), ", ".join(changed)


def merge_oom_comment(existing: str | None, oom: dict[str, Any]) -> str | None:
    """``existing`` AdminComment with our ``oom`` entry merged in; None when the comment is someone
    else's (not ``gpushare:``), which is never overwritten.

    Why merge at write time: the node agent and Epilog also write this comment (read-modify-write), so
    we keep their keys and re-apply ours once the job has finished completing (gpushare.epilog.executor.finish).
    The entry holds no text from the job, so scontrol's ``Key=Value`` output stays parseable. The agent's
    ``collateral`` note is dropped: it was about the run that just ended, never about the next one.
    """
    if existing and parse_record(existing) is None:
        return None
    kept = {k: v for k, v in (parse_record(existing) or {}).items() if k != "collateral"}
    return record_format.render({**kept, "oom": oom})


def decide(evidence: OomEvidence, cfg: Config) -> Action:
    """Choose the action for one ended job from its evidence and the settings. Never raises on job content.

    The log's OOM message is corroborated by the agent's measurements (:func:`corroborate`); a job the agent
    marked a neighbour's victim (:func:`collateral_note`, within the backstop's grace plus
    ``COLLATERAL_SLACK_S`` of the mark) is re-run on its own share unless it was over its own cap too
    (:func:`own_overrun`); ``evidence.retries_used`` counts the charged requeues only, and
    ``evidence.user_recoveries`` the requeues this user's jobs already got in the last 24 hours (the ledger's
    per-user budget).
    """
    job, verdict = evidence.job, evidence.verdict
    if not verdict.is_oom:
        return Action("none", verdict.reason)
    if job.state not in RECOVERABLE_STATES:
        return Action("none", f"state {job.state}: only failed jobs are recovered")
    limit = cfg.oom.max_retries
    previous = (job.record or {}).get("oom")
    spent = max(evidence.retries_used, _int(previous.get("n")) if isinstance(previous, dict) else 0)
    family = verdict.family or "unknown"
    free_used = max(evidence.free_reruns, _int(previous.get("coll")) if isinstance(previous, dict) else 0)
    budget = cfg.oom.max_recoveries_per_user_day
    user_recoveries = evidence.user_recoveries
    note = collateral_note(job.record, evidence.run_records, evidence.ended_at,
                           cfg.agent.backstop_grace_s + COLLATERAL_SLACK_S)
    # a job over its own cap is an offender, whoever else was over beside it
    if note is not None and own_overrun(job.record, evidence.run_records, job.gres, cfg) is None:
        victim = _collateral(job, note, spent, limit, family, cfg, free_used,
                             budget_left=not budget or user_recoveries < budget)
        if victim is not None:
            return victim
    if spent >= limit:
        why = (f"GPU out of memory again after {spent} recovery retr{'y' if spent == 1 else 'ies'}"
               if spent else "GPU out of memory; recovery is off ([oom] max_retries = 0)")
        return Action("stay_failed", f"{why}; not requeued ([oom] max_retries = {limit})", retry=spent,
                      max_retries=limit,
                      user_message=f"gpushare: {why} ({family}); the job stays failed. Ask for more GPU memory "
                                   f"(#GPUSHARE mem=..., or --gres=gpu:1) and resubmit.")
    if not job.requeue_allowed:
        return Action("stay_failed", "GPU out of memory, not requeued: the job was submitted with --no-requeue",
                      retry=spent, max_retries=limit,
                      user_message=f"gpushare: the job ran out of GPU memory ({family}); it was submitted with "
                                   "--no-requeue, so it was not re-run on a whole GPU.")
    new_gres, why = _bigger_request(job, cfg, evidence.mig_available, evidence.whole_gpu_as_gpu)
    if new_gres is None:
        return Action("stay_failed", f"GPU out of memory, not requeued: {why}", retry=spent, max_retries=limit,
                      user_message=f"gpushare: the job ran out of GPU memory ({family}) and was not requeued: "
                                   f"{why}.")
    backed, backing = corroborate(cfg, job.record, job.gres, evidence.run_records)
    if not backed:
        return Action("stay_failed", f"GPU out of memory reported but not corroborated, not requeued: {backing}",
                      retry=spent, max_retries=limit, learn=False,
                      user_message=f"gpushare: the job's log reports a GPU out-of-memory error ({family}), but "
                                   f"gpushare's own measurements do not confirm it ({backing}); the job was not "
                                   "re-run on a larger GPU share. Ask for more GPU memory and resubmit.")
    if budget and user_recoveries >= budget:
        why = f"this user's jobs already got {user_recoveries} OOM recoveries in 24 hours"
        return Action("stay_failed", f"GPU out of memory, not requeued: {why} "
                                     f"([oom] max_recoveries_per_user_day = {budget})",
                      retry=spent, max_retries=limit,
                      user_message=f"gpushare: the job ran out of GPU memory ({family}) and was not requeued: {why}, "
                                   "the daily limit. Ask for more GPU memory and resubmit.")
    retry = spent + 1
    oom = {"n": retry, "max": limit, "fam": family, "from": job.gres.text, "to": new_gres,
           **({"coll": free_used} if free_used else {})}  # the free re-run stays spent
    shown = f"; {backing}" if backing else ""  # what corroborated it, for the admin reading the log
    return Action("requeue", f"GPU out of memory ({family}); requeue with {why}{shown}", new_gres=new_gres,
                  nice=(job.nice or 0) - cfg.oom.priority_boost, retry=retry, max_retries=limit, oom=oom,
                  user_message=f"gpushare: the job ran out of GPU memory ({family}); requeued with {why}, "
                               f"eligible at once (recovery {retry} of {limit}).")


def _collateral(job: JobFacts, note: dict[str, Any] | None, spent: int, limit: int, family: str, cfg: Config,
                free_used: int, budget_left: bool) -> Action | None:
    """A victim's OOM (a neighbour over its cap on its GPU, the job itself not over its own): re-run at once
    on its own share, nothing learned (its estimate was right), the offender named in its record. The first
    such re-run is free (its recovery retries and its user's daily budget untouched); a job that ends in
    another OOM after it is charged like any recovery (a retry and the budget), so a job is re-run at most
    ``max_retries`` + 1 times whatever notes it carries. None when not collateral, or when a charged re-run
    is not left (the usual rules then decide)."""
    if note is None or not job.requeue_allowed or not job.gres.text:
        return None
    free = free_used < MAX_FREE_COLLATERAL
    if not free and (spent >= limit or not budget_left):
        return None
    offender = str(note.get("by"))[:40]
    why = f"job {offender}" if offender.isdigit() else offender
    retry = spent if free else spent + 1
    oom = {"n": retry, "max": limit, "fam": family, "from": job.gres.text, "to": job.gres.text,
           "coll": free_used + 1 if free else free_used, "by": offender}
    cost = ("This does not count against your OOM recoveries." if free else
            f"It had a free re-run after a neighbour's overrun already; this one counts (recovery {retry} of {limit}).")
    return Action("requeue", f"GPU out of memory while {why} was over its GPU memory cap on GPU {note.get('gpu')} "
                             f"(collateral{'' if free else ', charged'}); requeue on its own share",
                  new_gres=job.gres.text, nice=(job.nice or 0) - cfg.oom.priority_boost, retry=retry,
                  max_retries=limit, oom=oom, learn=False, charged=not free,
                  user_message=f"gpushare: the job ran out of GPU memory ({family}) while {why} on the same GPU was "
                               f"over its own memory cap; requeued at once on the same share. {cost}")


def log_not_kept(action: Action, why: str) -> Action:
    """``action`` (a requeue) not carried out because the failed run's log could not be copied aside first
    (gpushare.user_files.keep_logs): the rerun would truncate it, and the failed run's output, with its error,
    would be gone. The job stays failed, its log whole, its retries and its user's budget untouched."""
    spent = action.retry - 1 if action.charged else action.retry
    return Action("stay_failed", f"GPU out of memory, not requeued: the failed run's log could not be kept "
                                 f"({why[:200]}), and a rerun would truncate it", retry=spent,
                  max_retries=action.max_retries, learn=action.learn,
                  user_message="gpushare: the job ran out of GPU memory and was not re-run: a copy of its log could "
                               "not be made, and a rerun would have overwritten it. Ask for more GPU memory and "
                               "resubmit.")
