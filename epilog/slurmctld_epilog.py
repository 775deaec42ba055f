"""``gpushare-epilog-slurmctld``: the EpilogSlurmctld that recovers jobs killed by GPU out-of-memory.

slurmctld runs it as SlurmUser (often root) after every job, with the job's facts in the environment,
no PATH and no SLURM_CONF. It asks Slurm for the job's structured record for the rest, reads the job's log tails as the
job's user (gpushare.user_files) and recognises an OOM (gpushare.epilog.oom_detect). Recovery is gather → decide →
act: the job's evidence is gathered once (gpushare.epilog.oom_evidence), judged by the pure decision
(gpushare.policy.oom_recovery.decide), and carried out step by step (:func:`act`, gpushare.epilog.executor),
recording each step in the ledger (gpushare.epilog.ledger) so that a second run, or a run after a crash, finishes
the same recovery instead of starting another one. ``--finish`` and ``--resume`` continue that act from the
ledger's entry; neither gathers nor decides again.

Fail-safe (docs/style.md #10): every problem of ours is logged loudly and the exit status is always 0; a failed
step never leaves a job held: if the GRES change is refused the job is still released.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import logging.handlers
import os
import subprocess
import sys
import time
from typing import Any, Callable, Mapping

from gpushare.epilog.executor import execute, finish, resume_unfinished, spawn_finisher
from gpushare.epilog.ledger import FINAL_STATES, Ledger
from gpushare.epilog.oom_evidence import detect, gather
from gpushare.epilog.oom_observe import would_requeue
from gpushare.oom_counts import count
from gpushare.user_files import append_note, keep_logs, new_token, note_kept, restore_logs
from gpushare.epilog.learn import learn_from_oom
from gpushare.policy.oom_recovery import (RECOVERABLE_STATES, Action, JobFacts, OomEvidence, OomVerdict, decide,
                                          log_not_kept, whole_gpu_shards)
from gpushare.config import Config, load_config
from gpushare.gpus import GiB
from gpushare.slurm.client import SlurmClient, SlurmError, check_job_id
from gpushare.slurm.hostlist import expand_hostlist, first_host
from gpushare.slurm.jobs import Job, log_paths
from gpushare.submitd_client import ask

log = logging.getLogger("gpushare.epilog")


def _succeeded(env: Mapping[str, str]) -> bool:
    """Exit 0 and no signal, by slurmctld's own SLURM_JOB_EXIT_CODE2 (False when it is absent)."""
    if not env.get("SLURM_JOB_EXIT_CODE2"):
        return False
    quick = JobFacts.from_job(None, env)
    return quick.exit_code == 0 and quick.exit_signal == 0


def _ran_on_no_gpu_node(env: Mapping[str, str], cfg: Config) -> bool:
    """True when ``[[nodes]]`` lists the GPU nodes and none of the job's nodes (slurmctld's own
    SLURM_JOB_NODELIST) is one of them: such a job cannot have run out of GPU memory."""
    nodes = env.get("SLURM_JOB_NODELIST", "")
    if not cfg.nodes or not nodes:
        return False
    try:
        gpu_nodes = {name for group in cfg.nodes for name in expand_hostlist(group.names)}
        return not gpu_nodes.intersection(expand_hostlist(nodes))
    except ValueError:
        return False


def env_log_paths(env: Mapping[str, str]) -> tuple[str, ...] | None:
    """The job's log paths from the hook's environment alone (patterns expanded as Slurm does); None when
    the environment cannot tell (no working directory), so the caller asks Slurm."""
    work_dir = env.get("SLURM_JOB_WORK_DIR", "")
    job_id = env.get("SLURM_JOB_ID", "")
    if not work_dir.startswith("/") or not job_id:
        return None
    array_job, array_task = env.get("SLURM_ARRAY_JOB_ID", ""), env.get("SLURM_ARRAY_TASK_ID", "")
    job = Job(job_id=job_id, states=(), name=env.get("SLURM_JOB_NAME", ""), user_name=env.get("SLURM_JOB_USER", ""),
              work_dir=work_dir, std_out=env.get("SLURM_JOB_STDOUT", ""), std_err=env.get("SLURM_JOB_STDERR", ""),
              array_job_id=int(array_job) if array_job.isdigit() else None,
              array_task_id=int(array_task) if array_task.isdigit() else None)
    return log_paths(job, first_host(env.get("SLURM_JOB_NODELIST", "")))


def prefilter(env: Mapping[str, str], cfg: Config) -> tuple[str | None, OomVerdict | None]:
    """Cheap checks before any Slurm query, lock or ledger write: (why nothing is to be done, None) or
    (None, the verdict on the logs read from the environment's paths, or None when it cannot tell).

    Why: the hook runs for every job that ends. A 1,000-task CPU array exiting 1 must cost 1,000 quick
    exits, not 1,000 full-queue queries (22.05 has no single-job JSON read)."""
    if _succeeded(env):
        return "none: exited 0", None  # the common case costs no Slurm call at all
    if _ran_on_no_gpu_node(env, cfg):
        return "none: ran on no GPU node", None
    paths = env_log_paths(env)
    if paths is None:
        return None, None
    quick = JobFacts.from_job(None, env)
    verdict = detect(dataclasses.replace(quick, log_paths=paths), cfg)
    if not verdict.is_oom and verdict.unread:
        return None, None  # logs on another host's disk: the node's TaskEpilog may have reported one
    if not verdict.is_oom:
        return f"none: {verdict.reason}", None
    return None, verdict


def handle(job_id: str, env: Mapping[str, str], client: SlurmClient, cfg: Config, ledger: Ledger,
           finish_later: Callable[[str, int], None] | None = None, slot_wait_s: float = 60.0,
           resume_later: Callable[[float], None] | None = None) -> str:
    """Decide and act for one job; returns what happened (for the log and tests)."""
    skip, early = prefilter(env, cfg)
    if skip is not None:
        return skip
    with ledger.slot(cfg.oom.max_concurrent_hooks, slot_wait_s) as got:
        if not got:
            log.error("job %s: %d hook runs busy for %.0f s; this job is left as Slurm left it", job_id,
                      cfg.oom.max_concurrent_hooks, slot_wait_s)
            return "skipped: too many hook runs at once"
        return _handle_heavy(job_id, env, client, cfg, ledger, finish_later, early, resume_later)


def _handle_heavy(job_id: str, env: Mapping[str, str], client: SlurmClient, cfg: Config, ledger: Ledger,
                  finish_later: Callable[[str, int], None] | None, early: OomVerdict | None,
                  resume_later: Callable[[float], None] | None = None) -> str:
    job = JobFacts.from_job(_job(client, job_id), env)
    log.info("job %s: state %s exit %s:%s restarts %s gres %r node %s", job.job_id, job.state, job.exit_code,
             job.exit_signal, job.restarts, job.gres.text, job.node)
    if job.exit_code == 0 and job.exit_signal == 0:
        return "none: exited 0"
    if job.state not in RECOVERABLE_STATES:
        return f"none: state {job.state}"
    done = ledger.get(job.job_id, job.restarts)
    if done and done.get("state") in FINAL_STATES:
        return f"already handled: {done.get('state')}"
    with ledger.claim(job.job_id, job.restarts) as mine:
        if not mine:
            return "busy: another run is handling this job"
        entry = ledger.get(job.job_id, job.restarts)
        if entry is None:
            evidence = gather(job, env, client, cfg, ledger, early)
            action = decide(evidence, cfg)
            if action.kind == "none":
                return f"none: {action.reason}"
            return act(evidence, action, client, cfg, ledger, finish_later, resume_later)
        if entry.get("state") in FINAL_STATES:
            return f"already handled: {entry.get('state')}"
        return execute(entry, client, ledger, finish_later)


def act(evidence: OomEvidence, action: Action, client: SlurmClient, cfg: Config, ledger: Ledger,
        finish_later: Callable[[str, int], None] | None = None,
        resume_later: Callable[[float], None] | None = None) -> str:
    """Carry out ``action`` (a requeue or a stay-failed) decided on ``evidence``: observe mode's record of it, the
    failed run's logs kept aside, the lesson learned, the ledger's entry, the executor's steps and the user's
    note; returns what happened. Runs under the ledger's claim of the job's run."""
    job, verdict = evidence.job, evidence.verdict
    # a pilot: record, requeue nothing; a job rewritten to shards under enforce before the switch keeps
    # its recovery until it ends, as it keeps its caps and backstop (docs/submit-path.md)
    if action.kind == "requeue" and cfg.policy.mode != "enforce" and \
            (job.record or {}).get("decision") != "shared":
        if cfg.policy.mode == "off":
            return f"none: [policy] mode = off (enforce would requeue: {action.reason})"
        return would_requeue(job, verdict, action, ledger, client)
    token = new_token()
    kept: list[str] = []
    if action.kind == "requeue":  # before the rerun can start: it would truncate the logs
        copies, why_not = _keep(job, cfg, token)
        if copies is None:  # never requeued without: the rerun would truncate the log
            action = log_not_kept(action, why_not)
        elif copies:
            kept = copies
            action = dataclasses.replace(
                action, oom={**(action.oom or {}), "kept": f"oom-run{job.restarts}.{token}"},
                user_message=f"{action.user_message} This run's output is kept in {', '.join(kept)}.")
    if action.learn:
        _learn(job, cfg, client)
    if action.kind == "requeue" and action.charged:
        ledger.note_user_recovery(job.uid)
    entry = ledger.put({**_entry(job, verdict, action), **({"kept": kept} if kept else {})})
    count(ledger.dir, action.kind)  # gpushare_oom_recoveries_total{outcome} on submitd's endpoint
    ledger.append_history({"job": job.job_id, "restarts": job.restarts, "event": action.kind,
                           "reason": action.reason, "message": verdict.message})
    if action.kind == "stay_failed":
        log.warning("job %s: %s; matched: %s", job.job_id, action.reason, verdict.message)
        _tell_user(job, action.user_message, cfg)
        return f"stay_failed: {action.reason}"
    log.warning("job %s: %s; matched: %s", job.job_id, action.reason, verdict.message)
    if resume_later is not None:  # if this run dies part-way, a detached process finishes it
        resume_later(RESUME_DELAY_S)
    outcome = execute(entry, client, ledger, finish_later)
    if outcome.startswith("requeue"):
        _tell_user(job, action.user_message, cfg, kept=(token, kept) if kept else None)
    elif kept:
        _restore(job, cfg, token)
    return outcome


def _learn(job: JobFacts, cfg: Config, client: SlurmClient) -> None:
    """Raise the cached estimate of this batch script (gpushare.epilog.learn); never fatal."""
    try:
        script = client.run("scontrol", "write", "batch_script", check_job_id(job.job_id), "-")
        path = learn_from_oom(cfg, script, job.job_id, job.gres, whole_gpu_shards(cfg, job.node) * GiB,
                              job.uid, work_dir=job.work_dir or None)
        if path is not None:
            log.info("job %s: raised the cached estimate of its batch script (%s)", job.job_id, path.name)
    except Exception as exc:  # noqa: BLE001 - learning is a bonus; recovery must go on
        log.warning("job %s: could not update the estimate cache: %s", job.job_id, exc)


def _job(client: SlurmClient, job_id: str) -> Job | None:
    """Slurm's structured record of the job; None (facts then come from the environment) if unreadable."""
    try:
        return client.job(job_id)
    except (SlurmError, OSError, ValueError) as exc:
        log.warning("job %s: Slurm's job record unavailable (%s); using the hook's environment", job_id, exc)
        return None


def _entry(job: JobFacts, verdict: OomVerdict, action: Action) -> dict[str, Any]:
    return {"job": job.job_id, "restarts": job.restarts, "action": action.kind,
            "state": "decided" if action.kind == "requeue" else "stay_failed", "reason": action.reason,
            "family": verdict.family, "message": verdict.message, "source": verdict.source,
            "old_gres": job.gres.text, "new_gres": action.new_gres, "nice": action.nice,
            "oom": action.oom, "retry": action.retry, "max_retries": action.max_retries,
            "charged": action.charged, "steps": []}


def _tell_user(job: JobFacts, message: str, cfg: Config, kept: tuple[str, list[str]] | None = None) -> None:
    """The note into the job's log (and, with ``kept``: the copies' token and names, into the copies of the
    failed run's logs) as the job's user: here when we are root, else through gpushare-submitd, the
    controller's root service (slurm_plugins/job_notes.py), since SlurmUser cannot write the user's files."""
    if not message or not job.log_paths:
        return
    try:
        if os.geteuid() == 0:  # the copies first: they outlive the log, which the rerun truncates
            if kept is not None:
                note_kept(job.log_paths, job.restarts, kept[0], message, job.uid, job.gid, cfg.oom.read_timeout_s,
                          job.work_dir)
            append_note(job.log_paths[0], message, job.uid, job.gid, cfg.oom.read_timeout_s)
            return
        request = {"op": "note", "job_id": job.job_id, "message": message,
                   **({} if kept is None else {"run": job.restarts, "token": kept[0]})}
        reply = ask(cfg.submit.socket, request, timeout_s=cfg.oom.read_timeout_s)
        if reply.get("user_msg") != "written":
            log.info("job %s: note not added to the job log: %s", job.job_id, reply.get("user_msg", "no answer"))
    except OSError as exc:  # TailError included; a note is never worth failing the hook
        log.info("job %s: could not add a note to the job log: %s", job.job_id, exc)


def _keep(job: JobFacts, cfg: Config, token: str) -> tuple[list[str] | None, str]:
    """Copy the end of the job's logs aside before its requeue (gpushare.user_files.keep_logs): (the copies'
    names, "") – an empty list when no log is here to copy – or (None, why no copy could be made)."""
    if not job.log_paths:
        return [], ""
    try:
        if os.geteuid() == 0:
            return keep_logs(job.log_paths, job.restarts, job.uid, job.gid, cfg.oom.read_timeout_s, token,
                             job.work_dir), ""
        reply = ask(cfg.submit.socket, {"op": "note", "job_id": job.job_id, "run": job.restarts, "step": "keep",
                                        "token": token}, timeout_s=cfg.oom.read_timeout_s)
        answer = reply.get("user_msg", "no answer from gpushare-submitd")
        if answer.startswith("kept "):
            names = json.loads(answer[len("kept "):])
            if isinstance(names, list) and all(isinstance(name, str) for name in names):
                return names, ""
        return None, answer[:300]
    except (OSError, ValueError) as exc:
        return None, str(exc)[:300]


def _restore(job: JobFacts, cfg: Config, token: str) -> None:
    """Drop the copies ``_keep`` made when the requeue did not happen (the log stays whole); best effort."""
    try:
        if os.geteuid() == 0:
            restore_logs(job.log_paths, job.restarts, token, job.uid, job.gid, cfg.oom.read_timeout_s, job.work_dir)
            return
        reply = ask(cfg.submit.socket, {"op": "note", "job_id": job.job_id, "run": job.restarts, "step": "restore",
                                        "token": token}, timeout_s=cfg.oom.read_timeout_s)
        if reply.get("user_msg") != "restored":
            log.info("job %s: copies of its logs not removed: %s", job.job_id, reply.get("user_msg", "no answer"))
    except OSError as exc:
        log.info("job %s: copies of its logs not removed: %s", job.job_id, exc)


def _client(cfg: Config) -> SlurmClient:
    return SlurmClient.from_config(cfg)


RESUME_DELAY_S = 45.0  # past resume_unfinished's 30 s minimum age: a live hook run is never raced


def spawn_resumer(delay_s: float) -> None:
    """A detached ``--resume DELAY`` process: finishes this recovery if the hook dies part-way and no
    other job ends afterwards (an idle cluster). A slurmctld restart under systemd kills it with the
    hook; etc/systemd/gpushare-oom-resume.timer covers that case."""
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    if "GPUSHARE_CONFIG" in os.environ:
        env["GPUSHARE_CONFIG"] = os.environ["GPUSHARE_CONFIG"]
    subprocess.Popen([sys.executable, "-m", "gpushare.epilog.slurmctld_epilog", "--resume", f"{delay_s:.0f}"],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True, close_fds=True, env=env, cwd="/")


def run_resume(cfg: Config, client: SlurmClient | None = None, delay_s: float = 0.0,
               min_age_s: float = 30.0) -> str:
    """``--resume [DELAY]``: finish recoveries left half done, without waiting for another job to end."""
    if delay_s > 0:
        time.sleep(delay_s)
    ledger = Ledger(cfg.oom.ledger_dir)
    if not ledger.dir.is_dir():
        return "resume: no ledger"
    ledger.ensure()
    pending = ledger.unfinished(min_age_s)
    if pending:
        resume_unfinished(client or _client(cfg), ledger, min_age_s=min_age_s)
    return f"resume: {len(pending)} interrupted recover{'y' if len(pending) == 1 else 'ies'} looked at"


def run(env: Mapping[str, str], client: SlurmClient | None = None, cfg: Config | None = None,
        finish_later: Callable[[str, int], None] | None = spawn_finisher,
        resume_later: Callable[[float], None] | None = None) -> str:
    """The hook's work with injectable client and config (tests); raises on our own errors."""
    job_id = check_job_id(env.get("SLURM_JOB_ID", ""))
    cfg = cfg or load_config()
    ledger = Ledger(cfg.oom.ledger_dir)
    if _succeeded(env) and not ledger.dir.is_dir():
        return "none: exited 0"  # no ledger yet, so nothing to resume: create nothing for a good job
    ledger.ensure()
    try:
        ledger.prune(cfg.oom.retention_days * 86400)
    except OSError as exc:
        log.warning("ledger not pruned: %s", exc)
    client = client or _client(cfg)
    resume_unfinished(client, ledger, skip=job_id, finish_later=finish_later)
    return handle(job_id, env, client, cfg, ledger, finish_later, resume_later=resume_later)


def run_finisher(key: str, cfg: Config, client: SlurmClient | None = None, wait_s: float = 120.0) -> str:
    """``--finish JOB.RESTARTS``: the detached second half of a requeue (see ``execute``)."""
    job_id, _, restarts_text = key.rpartition(".")
    restarts = int(restarts_text)
    ledger = Ledger(cfg.oom.ledger_dir)
    with ledger.claim(check_job_id(job_id), restarts, wait_s=30.0) as mine:
        entry = ledger.get(job_id, restarts)
        if not mine or entry is None or entry.get("state") == "done":
            return "finish: nothing to do"
        return finish(entry, client or _client(cfg), ledger, wait_s=wait_s)


def main(argv: list[str] | None = None) -> int:
    from gpushare.hooks import run_hook

    args = sys.argv[1:] if argv is None else argv
    return run_hook("gpushare-epilog-slurmctld", lambda cfg: _main(args, cfg), lambda cfg: cfg.oom.log_file,
                    "OOM recovery skipped, the job stays as Slurm left it")


def _main(args: list[str], cfg: Config) -> None:
    job = os.environ.get("SLURM_JOB_ID", "?")[:20]
    if len(args) == 2 and args[0] == "--finish":
        job = args[1][:24]
        outcome = run_finisher(args[1], cfg)
    elif args and args[0] == "--resume":
        job = "-"
        outcome = run_resume(cfg, delay_s=float(args[1]) if len(args) > 1 else 0.0)
    else:
        outcome = run(os.environ, cfg=cfg, resume_later=spawn_resumer)
    log.info("job %s: %s", job, outcome)


if __name__ == "__main__":
    sys.exit(main())
