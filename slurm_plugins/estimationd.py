"""The asynchronous-estimation driver: reads Slurm, runs :func:`estimation_plan.plan`, applies its actions.

Runs in a process of its own that ``gpushare-submitd`` supervises (slurm_plugins/estimation_process.py;
``[policy] without_estimate = "async"``), never inside slurmctld:
job_submit only marks and holds the job. Security, since this runs as root:

- the user's code runs only inside the estimation job, which root submits with ``sbatch --uid --gid`` of
  the job's owner (taken from squeue's JSON, never from text a user can shape) and ``--export=NONE``;
- results come back in the estimation job's own Comment (slurm_plugins/estimation_result.py): the job runs on
  a CPU node that shares no file system with the controller; every field of it is checked here;
- every failure here releases the job (fallback), so nothing stays held because of us: the watchdog in
  the plan covers the rest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shlex
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gpushare.config import Config, parse_size
from gpushare.gpus import MiB
from gpushare.slurm_plugins.decision import Estimate, parse_record
from gpushare.estimate.directives import parse_directives
from gpushare.slurm_plugins import estimation_result
from gpushare.slurm_plugins.estimation_plan import (ESTIMATION_JOB_PREFIX, Action, Attach, Cancel, EstimationJob, HeldJob,
                                           Release, Resume, Submit, overdue, plan)
from gpushare.estimate.environment_replay import (Environment, Unreproducible, find_environment, replay_script,
                                                     shell_word)
from gpushare.estimate.script_discovery import NotFound, TrainingCommand, find_training_command
from gpushare.slurm import fields, record as record_format
from gpushare.slurm.admin_comment import merge_fields, merge_write
from gpushare.slurm.gres_request import plain_gres
from gpushare.slurm.jobs import Job
from gpushare.slurm.client import SlurmClient, SlurmError

log = logging.getLogger("gpushare.estimationd")
_EXIT_REASONS = {2: "gpu-estimate usage error", 3: "the training script failed under gpu-estimate",
                 4: "gpu-estimate hit its time or memory limit", 5: "gpu-estimate cannot estimate this script",
                 90: "the job's working directory is not accessible to its user",
                 91: "the batch script's environment could not be reproduced"}
_VERSION_RE = re.compile(r"^[0-9A-Za-z.+_-]{1,40}$")


# The estimation job's Slurm output is discarded: its result travels in its Comment, its files live in the
# wrapper's own ``mktemp -d``. A path in a shared /tmp could be made first by another user's job on the node
# (a symlink, a FIFO that hangs the job, a world-writable file).
OUTPUT = "/dev/null"
# Which held job an estimation job was submitted for, written by root into its AdminComment right after
# sbatch: users can rename their jobs and set their Comments, never their AdminComment. What adoption and
# the decoy defence go by (estimation_plan.EstimationJob.made_for).
IDENTITY_KEY = "est_for"
# Set in a held job's record with its final decision and removed once ``scontrol release`` went through: a
# service killed between the two leaves the key, and its next round releases the job (the decision is kept).
# Without it such a job would wait forever: its record no longer says "estimating", so nothing looked at it.
RELEASING_KEY = "releasing"
_SPOOL_NAME_RE = re.compile(r"[0-9]{1,12}-[0-9]{1,12}", re.ASCII)


def cluster_gpu_names(cfg: Config) -> list[str]:
    return [group.gpu for group in cfg.nodes] or [name.partition(":")[0] for name in cfg.estimator.gpus]


class EstimationService:
    """One round per ``tick()``; ``run()`` loops until the stop event is set."""

    def __init__(self, cfg: Config, client: SlurmClient | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.client = client or SlurmClient.from_config(cfg)
        self.clock = clock
        self._scripts: dict[int, tuple[str, TrainingCommand | Any]] = {}  # job id -> (key, command)
        self._ticks = 0
        self.skipped_rows = 0  # squeue rows skipped because a field did not parse (fields.Skipped)
        self.unreleased: list[int] = []  # decided, still held: a release the service was killed in

    # --- reading Slurm ----------------------------------------------------------------------------
    def snapshot(self, discover: bool = True) -> tuple[list[HeldJob], dict[int, EstimationJob], tuple[HeldJob, ...]]:
        """Held jobs, estimation jobs and jobs released by hand; ``discover=False`` reads no batch script
        (the watchdog alone needs none)."""
        jobs = self.client.jobs()
        held: list[HeldJob] = []
        started: list[HeldJob] = []
        estimations: dict[int, EstimationJob] = {}
        unreleased: list[int] = []
        skipped = fields.Skipped(log)
        for job in jobs:
            try:
                if fields.job_id(job.job_id) is None:
                    skipped.skip(job.job_id, "job id")
                    continue
                if job.user_id is None or job.group_id is None:
                    continue
                if job.name.startswith(ESTIMATION_JOB_PREFIX):
                    for_job = fields.suffix_number(job.name, ESTIMATION_JOB_PREFIX)
                    if for_job is None:
                        skipped.skip(job.job_id, "estimation job name")
                    else:
                        estimations[int(job.job_id)] = self._estimation(job, for_job)
                    continue
            except (ValueError, TypeError, OverflowError) as exc:  # never one row's trouble for the round
                skipped.skip(job.job_id, f"a field ({exc})")
                continue
            record = parse_record(job.admin_comment)
            if record and record.get(RELEASING_KEY) and record.get("decision") != "estimating" and job.pending:
                unreleased.append(int(job.job_id))
                continue
            if not record or record.get("decision") != "estimating":
                continue
            if job.pending:
                held.append(self._held(job, record) if discover else
                            HeldJob(int(job.job_id), job.user_id, job.group_id, job.submit_time or 0.0, record))
            elif job.state in ("RUNNING", "CONFIGURING"):  # released by hand: close the record
                started.append(HeldJob(int(job.job_id), job.user_id, job.group_id, job.submit_time or 0.0, record))
        self.skipped_rows += skipped.count
        self.unreleased = unreleased
        alive = {j.job_id for j in held}
        self._scripts = {k: v for k, v in self._scripts.items() if k in alive}
        return held, estimations, tuple(started)

    def _held(self, job: Job, record: dict[str, Any]) -> HeldJob:
        job_id, uid, gid = int(job.job_id), int(job.user_id or 0), int(job.group_id or 0)
        if job_id not in self._scripts and not isinstance(record.get("est_job"), int):
            self._scripts[job_id] = self._discover(job_id, uid, job.work_dir)
        key, command = self._scripts.get(job_id, ("", None))
        return HeldJob(job_id, uid, gid, job.submit_time or 0.0, record, job.work_dir, key, command)

    def _discover(self, job_id: int, uid: int, work_dir: str) -> tuple[str, Any]:
        try:
            script = self.client.run("scontrol", "write", "batch_script", str(job_id), "-")
        except SlurmError as exc:
            log.warning("job %s: batch script not readable: %s", job_id, exc)
            return "", None
        directives = parse_directives(script, self.cfg.submit.max_script_bytes)
        key = hashlib.sha256(f"{uid}\0{work_dir}\0{script}".encode("utf-8", "surrogateescape")).hexdigest()[:20]
        found = find_training_command(script, directives.script, self.cfg.submit.max_script_bytes)
        if not isinstance(found, TrainingCommand):
            return key, found
        environment = find_environment(script, found.line, self.cfg.submit.max_script_bytes)
        if isinstance(environment, Unreproducible):
            return key, NotFound(f"the batch script's environment cannot be replayed: {environment.reason}")
        return key, replace(found, environment=environment)

    def _estimation(self, job: Job, for_job: int) -> EstimationJob:
        # Still completing counts as active on every release (22.05 says COMPLETING, 24.11+ COMPLETED+COMPLETING)
        job_id, uid, state = int(job.job_id), int(job.user_id or 0), "COMPLETING" if job.completing else job.state
        identity = (record_format.parse(job.admin_comment) or {}).get(IDENTITY_KEY)
        spool_name = identity if isinstance(identity, str) and _SPOOL_NAME_RE.fullmatch(identity) else ""
        outcome: Estimate | str | None = None
        interpreter = None
        if spool_name and state in ("COMPLETED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY"):
            outcome, interpreter = self._outcome(job_id, state, job.comment, for_job)
        hold = ("admin" if job.reason == "JobHeldAdmin" else "user" if job.reason == "JobHeldUser" else
                "admin" if job.held else "") if job.pending else ""
        return EstimationJob(job_id, uid, state, for_job, outcome, bool(spool_name), interpreter=interpreter,
                             spool_name=spool_name, hold=hold)

    def _outcome(self, job_id: int, state: str, comment: str,
                 for_job: int = 0) -> tuple[Estimate | str | None, str | None]:
        """The estimate an ended estimation job left in its Comment, or why there is none, and the
        interpreter it names. The Comment is the user's to write: parsed strictly (estimation_result.parse)."""
        result = estimation_result.parse(comment)
        if result is None:
            if state == "COMPLETED":
                return f"estimation job {job_id}: no result reached the controller (its Comment holds none)", None
            return f"estimation job {job_id}: ended {state} before gpu-estimate reported", None
        code = result["exit"]
        if state != "COMPLETED" or code != 0:
            why = _EXIT_REASONS.get(code, f"gpu-estimate exit {code}")
            return f"estimation job {job_id}: {why}{self._environment_detail(result, code, for_job)}", None
        gpus = cluster_gpu_names(self.cfg)
        total, gpu = result.get("bytes"), result.get("gpu")
        if not isinstance(total, int) or total <= 0 or gpu not in gpus:
            return f"estimation job {job_id}: no usable result ({str(result.get('error', 'no estimate'))[:80]})", None
        return Estimate(total, "async", f"gpu-estimate job {job_id} for {gpu}"), _interpreter_of(result)

    def _environment_detail(self, result: dict[str, Any], code: int, for_job: int) -> str:
        """Which replayed line failed or ended the shell, or gpu-estimate's one line about --python."""
        def line(n: int) -> str:
            command = self._scripts.get(for_job, ("", None))[1]
            environment = command.environment if isinstance(command, TrainingCommand) else None
            text = environment.text_of(n) if environment else ""
            return f"batch script line {n}" + (f" ({text[:60]})" if text else "")

        if code == 91:
            ended = result.get("env_line")
            return f": {line(ended)} ended the shell" if ended else ""
        detail = f": {result['python_error']}" if code == 2 and result.get("python_error") else ""
        failed = result.get("env_failed")
        return detail + (f"; {line(failed)} failed when replayed" if failed else "")

    # --- applying actions -------------------------------------------------------------------------
    def tick(self) -> list[Action]:
        held, estimations, started = self.snapshot()
        self._finish_releases()
        return self._apply_all(plan(held, estimations, self.clock(), self.cfg, started))

    def release_overdue(self) -> list[Action]:
        """The watchdog alone (:func:`estimation_plan.overdue`), for when gpushare-submitd is not running."""
        held, estimations, _ = self.snapshot(discover=False)
        self._finish_releases()
        return self._apply_all(overdue(held, estimations, self.clock(), self.cfg))

    def _finish_releases(self) -> None:
        """Release the jobs a killed service had decided but not released (``RELEASING_KEY``)."""
        for job_id in self.unreleased:
            try:
                self._release_and_clear(job_id)
                log.warning("job %s: decided before the service stopped, released now", job_id)
            except Exception:  # noqa: BLE001 - tried again next round; the watchdog cannot see this job
                log.exception("job %s: release after a restart failed", job_id)

    def _apply_all(self, actions: list[Action]) -> list[Action]:
        for action in actions:
            try:
                self.apply(action)
            except Exception as exc:  # noqa: BLE001 - one job's trouble must not stop the others
                log.exception("action %s failed", action)
                if isinstance(action, Submit) and not unreachable(str(exc)):
                    self._release_after_error(action.job, "estimation job could not be submitted")
                # slurmctld away (restarting): the job stays held and is tried again next round; the
                # watchdog still bounds its wait
        return actions

    def apply(self, action: Action) -> None:
        if isinstance(action, Submit):
            est_job = self.submit(action.job)
            for job in (action.job, *action.followers):
                self._attach(job.job_id, est_job, job.record)
        elif isinstance(action, Attach):
            self._attach(action.job_id, action.est_job, action.record)
        elif isinstance(action, Release):
            self.release(action)
        elif isinstance(action, Cancel):
            log.info("cancelling estimation job %s: %s", action.est_job, action.why)
            self.client.run("scancel", str(action.est_job), check=False)
        elif isinstance(action, Resume):
            log.warning("estimation job %s: still held since its submission; released", action.est_job)
            self.client.run("scontrol", "release", str(action.est_job), check=False)

    def _attach(self, job_id: int, est_job: int, record: dict[str, Any]) -> None:
        if record.get("decision") != "estimating":
            return
        merge_write(self.client, job_id, merge_fields(est_job=est_job))

    def release(self, action: Release) -> None:
        try:
            if action.tres_per_node:
                self.client.update_job(action.job_id, gres=plain_gres(action.tres_per_node))
            releasing = {RELEASING_KEY: 1} if action.outcome != "user" else {}
            merge_write(self.client, action.job_id, merge_fields(**action.record, **releasing))
        except SlurmError as exc:  # e.g. it started meanwhile: still never leave it held
            log.warning("job %s: update failed (%s); releasing it as it is", action.job_id, exc)
        if action.outcome != "user":
            self._release_and_clear(action.job_id)
        log.info("%s", json.dumps({"job": action.job_id, "released": action.outcome, "record": action.record}))

    def _release_and_clear(self, job_id: int) -> None:
        self.client.run("scontrol", "release", str(job_id), check=False)
        merge_write(self.client, job_id, _without(RELEASING_KEY))

    def _release_after_error(self, job: HeldJob, why: str) -> None:
        from gpushare.slurm_plugins.estimation_plan import fallback

        try:
            self.release(fallback(job, why, self.clock(), self.cfg))
        except Exception:  # noqa: BLE001 - the watchdog retries next round
            log.exception("job %s: fallback release failed", job.job_id)

    def submit(self, job: HeldJob) -> int:
        """Submit the estimation job as the held job's user; returns its job id."""
        command = job.command
        assert isinstance(command, TrainingCommand)
        est = self.cfg.estimation
        minutes = max(1, math.ceil(est.time_limit_s / 60))
        job_id, _ = self.client.sbatch(
            f"--uid={job.user_id}", f"--gid={job.group_id}", f"--partition={est.partition}",
            f"--job-name={ESTIMATION_JOB_PREFIX}{job.job_id}", f"--cpus-per-task={est.cpus}",
            f"--mem={max(1, parse_size(est.memory) // MiB)}M", f"--time={minutes}", "--export=NONE",
            f"--chdir={job.work_dir or '/'}", f"--output={OUTPUT}",
            f"--comment=gpushare: GPU memory estimate for job {job.job_id}",
            "--hold",  # runs only once marked: a service killed before its mark leaves it held, then cancelled
            script=self.wrapper(job, command))
        try:
            merge_write(self.client, job_id, merge_fields(**{IDENTITY_KEY: job.spool_name}))
        except SlurmError:  # unmarked it would never be adopted nor trusted: gone, and the job falls back
            self.client.run("scancel", str(job_id), check=False)
            raise
        self.client.run("scontrol", "release", str(job_id))  # killed before this: adopted, then Resume
        log.info("job %s: estimation job %s submitted as uid %s", job.job_id, job_id, job.user_id)
        return job_id

    def wrapper(self, job: HeldJob, command: TrainingCommand) -> str:
        """The estimation job's script (bash, run as the user on a CPU node): the batch script's environment
        lines replayed (gpushare/estimate/environment_replay.py) and gpu-estimate run under the interpreter the
        training would use, both in a subshell writing into a private directory of the node's own; then the
        result condensed into the job's Comment (slurm_plugins/estimation_result.py) by this installation's
        interpreter, outside whatever the replayed lines set up."""
        est = self.cfg.estimation
        environment = command.environment or Environment()
        estimator = est.command or os.path.join(os.path.dirname(sys.executable), "gpu-estimate")
        gpus = cluster_gpu_names(self.cfg)
        argv = [estimator, "--json", "--no-progress", "--no-warm", "--timeout", f"{max(10.0, est.time_limit_s - 30):g}",
                "--max-cpu-memory", self.cfg.estimator.max_cpu_memory]
        for gpu in gpus:
            argv += ["--gpu", gpu]
        if self.cfg.source and os.path.isfile(self.cfg.source):
            argv += ["--config", self.cfg.source]
        options = " ".join(shlex.quote(a) for a in argv)
        if command.interpreter:
            options += f" --python {shell_word(command.interpreter)}"
            if not environment.lines and "/" not in command.interpreter:
                options += " --own-python-if-unusable"  # nothing set up: a bare `python` may be any system one
        # a launcher line (torchrun, srun, accelerate launch) goes through whole: one rank of its world
        training = " ".join(shlex.quote(a) for a in (*command.launcher, command.script, *command.args))
        # The user's PYTHONPATH (a module's PyTorch) is for the capture child, not for gpu-estimate itself.
        run = (f'rc=0\nGPUSHARE_CHILD_PYTHONPATH="${{PYTHONPATH-}}" env -u PYTHONPATH {options} {training} '
               '> "$gpushare_out/result.json" 2> "$gpushare_out/stderr.txt" || rc=$?')
        report = " ".join(shlex.quote(a) for a in (sys.executable, "-I", "-m", "gpushare.slurm_plugins.estimation_result"))
        return "\n".join([
            "#!/bin/bash -l" if environment.login else "#!/bin/bash",
            f"# gpushare: GPU memory estimate for job {job.job_id}, run as you on a CPU node.",
            "# The job is released with a right-sized GPU share when this ends.",
            'gpushare_out=$(mktemp -d "${TMPDIR:-/tmp}/gpushare-estimate.XXXXXX") || exit 1',
            "(",
            f"cd {shlex.quote(job.work_dir or '/')} || {{ echo 90 > \"$gpushare_out/exit\"; exit 90; }}",
            *replay_script(environment),
            run, "exit $rc", ")", "rc=$?",
            f'{report} "$gpushare_out" "$rc" {" ".join(shlex.quote(g) for g in gpus)}',
            'rm -rf "$gpushare_out"', "exit $rc", ""])

    # --- loop -------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        log.warning("asynchronous estimation on partition %s", self.cfg.estimation.partition)
        while not stop.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - Slurm may be briefly down; try again next round
                log.exception("estimation round failed")
            stop.wait(self.cfg.estimation.poll_s)


_UNREACHABLE = ("unable to contact slurm controller", "connect failure", "connection refused", "socket timed out",
                "zero bytes were transmitted")


def unreachable(message: str) -> bool:
    """Whether a Slurm command failed because slurmctld did not answer (a restart: try again next round),
    not because it refused."""
    text = message.lower()
    return any(marker in text for marker in _UNREACHABLE)


def _without(key: str) -> Callable[[str | None], str | None]:
    """A merge (gpushare/slurm/admin_comment.py) that removes ``key`` from the record, keeping the rest."""
    def merge(existing: str | None) -> str | None:
        record = record_format.parse(existing) if existing else None
        if record is None or key not in record:
            return existing if record is not None else None
        return record_format.render({k: v for k, v in record.items() if k != key})
    return merge


def _interpreter_of(document: Any) -> str | None:
    """``PATH (Python X, PyTorch Y)`` from a result document's ``python`` block (user-written: checked)."""
    python = document.get("python") if isinstance(document, dict) else None
    if not isinstance(python, dict):
        return None
    path, version, torch = python.get("executable"), python.get("python_version"), python.get("torch_version")
    if not (isinstance(path, str) and path.startswith("/") and path.isprintable() and len(path) <= 200):
        return None
    versions = [v if isinstance(v, str) and _VERSION_RE.match(v) else "?" for v in (version, torch)]
    return f"{path} (Python {versions[0]}, PyTorch {versions[1]})"
