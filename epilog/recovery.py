"""What to do with a job that ended: requeue it on a whole GPU (or a bigger MIG slice), leave it failed,
or nothing. Pure: job facts, the OOM verdict and the config in, an Action out; no I/O, no clock.

Why these actions (SLURM-FACTS.md): a held job's GRES may change only within the same name and typed
form, so a ``shard`` job is re-sized to *all the shards of one GPU* (exclusive in effect, since shard
count = GiB of the GPU) rather than turned back into ``gpu:1``, and a MIG job moves to the next larger
profile of the same model. Requeue keeps the job id, so the user sees one job. A negative nice raises the
priority in both priority/basic and priority/multifactor, and survives ``scontrol release`` (a directly
set priority does not). Retries are bounded by ``[oom] max_retries``; the count comes from the ledger
and from the job's own record, whichever is higher, so neither a lost ledger nor a rewritten comment can
unbound it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

from gpushare.epilog.oom_detect import OomVerdict
from gpushare.config import Config
from gpushare.gpus import MigProfile
from gpushare.slurm_plugins.decision import RECORD_PREFIX, parse_record
from gpushare.slurm.gres_request import GresItem, format_gres, parse_gres

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
    tres_per_node: str  # "gres:shard:12"; "" when the job asked for no per-node GRES
    node: str  # first node the job ran on ("" unknown)
    uid: int | None
    gid: int | None
    log_paths: tuple[str, ...]  # StdErr first, then StdOut (absolute, deduplicated)
    record: dict[str, Any] | None  # our gpushare:{...} admin-comment record
    requeue_allowed: bool = True  # False for --no-requeue jobs: Slurm refuses requeuehold for them

    @classmethod
    def from_slurm(cls, fields: Mapping[str, str], env: Mapping[str, str],
                   structured: Mapping[str, Any] | None = None) -> "JobFacts":
        """Combine the three views of a job, each used only where it can be trusted.

        ``env`` is set by slurmctld itself (uid, gid, exit status, restart count, nodes): trusted.
        ``structured`` is squeue's JSON for the job: trusted structure (state, GRES, admin comment).
        ``fields`` is parsed ``scontrol show job -o`` text, where a job name or comment can imitate a
        later ``Key=`` (measured: ``-J 'a UserId=root(0)'`` is printed verbatim), so identity never
        comes from it; it supplies the log paths (Slurm expands ``%j`` there, not in the environment),
        which is safe because logs are only ever opened with the job owner's credentials.
        """
        js = structured or {}
        exit_pair = _exit_pair(env.get("SLURM_JOB_EXIT_CODE2"))
        if exit_pair is None and env.get("SLURM_JOB_EXIT_CODE"):  # raw wait status
            raw = _int(env.get("SLURM_JOB_EXIT_CODE"), 0)
            exit_pair = (raw >> 8 & 0xFF, raw & 0x7F)
        if exit_pair is None and isinstance(js.get("exit_code"), int):
            exit_pair = (js["exit_code"] >> 8 & 0xFF, js["exit_code"] & 0x7F)
        exit_pair = exit_pair or _exit_pair(fields.get("ExitCode")) or (0, 0)
        node = env.get("SLURM_JOB_NODELIST") or str(js.get("batch_host") or js.get("nodes") or "") \
            or fields.get("BatchHost") or fields.get("NodeList") or ""
        work_dir = fields.get("WorkDir") or env.get("SLURM_JOB_WORK_DIR") or ""
        paths: list[str] = []
        for key in ("StdErr", "StdOut"):
            path = fields.get(key) or ""
            if path and not path.startswith("/") and work_dir.startswith("/"):
                path = f"{work_dir.rstrip('/')}/{path}"
            if path.startswith("/") and path not in paths and path != "/dev/null":
                paths.append(path)
        tres = str(js["tres_per_node"]) if "tres_per_node" in js else fields.get("TresPerNode", "")
        state = str(js["job_state"]) if js.get("job_state") else fields.get("JobState", "")
        restarts = env.get("SLURM_JOB_RESTART_COUNT") or js.get("restart_cnt") or fields.get("Restarts")
        return cls(
            job_id=env.get("SLURM_JOB_ID") or str(js.get("job_id") or fields.get("JobId") or ""),
            state=state.upper(),
            exit_code=exit_pair[0], exit_signal=exit_pair[1],
            restarts=_int(restarts, 0),
            tres_per_node="" if tres == "(null)" else tres,
            node=_first_host(node),
            uid=_owner(env.get("SLURM_JOB_UID"), js.get("user_id")),
            gid=_owner(env.get("SLURM_JOB_GID"), js.get("group_id")),
            log_paths=tuple(paths),
            record=parse_record(str(js["admin_comment"]) if "admin_comment" in js else fields.get("AdminComment")),
            requeue_allowed=js["requeue"] if isinstance(js.get("requeue"), bool) else fields.get("Requeue") != "0",
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


# --- hostlists and GPU sizes ------------------------------------------------------------------------


def expand_hostlist(expr: str, limit: int = 100000) -> list[str]:
    """``gpu[01-03,07],cpu1`` → names (one bracket group per name, as site configs use)."""
    names: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", expr):
        match = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", part)
        if not match:
            names.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            low, _, high = item.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                continue
            for number in range(int(low), int(high or low) + 1):
                names.append(f"{prefix}{str(number).zfill(len(low))}{suffix}")
                if len(names) >= limit:
                    return names
    return names


def _first_host(expr: str) -> str:
    names = expand_hostlist(expr, limit=1)
    return names[0] if names else ""


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
        current = next((p for p in model.mig_profiles if p.name == profile_name), None)
        if current is None:
            continue
        bigger = [p for p in model.mig_profiles if p.usable_bytes > current.usable_bytes
                  and not p.media_extensions and (available is None or p.name in available)]
        if bigger:
            return min(bigger, key=lambda p: (p.usable_bytes, p.compute_slices))
    return None


def is_mig_type(cfg: Config, type_name: str | None) -> bool:
    return bool(type_name) and any(p.name == type_name for m in cfg.gpus.values() for p in m.mig_profiles)


# --- the decision -----------------------------------------------------------------------------------


def _bigger_request(job: JobFacts, cfg: Config, mig_available: set[str] | None) -> tuple[str | None, str]:
    """(new tres_per_node, why) or (None, why not)."""
    try:
        items = parse_gres(job.tres_per_node)
    except ValueError as exc:
        return None, f"GRES {job.tres_per_node!r} not understood ({exc})"
    new_items: list[GresItem] = []
    changed = []
    for item in items:
        if item.name == "shard":
            whole = whole_gpu_shards(cfg, job.node)
            if whole <= item.count:
                return None, f"it already had all {item.count} shards of a GPU"
            new_items.append(GresItem("shard", item.type, whole))
            changed.append(f"shard:{item.count} -> shard:{whole}")
        elif item.name == "gpu" and is_mig_type(cfg, item.type):
            bigger = next_mig_profile(cfg, str(item.type), mig_available, node_model(cfg, job.node))
            if bigger is None:
                return None, f"no larger MIG profile than {item.type} is available"
            new_items.append(GresItem("gpu", bigger.name, item.count))
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


MAX_COMMENT = 900  # as the submit and agent writers: ``scontrol show job`` stays readable


def merge_oom_comment(existing: str | None, oom: dict[str, Any]) -> str | None:
    """``existing`` AdminComment with our ``oom`` entry merged in; None when the comment is someone
    else's (not ``gpushare:``), which is never overwritten.

    Why merge at write time: the node agent and Epilog also write this comment (read-modify-write), so
    we keep their keys and re-apply ours once the job has finished completing (gpushare.epilog.executor.finish).
    The entry holds no text from the job, so scontrol's ``Key=Value`` output stays parseable.
    """
    if existing and not existing.startswith(RECORD_PREFIX):
        return None
    record = parse_record(existing) or {"v": 1}
    record["oom"] = oom
    text = RECORD_PREFIX + json.dumps(record, separators=(",", ":"), sort_keys=True)
    if len(text) > MAX_COMMENT:
        record.pop("detail", None)
        record["why"] = str(record.get("why", ""))[:80]
        text = RECORD_PREFIX + json.dumps(record, separators=(",", ":"), sort_keys=True)
    return text if len(text) <= MAX_COMMENT else None


def decide(job: JobFacts, verdict: OomVerdict, cfg: Config, retries_used: int,
           mig_available: set[str] | None = None) -> Action:
    """Choose the action for one ended job. Never raises on job content."""
    if not verdict.is_oom:
        return Action("none", verdict.reason)
    if job.state not in RECOVERABLE_STATES:
        return Action("none", f"state {job.state}: only failed jobs are recovered")
    limit = cfg.oom.max_retries
    previous = (job.record or {}).get("oom")
    spent = max(retries_used, _int(previous.get("n")) if isinstance(previous, dict) else 0)
    family = verdict.family or "unknown"
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
    new_gres, why = _bigger_request(job, cfg, mig_available)
    if new_gres is None:
        return Action("stay_failed", f"GPU out of memory, not requeued: {why}", retry=spent, max_retries=limit,
                      user_message=f"gpushare: the job ran out of GPU memory ({family}) and was not requeued: "
                                   f"{why}.")
    retry = spent + 1
    oom = {"n": retry, "max": limit, "fam": family, "from": job.tres_per_node, "to": new_gres}
    return Action("requeue", f"GPU out of memory ({family}); requeue with {why}", new_gres=new_gres,
                  nice=-cfg.oom.priority_boost, retry=retry, max_retries=limit, oom=oom,
                  user_message=f"gpushare: the job ran out of GPU memory ({family}); requeued with {why} at raised "
                               f"priority (recovery {retry} of {limit}).")
