"""The asynchronous-estimation state machine: held jobs and estimation jobs in, actions out.

Pure (docs/style.md #13): the driver (``estimationd.py``) reads Slurm, builds these snapshots, passes ``now`` and
applies the actions. All state lives in Slurm itself, in each held job's AdminComment record, so a restarted
service picks up where it stopped:

    submitted ──(job_submit: shard:<all of the smallest GPU>, priority 0, decision=estimating)──▶ held
    held, no est_job ──Submit (caps allowing; one estimation per identical script, user and directory)──▶ running
                 (sbatch --hold, root's mark, release: an estimation job never runs unmarked)
    running ──estimation job COMPLETED with a result──▶ Release(shard:<estimate + margin>)
    running ──job FAILED / TIMEOUT / CANCELLED / vanished, or result unusable──▶ Release(fallback)
    held longer than [estimation] watchdog_s (any state) ──▶ Release(fallback) + Cancel(estimation job)

A released job keeps its record (``src: async``, ``est_job``, ``held_s``); an estimation job whose held
jobs are all gone is cancelled.

Whose estimate counts: only the estimation job root submitted for the held job. Its id is written into the
held job's root-only record when root submits it; the one exception, an estimation job submitted just
before the service was killed and not yet recorded, is adopted only when it belongs to the held job's user
and carries the mark root writes into its AdminComment for that very job (``est_for: <held id>-<submit
time>``; estimationd.submit). The job
name (``gpushare-estimate-<id>``) only says which jobs to look at: any user can give any of their jobs that
name with ``scontrol update name=``, so it is never evidence (docs/security.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpushare.config import Config
from gpushare.slurm_plugins.decision import Decision, Estimate, SubmitRequest, decide, without_estimate
from gpushare.estimate.directives import Directives
from gpushare.slurm.gres_request import parse_gres
from gpushare.estimate.script_discovery import NotFound, TrainingCommand

ESTIMATION_JOB_PREFIX = "gpushare-estimate-"
ACTIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
                           "RESIZING", "SIGNALING", "STAGE_OUT"})
_ENDED = {"FAILED": "failed", "TIMEOUT": "hit its time limit", "CANCELLED": "was cancelled",
          "OUT_OF_MEMORY": "ran out of CPU memory (raise [estimation] memory)", "NODE_FAIL": "lost its node",
          "BOOT_FAIL": "could not start", "DEADLINE": "missed its deadline", "PREEMPTED": "was preempted"}


@dataclass(frozen=True)
class HeldJob:
    """A pending GPU job whose record says ``decision: estimating``."""

    job_id: int
    user_id: int
    group_id: int
    submit_time: float
    record: dict[str, Any]
    work_dir: str = ""
    key: str = ""  # same user, directory and batch script → one estimation serves all
    command: TrainingCommand | NotFound | None = None  # None: batch script not readable

    @property
    def spool_name(self) -> str:
        """The mark root writes into this job's estimation job's AdminComment (estimationd.submit)."""
        return f"{self.job_id}-{int(self.submit_time)}"

    @property
    def est_job(self) -> int | None:
        value = self.record.get("est_job")
        return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class EstimationJob:
    """An estimation job as Slurm shows it; ``outcome`` is filled by the driver once it has ended."""

    job_id: int
    user_id: int
    state: str
    for_job: int  # the held job its name claims it serves (a hint: users can rename their jobs)
    outcome: Estimate | str | None = None  # the estimate, or why there is none
    ours: bool = True  # root marked it in its AdminComment (a user may name a job like ours, not mark it)
    spool_name: str = ""  # root's mark: ``<held id>-<submit time>`` of the job it was submitted for
    interpreter: str | None = None  # "PATH (Python X, PyTorch Y)" the capture ran under, from its result
    hold: str = ""  # a pending job's hold: "admin", "user" (sbatch --hold, even root's with --uid), or ""

    def made_for(self, job: HeldJob) -> bool:
        """Whether this is the estimation job root submitted for ``job``: its user's, carrying root's mark
        for that job. What a user cannot forge by renaming a job of their own."""
        return self.ours and self.user_id == job.user_id and self.spool_name == job.spool_name


@dataclass(frozen=True)
class Submit:
    job: HeldJob
    followers: tuple[HeldJob, ...] = ()  # held jobs with the same key that share this estimation


@dataclass(frozen=True)
class Attach:
    job_id: int
    est_job: int
    record: dict[str, Any]


@dataclass(frozen=True)
class Release:
    job_id: int
    tres_per_node: str | None  # None: leave the request as it is
    record: dict[str, Any]
    outcome: str  # "estimated", "fallback", or "user" (already released by its user: record only)


@dataclass(frozen=True)
class Cancel:
    est_job: int
    why: str


@dataclass(frozen=True)
class Resume:
    """Release an estimation job of ours still under the hold it was submitted with (the service was killed
    between marking it and releasing it)."""

    est_job: int


Action = Submit | Attach | Release | Cancel | Resume


@dataclass
class _Counts:
    per_user: dict[int, int] = field(default_factory=dict)
    total: int = 0


def plan(held: list[HeldJob], estimations: dict[int, EstimationJob], now: float, cfg: Config,
         started: tuple[HeldJob, ...] = ()) -> list[Action]:
    """Decide what to do with every held job this round (see the module docstring).

    ``started``: jobs whose record still says ``estimating`` but which left the queue (their user released
    them by hand); their record is closed so ``scontrol show job`` tells the truth.
    """
    actions: list[Action] = [Release(job.job_id, None, dict(job.record, decision="exclusive",
                                                            why="released by its user before the estimate; "
                                                                "runs on every shard of a GPU",
                                                            **_async_fields(job, now)), "user")
                             for job in started]
    counts = _Counts()
    # Only estimation jobs a held job's record names count: records are root-written, job names are not.
    named = {j.est_job for j in held if j.est_job is not None}
    est: EstimationJob | None  # the loops' variable, and the lookups by id below (None: no such job)
    for est in estimations.values():
        if est.state in ACTIVE_STATES and est.job_id in named:
            counts.per_user[est.user_id] = counts.per_user.get(est.user_id, 0) + 1
            counts.total += 1
    # An estimation job of ours that no record names yet but whose held job is waiting: the service was
    # killed between its sbatch and writing est_job into the record. It is adopted, never duplicated.
    # Adopted only when it is that job's own (same user, root's directory for it), never by its name.
    unattached: dict[int, int] = {}  # held job -> the first (lowest) such estimation job
    by_spool = {job.spool_name: job for job in held if job.est_job is None}
    for candidate in sorted(estimations.values(), key=lambda e: e.job_id):
        owner = by_spool.get(candidate.spool_name)
        if (owner is not None and candidate.made_for(owner) and candidate.state in ACTIVE_STATES
                and candidate.job_id not in named):
            unattached.setdefault(owner.job_id, candidate.job_id)
    by_key: dict[str, int] = {}  # key -> est job already serving it
    for job in held:
        if job.est_job is not None and job.key:
            by_key.setdefault(job.key, job.est_job)
    planned: set[str] = set()
    referenced: set[int] = set()
    for job in sorted(held, key=lambda j: (j.submit_time, j.job_id)):
        est = estimations.get(job.est_job) if job.est_job is not None else None
        if _overdue(job, now, cfg):
            actions.append(_watchdog_release(job, now, cfg))
            continue
        if job.est_job is not None:
            referenced.add(job.est_job)
            if est is None:
                actions.append(fallback(job, f"estimation job {job.est_job} vanished", now, cfg))
            elif est.state not in ACTIVE_STATES:
                actions.append(finish(job, est, now, cfg))
            continue
        if job.command is None or isinstance(job.command, NotFound):
            why = job.command.reason if isinstance(job.command, NotFound) else "batch script not readable"
            actions.append(fallback(job, why, now, cfg))
            continue
        if job.job_id in unattached:
            adopted = unattached[job.job_id]
            actions.append(Attach(job.job_id, adopted, dict(job.record, est_job=adopted)))
            referenced.add(adopted)
            by_key.setdefault(job.key, adopted)
            counts.total += 1
            counts.per_user[job.user_id] = counts.per_user.get(job.user_id, 0) + 1
            continue
        if job.key in by_key:
            actions.append(Attach(job.job_id, by_key[job.key], dict(job.record, est_job=by_key[job.key])))
            referenced.add(by_key[job.key])
            continue
        if job.key in planned:
            continue  # the Submit planned for this key carries it as a follower
        if counts.total >= cfg.estimation.max_total:
            continue
        if counts.per_user.get(job.user_id, 0) >= cfg.estimation.max_per_user:
            continue
        followers = tuple(j for j in held if j.key == job.key and j.job_id != job.job_id and j.est_job is None)
        actions.append(Submit(job, followers))
        planned.add(job.key)
        counts.total += 1
        counts.per_user[job.user_id] = counts.per_user.get(job.user_id, 0) + 1
    held_ids = {j.job_id for j in held}
    for est in estimations.values():
        if est.ours and est.state in ACTIVE_STATES and est.job_id not in referenced:
            if est.for_job not in held_ids:
                actions.append(Cancel(est.job_id, f"job {est.for_job} no longer waits for it"))
            elif est.job_id not in named and unattached.get(est.for_job) != est.job_id:  # a second orphan
                target = next(j for j in held if j.job_id == est.for_job)
                why = ("already has an estimation job" if est.made_for(target)
                       else f"has its own estimation job; this one (uid {est.user_id}) only bears its name")
                actions.append(Cancel(est.job_id, f"job {est.for_job} {why}"))
    owners = {job.job_id: job.user_id for job in held}
    for est in estimations.values():
        if est.state != "PENDING" or not est.hold:
            continue
        if est.ours and est.job_id in referenced:
            actions.append(Resume(est.job_id))
        elif not est.ours and owners.get(est.for_job) == est.user_id:
            # What a service killed between its sbatch --hold and the mark leaves (or the held job's own
            # user imitating it, which affects only that user's job): never trusted, never run; the held
            # job gets an estimation job of its own. Another user's look-alike is left alone.
            actions.append(Cancel(est.job_id, "held and unmarked: its submission was interrupted"))
    return actions + _cancel_unneeded(actions, estimations, referenced)


def overdue(held: list[HeldJob], estimations: dict[int, EstimationJob], now: float, cfg: Config) -> list[Action]:
    """Only the watchdog's part of :func:`plan`: release every job held past ``watchdog_s`` with the
    fallback and cancel the estimations nobody else waits on.

    Why on its own: the watchdog lives in gpushare-submitd, so while the service is down held jobs would
    wait for it. ``gpushare estimates --release-overdue`` (a timer on the controller) runs just this part,
    which is safe beside a running service: it submits nothing, and releasing a job twice is harmless.
    """
    actions: list[Action] = [_watchdog_release(job, now, cfg) for job in held if _overdue(job, now, cfg)]
    referenced = {job.est_job for job in held if job.est_job is not None and not _overdue(job, now, cfg)}
    return actions + _cancel_unneeded(actions, estimations, referenced)


def _overdue(job: HeldJob, now: float, cfg: Config) -> bool:
    return now - job.submit_time > cfg.estimation.watchdog_s


def _watchdog_release(job: HeldJob, now: float, cfg: Config) -> Release:
    age = max(0.0, now - job.submit_time)
    return fallback(job, f"watchdog: held {age:.0f} s (limit {cfg.estimation.watchdog_s:.0f} s)", now, cfg)


def _cancel_unneeded(actions: list[Action], estimations: dict[int, EstimationJob],
                     referenced: set[int]) -> list[Action]:
    """Fallback releases stop their estimation job unless another held job still waits on it."""
    cancels: list[Action] = []
    for action in actions:
        if isinstance(action, Release) and action.outcome == "fallback" and action.record.get("est_job"):
            est_id = action.record["est_job"]
            est = estimations.get(est_id)
            if est and est.state in ACTIVE_STATES and est_id not in referenced:
                cancels.append(Cancel(est_id, f"job {action.job_id} released without it"))
    return cancels


def _request(job: HeldJob) -> SubmitRequest:
    return SubmitRequest(user_id=job.user_id, tres_per_node=str(job.record.get("old") or "gres:gpu:1"))


def _async_fields(job: HeldJob, now: float) -> dict[str, Any]:
    fields: dict[str, Any] = {"held_s": round(max(0.0, now - job.submit_time), 1)}
    if job.est_job is not None:
        fields["est_job"] = job.est_job
    if job.record.get("script"):
        fields["script"] = job.record["script"]
    return fields


def finish(job: HeldJob, est: EstimationJob, now: float, cfg: Config) -> Release:
    """The estimation ended: size the job from its estimate, or fall back with the reason.

    The id came from the job's root-written record; its owner and root's mark are checked again all the same
    (defence in depth): only the held job's own user's estimate, carrying root's mark, sizes it."""
    if not est.ours or est.user_id != job.user_id:
        return fallback(job, f"estimation job {est.job_id} is not this job's (uid {est.user_id})", now, cfg)
    if not isinstance(est.outcome, Estimate):
        reason = est.outcome or f"estimation job {est.job_id} {_ENDED.get(est.state, est.state.lower())}"
        return fallback(job, reason, now, cfg)
    decision = decide(_request(job), Directives(), est.outcome, cfg)
    release = _release(job, decision, now, "estimated")
    if est.interpreter:
        release.record["python"] = est.interpreter
    return release


def fallback(job: HeldJob, why: str, now: float, cfg: Config) -> Release:
    """Release with ``[estimation] fallback``: all shards kept (exclusive) or the recover size."""
    request = _request(job)
    try:
        per_node = parse_gres(request.tres_per_node)
        gpu = next(item for item in per_node if item.name == "gpu")
    except (ValueError, StopIteration):
        return Release(job.job_id, None, dict(job.record, decision="exclusive", why=why[:200],
                                              **_async_fields(job, now)), "fallback")
    decision = without_estimate(request, per_node, gpu, cfg.estimation.fallback, f"estimation: {why}", cfg)
    return _release(job, decision, now, "fallback")


def _release(job: HeldJob, decision: Decision, now: float, outcome: str) -> Release:
    record = dict(decision.record)
    record.update(_async_fields(job, now))
    if decision.action == "modify":
        record["src"] = "async" if outcome == "estimated" else record.get("src", "default")
        return Release(job.job_id, decision.tres_per_node, record, outcome)
    record["new"] = job.record.get("new")  # the held request already is every shard of a GPU: keep it
    if outcome == "estimated":
        record["src"] = "async"
    return Release(job.job_id, None, record, outcome)
