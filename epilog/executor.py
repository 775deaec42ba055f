"""Carrying out a recovery decision in Slurm, one recorded step at a time (see gpushare.epilog.ledger).

Steps of a requeue, in order: ``requeuehold`` (Slurm counts Restarts, the job keeps its id), ``gres``
(all shards of the GPU, or the larger MIG type), ``comment`` (our admin-comment record, so the user sees it
in ``scontrol show job``), ``release``, then ``boost`` (``nice`` and ``starttime=now``). Each is written to
the ledger as soon as it has happened, so a run that dies part-way is continued, not repeated, by the next
one (``resume_unfinished``, called at the start of every hook run).

Measured on Slurm 22.05: while EpilogSlurmctld runs the job is COMPLETING; requeuehold, the GRES change
and release work then, but the 120 s requeue delay is applied only when completion finishes, and a nice
set before release is reset by it. So ``boost`` comes last, from ``finish``, run in a detached process
while the job is still completing. If that process is lost the job still starts after Slurm's delay.

Also measured: when the job ends, slurmd revokes the job id's launch credentials up to that second
(slurm_cred_revoke with slurmctld's end time), and a re-launch whose credential is created in the same
second is refused ("Job N already killed, do not launch batch job") and the rerun fails at once. Slurm's
own 120 s requeue delay hides this; our ``starttime=now`` must therefore wait for the next whole second.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import time
from typing import Any, Callable

from gpushare.epilog.ledger import Ledger
from gpushare.policy.oom_recovery import merge_oom_comment
from gpushare.slurm.admin_comment import merge_write
from gpushare.slurm.client import JobGone, SlurmClient, SlurmError, check_job_id
from gpushare.slurm.gres_request import GresRequest
from gpushare.slurm.jobs import ENDED_STATES

log = logging.getLogger("gpushare.epilog")


def execute(entry: dict[str, Any], client: SlurmClient, ledger: Ledger,
            finish_later: Callable[[str, int], None] | None = None) -> str:
    """Carry out the remaining steps of a requeue entry; ``finish_later`` gets the last one while the
    job is still COMPLETING (None: try it now, and leave it to a later run if it is too early)."""
    job_id = check_job_id(entry["job"])
    steps: list[str] = list(entry.get("steps", []))

    def mark(step: str, **extra: Any) -> None:
        steps.append(step)
        entry.update(ledger.put({**entry, **extra, "steps": steps}))

    if "requeuehold" not in steps:
        job = client.require_job(job_id)
        state = job.state
        if job.restarts > int(entry["restarts"]) or job.pending:
            log.info("job %s: already requeued (state %s, restarts %s)", job_id, state, job.restarts)
        elif state in ENDED_STATES or job.completing:
            try:
                client.requeue_hold(job_id)
            except SlurmError as exc:  # e.g. "presently disabled": nothing was changed, the job stays failed
                log.error("job %s: Slurm refused the requeue: %s; the job stays failed", job_id, exc)
                mark("requeuehold-refused", state="stay_failed", error=str(exc)[:300])
                return f"stay_failed: Slurm refused the requeue ({str(exc)[-120:]})"
        else:
            mark("requeuehold-skipped", state="stay_failed", error=f"job is {state}; not requeued")
            return f"error: job {job_id} is {state}"
        mark("requeuehold")
    if "gres" not in steps and "gres-refused" not in steps:
        new_gres = GresRequest.parse(entry["new_gres"])  # the ledger keeps the text recovery wrote; parsed here
        if new_gres.error:  # recovery writes only requests it formatted itself: a damaged ledger entry
            raise ValueError(f"job {job_id}: ledger's new_gres: {new_gres.error}")
        try:
            client.update_job(job_id, gres=new_gres.plain())
            mark("gres")
        except SlurmError as exc:  # release anyway: a held job helps nobody
            log.error("job %s: GRES change to %s refused: %s; releasing unchanged", job_id, entry["new_gres"], exc)
            mark("gres-refused", error=str(exc)[:300])
    if "comment" not in steps and entry.get("oom"):
        apply_comment(client, job_id, entry["oom"])
        mark("comment")
    if "release" not in steps:
        try:
            client.release(job_id)
        except SlurmError:
            if client.require_job(job_id).priority == 0:  # still held: a real failure
                raise
            log.info("job %s: already released", job_id)  # we died between release and recording it
        mark("release", state="requeued")
    if "boost" in steps:
        return f"requeue: {entry['reason']}"
    if finish_later is not None and client.require_job(job_id).completing:
        finish_later(job_id, int(entry["restarts"]))
        return f"requeue: {entry['reason']} (priority and start time follow when completion ends)"
    return finish(entry, client, ledger, wait_s=0)


def apply_comment(client: SlurmClient, job_id: str, oom: dict[str, Any]) -> bool:
    """Merge our ``oom`` entry into the job's record; a refusal or a foreign comment is only logged."""
    try:
        if not merge_write(client, job_id, lambda existing: merge_oom_comment(existing, oom)):
            log.info("job %s: AdminComment is not ours or would overflow; left unchanged", job_id)
            return False
        return True
    except (SlurmError, OSError, ValueError) as exc:
        log.error("job %s: AdminComment not updated: %s", job_id, getattr(exc, "reason", exc))
        return False


def finish(entry: dict[str, Any], client: SlurmClient, ledger: Ledger, wait_s: float = 120.0,
           sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.time) -> str:
    """Once the job has left COMPLETING: raise its priority and make it eligible now, then mark it done."""
    job_id = check_job_id(entry["job"])
    deadline = time.monotonic() + wait_s
    job = client.require_job(job_id)
    while job.completing and time.monotonic() < deadline:
        sleep(0.5)
        job = client.require_job(job_id)
    if job.completing:  # PENDING+COMPLETING too: a start time set now is replaced when completion ends
        return f"requeue: job {job_id} still completing after {wait_s:.0f} s; eligible after Slurm's delay"
    state = job.state
    if job.pending:
        wait_past_revocation(clock(), clock, sleep)
        updates: dict[str, Any] = {"starttime": "now"}  # else ineligible for 120 s after a requeue
        if entry.get("nice") is not None:  # the job's own nice back (release reset it), minus any boost
            updates["nice"] = entry["nice"]
        client.update_job(job_id, **updates)
    if entry.get("oom") and state in ("PENDING", "RUNNING"):
        apply_comment(client, job_id, entry["oom"])  # again: the node Epilog may have rewritten it meanwhile
    steps = [*entry.get("steps", []), "boost"]
    entry.update(ledger.put({**entry, "steps": steps, "state": "done"}))
    ledger.append_history({"job": job_id, "restarts": entry["restarts"], "event": "requeued",
                           "gres": entry["new_gres"], "steps": steps})
    return f"requeue: {entry['reason']}"


def wait_past_revocation(completed_at: float, clock: Callable[[], float],
                         sleep: Callable[[float], None]) -> None:
    """Sleep into the whole second after ``completed_at`` (when the job was seen to have finished
    completing, so after slurmd revoked its credentials): a launch credential from that second on is
    newer than the revocation. At most one second, and only for the first rerun of an OOM job."""
    remaining = math.floor(completed_at) + 1.05 - clock()
    if remaining > 0:
        sleep(remaining)


def spawn_finisher(job_id: str, restarts: int) -> None:
    """Run ``finish`` in a detached process (own session, no inherited streams) so slurmctld can go on."""
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    if "GPUSHARE_CONFIG" in os.environ:
        env["GPUSHARE_CONFIG"] = os.environ["GPUSHARE_CONFIG"]
    key = f"{check_job_id(job_id)}.{int(restarts)}"
    subprocess.Popen([sys.executable, "-m", "gpushare.epilog.slurmctld_epilog", "--finish", key],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True, close_fds=True, env=env, cwd="/")


def resume_unfinished(client: SlurmClient, ledger: Ledger, skip: str = "", min_age_s: float = 30.0,
                      finish_later: Callable[[str, int], None] | None = spawn_finisher) -> None:
    """Finish recoveries a crash (ours or slurmctld's) left half done, so no job stays held.

    A job requeued here may come back COMPLETING: Slurm 24.11 keeps a finished job's node count across a
    slurmctld restart, so requeueing it then leaves it PENDING+COMPLETING until slurmctld's periodic
    re-kill (KillWait + 2 x MessageTimeout, looked at once a minute) clears it, and only then applies its
    requeue delay. ``finish_later`` (a detached ``finish``) makes it eligible when that happens, as the
    hook does for a job still completing; None leaves the boost to the next resume."""
    for entry in ledger.unfinished(min_age_s):
        if str(entry.get("job")) == skip:
            continue
        try:
            with ledger.claim(entry["job"], int(entry["restarts"])) as mine:
                if mine:
                    log.warning("job %s: finishing an interrupted recovery", entry["job"])
                    execute(ledger.get(entry["job"], int(entry["restarts"])) or entry, client, ledger,
                            finish_later)
        except SlurmError as exc:
            if isinstance(exc, JobGone) or "Invalid job id" in str(exc):  # purged from slurmctld (MinJobAge): nothing left to finish
                ledger.put({**entry, "state": "gone", "error": str(exc)[:300]})
            log.error("job %s: interrupted recovery still failing: %s", entry.get("job"), exc)
        except (OSError, ValueError) as exc:
            log.error("job %s: interrupted recovery still failing: %s", entry.get("job"), exc)
