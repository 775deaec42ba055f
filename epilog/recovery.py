"""What to do with a job that ended: requeue it on a whole GPU (or a bigger MIG slice), leave it failed,
or nothing. Pure: job facts, the OOM verdict and the config in, an Action out; no I/O, no clock.

Why these actions (docs/compatibility.md): a held job's GRES may change only within the same name and typed
form, so a ``shard`` job is re-sized to *all the shards of one GPU* (exclusive in effect, since shard
count = GiB of the GPU) rather than turned back into ``gpu:1``, and a MIG job moves to the next larger
profile of the same model. Requeue keeps the job id, so the user sees one job. A negative nice raises the
priority in both priority/basic and priority/multifactor, and survives ``scontrol release`` (a directly
set priority does not). Retries are bounded by ``[oom] max_retries``; the count comes from the ledger
and from the job's own record, whichever is higher, so neither a lost ledger nor a rewritten comment can
unbound it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from gpushare.epilog.oom_detect import OomVerdict
from gpushare.config import Config
from gpushare.gpus import MigProfile, find_mig_profile
from gpushare.slurm import record as record_format
from gpushare.slurm.record import parse as parse_record
from gpushare.slurm.jobs import Job, log_paths
from gpushare.slurm.hostlist import expand_hostlist, first_host
from gpushare.slurm.gres_request import GresItem, GresRequest, format_gres

# EpilogSlurmctld sees the job while it is still COMPLETING; the exit status then tells failure apart.
RECOVERABLE_STATES = ("FAILED", "COMPLETING", "")


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


def next_mig_profile(cfg: Config, profile_name: str, available: set[str] | None = None,
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


def _bigger_request(job: JobFacts, cfg: Config, mig_available: set[str] | None,
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


MAX_FREE_COLLATERAL = 1  # free collateral re-runs of one job; a later OOM, collateral or not, is charged


def decide(job: JobFacts, verdict: OomVerdict, cfg: Config, retries_used: int,
           mig_available: set[str] | None = None, corroboration: tuple[bool, str] = (True, ""),
           user_recoveries: int = 0, whole_gpu_as_gpu: bool = False,
           collateral: dict[str, Any] | None = None, overran: str | None = None, free_reruns: int = 0) -> Action:
    """Choose the action for one ended job. Never raises on job content.

    ``corroboration`` is gpushare.epilog.corroborate's verdict on the log message; ``user_recoveries``
    the requeues this user's jobs already got in the last 24 hours (the ledger's per-user budget);
    ``whole_gpu_as_gpu``: the Slurm release accepts ``shard`` → ``gpu`` on a held job
    (``SlurmVersion.held_gres_across_names``); ``collateral``: the agent's note that a neighbour was over its
    cap on the job's GPU when it failed (gpushare.epilog.corroborate.collateral_evidence); ``overran``: what
    shows the job was over its own cap too (gpushare.epilog.corroborate.own_overrun), which makes it no
    victim; ``free_reruns``: the free collateral re-runs the ledger counted for it. ``retries_used`` counts
    the charged requeues only (gpushare.epilog.ledger.Ledger.retries_used).
    """
    if not verdict.is_oom:
        return Action("none", verdict.reason)
    if job.state not in RECOVERABLE_STATES:
        return Action("none", f"state {job.state}: only failed jobs are recovered")
    limit = cfg.oom.max_retries
    previous = (job.record or {}).get("oom")
    spent = max(retries_used, _int(previous.get("n")) if isinstance(previous, dict) else 0)
    family = verdict.family or "unknown"
    free_used = max(free_reruns, _int(previous.get("coll")) if isinstance(previous, dict) else 0)
    budget = cfg.oom.max_recoveries_per_user_day
    if overran is None:  # a job over its own cap is an offender, whoever else was over beside it
        victim = _collateral(job, collateral, spent, limit, family, cfg, free_used,
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
    new_gres, why = _bigger_request(job, cfg, mig_available, whole_gpu_as_gpu)
    if new_gres is None:
        return Action("stay_failed", f"GPU out of memory, not requeued: {why}", retry=spent, max_retries=limit,
                      user_message=f"gpushare: the job ran out of GPU memory ({family}) and was not requeued: "
                                   f"{why}.")
    backed, evidence = corroboration
    if not backed:
        return Action("stay_failed", f"GPU out of memory reported but not corroborated, not requeued: {evidence}",
                      retry=spent, max_retries=limit, learn=False,
                      user_message=f"gpushare: the job's log reports a GPU out-of-memory error ({family}), but "
                                   f"gpushare's own measurements do not confirm it ({evidence}); the job was not "
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
    backing = f"; {evidence}" if evidence else ""  # what corroborated it, for the admin reading the log
    return Action("requeue", f"GPU out of memory ({family}); requeue with {why}{backing}", new_gres=new_gres,
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
