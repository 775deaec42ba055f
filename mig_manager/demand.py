"""The demand signal: pending jobs asking for MIG profiles, turned into a target layout for one node.

Why from the queue: Slurm only schedules onto GRES that exist, so a job asking for ``gpu:3g.20gb:1`` on a
cluster where every GPU is one ``7g.40gb`` waits forever unless someone reshapes a GPU. The pending
jobs' own requests (``tres_per_node`` in ``squeue --json``) say which profiles are wanted; the planner
(MIGM §4.2) says which idle instances to destroy and where to create, and the executor applies it.

Job fields are written by users and read here by a root daemon, so they are treated as hostile: only
the structured state, reason, partition, priority, submit time, id and GRES requests of each
:class:`~gpushare.slurm.jobs.Job` are read; a GRES item must match a strict pattern and name a profile of
this node's GPU model; counts are capped, per job and per user, and a job counts only after a minimum
time pending. Only jobs waiting for resources count: a held job
(``JobHeldUser``, priority 0) or one waiting on a dependency or a begin time would otherwise let any user
force reshapes that nobody runs on.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpushare.gpus import GpuModel
from gpushare.slurm.hostlist import expand_hostlist
from gpushare.slurm.jobs import Job

from gpushare.mig_manager.device_ops import Layout
from gpushare.policy.layout import Instance
from gpushare.policy.planner import Plan, plan

_ITEM_RE = re.compile(r"^(?:gres[:/])?gpu:([A-Za-z0-9_.+-]{1,40}):([0-9]{1,3})\Z")
MAX_PER_JOB = 7  # no GPU holds more instances than this; a larger count cannot be one node's MIG demand


@dataclass(frozen=True)
class Want:
    """One wanted instance, with the job that asks for it (for messages)."""

    profile: str
    job_id: str


def mig_request(tres_per_node: str, profiles: Iterable[str]) -> Counter[str]:
    """MIG profiles requested by one ``tres_per_node`` value; anything else (or malformed) counts for nothing."""
    known = {p.lower() for p in profiles}
    out: Counter[str] = Counter()
    for item in str(tres_per_node)[:512].split(","):
        match = _ITEM_RE.match(item.strip())
        if not match:
            continue
        name, count = match.group(1).lower(), int(match.group(2))
        if name in known and 0 < count <= MAX_PER_JOB:
            out[name] += count
    return out


# state_reason values of a job that waits only for resources (anything else, held or blocked, is no demand)
_WAITING_FOR_RESOURCES = ("None", "Resources", "Priority", "ReqNodeNotAvail", "Nodes_required_for_job")


def waits_for_resources(job: Job) -> bool:
    return job.pending and not job.held and job.reason.startswith(_WAITING_FOR_RESOURCES)


def pins_elsewhere(job: Job, node: str) -> bool:
    """True when the job's ``-w`` node list leaves out ``node`` (or cannot be read: no demand on a guess).

    Why: a job pinned to a drained or down node waits with ``ReqNodeNotAvail`` forever; without this
    check it counted as demand on every MIG node, and any user could reshape nodes it can never run on."""
    if not node or not job.required_nodes:
        return False
    try:
        return node not in expand_hostlist(job.required_nodes, limit=100_000, strict=True)
    except ValueError:
        return True


def pending_wants(jobs: Iterable[Job], profiles: Iterable[str], partitions: Sequence[str] = (),
                  min_age_s: float = 0.0, max_per_user: int = 0, now: float | None = None,
                  node: str = "") -> list[Want]:
    """Wanted instances from jobs waiting for resources, highest priority (then oldest) first.

    ``min_age_s``: a job counts only once it has been pending that long (a job submitted and cancelled
    in between reshape checks, to drain the node, is no demand). ``max_per_user`` (0: no cap): at most
    that many wanted instances per user, so one user cannot make a node's whole layout theirs. ``node``:
    the node asking; a job pinned (``-w``) to other nodes is no demand on it.
    """
    names = tuple(profiles)
    now = time.time() if now is None else now
    rows = []
    for job in jobs:
        if not waits_for_resources(job):
            continue
        if min_age_s > 0 and (job.submit_time is None or now - job.submit_time < min_age_s):
            continue
        if partitions and not ({p for p in job.partition.split(",") if p} & set(partitions)):
            continue
        if pins_elsewhere(job, node):
            continue
        asked = mig_request(job.tres_per_node, names)
        if not asked:
            continue
        key = (-(job.priority or 0), job.submit_time or 0)
        rows.append((key, job.job_id[:20], asked, job.user_id))
    rows.sort(key=lambda r: r[0])
    per_user: Counter[int | None] = Counter()
    wants = []
    for _, job_id, asked, user in rows:
        for name, n in sorted(asked.items()):
            for _ in range(n):
                if max_per_user and per_user[user] >= max_per_user:
                    break
                per_user[user] += 1
                wants.append(Want(name, job_id))
    return wants


def held_profiles(running: Mapping[str, Counter[str]]) -> Counter[str]:
    """GPU types held by the node's running jobs (from SlurmActions.running_gpu_jobs)."""
    total: Counter[str] = Counter()
    for types in running.values():
        total.update(types)
    return total


def mark_busy(instances: Sequence[Instance], held: Counter[str], busy_placements: set[tuple[str, int]]
              ) -> tuple[Instance, ...]:
    """Instances flagged busy for the planner: a process in them, or a running job on their profile.

    Conservative on purpose: Slurm's device index is not mapped back to a placement, so every instance of
    a profile that some running job holds counts as busy (an untyped ``gpu`` job, ``*``, makes all busy).
    """
    everything = "*" in held
    return tuple(Instance(i.profile, i.start, everything or i.profile in held or i.placement in busy_placements)
                 for i in instances)


def target_for(models: Mapping[int, GpuModel], current: Mapping[int, Sequence[Instance]],
               wants: Sequence[Want], served: list[Want] | None = None) -> tuple[Layout, list[str]]:
    """Greedy over the node's GPUs: each GPU serves what it can of the remaining wants.

    Returns the target (only GPUs whose layout changes) and one note per GPU plan. Wants a GPU cannot
    serve without touching a busy instance are left for the next GPU. ``served`` (when given) receives
    the wants this node serves, by reuse or by the target, so a caller planning several nodes can
    offer the rest to the next one.
    """
    remaining = list(wants)
    target: Layout = {}
    notes: list[str] = []
    for gpu in sorted(current):
        if not remaining:
            break
        model = models[gpu]
        names = {p.name for p in model.mig_profiles}
        mine = [w for w in remaining if w.profile in names]
        if not mine:
            continue
        result: Plan = plan(model, current[gpu], [w.profile for w in mine])
        chosen = {i for i in range(len(mine)) if i not in result.unmet}
        if result.actions:
            target[gpu] = tuple(Instance(i.profile, i.start) for i in result.final)
            notes.append(f"GPU {gpu}: " + "; ".join(a.text() for a in result.actions))
        notes.extend(f"GPU {gpu}: {result.notes[i]}" for i in result.unmet)
        taken = [mine[i] for i in chosen]
        for want in taken:
            remaining.remove(want)
        if served is not None:
            served.extend(taken)
    return target, notes
