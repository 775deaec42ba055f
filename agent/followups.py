"""The agent's follow-ups: what a tick decided that must talk to Slurm or signal a process, carried out off
the sampling lock by the agent's worker threads, and the delivery of the Epilog's spooled run summaries.

Two queues: follow-ups (job-log messages, backstop stops after their evidence, early requeues, adoptions,
restored jobs to verify, collateral marks) and run summaries for AdminComment.
"""

from __future__ import annotations

import logging
import queue
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpushare.agent.adopt import RETRY_S
from gpushare.agent.guard import Action
from gpushare.node.api import node_name
from gpushare.node.jobs import registration_facts
from gpushare.node.store import check_job

if TYPE_CHECKING:
    from gpushare.agent.daemon import Agent

log = logging.getLogger("gpushare.agent")
SPOOL = "pending-records"  # run summaries waiting for the accounting database (gpushare.epilog.stored_record)
DELIVER_S = 2.0  # the spool's delivery round (FollowUps._deliverer) while the database takes records
DELIVER_MAX_S = 30.0  # its longest pause while the database is away


class FollowUps:
    """The agent's two work queues and the threads that empty them."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.cfg, self.lock, self.store, self.adopter = agent.cfg, agent.lock, agent.store, agent.adopter
        self.failsafe, self.counters = agent.failsafe, agent.counters
        self.followups: queue.Queue[tuple[Action, str]] = queue.Queue()  # log messages, early requeues, adoptions
        self.annotations: queue.Queue[dict[str, Any]] = queue.Queue()

    def start(self, stop: threading.Event) -> None:
        """The worker threads, until ``stop``."""
        if self.agent.slurm is not None:
            threading.Thread(target=self._annotator, args=(stop,), name="gpushare-annotate", daemon=True).start()
        if self.agent.slurm is not None and self.cfg.admin_comment == "yes":
            threading.Thread(target=self._deliverer, args=(stop,), name="gpushare-deliver", daemon=True).start()
        threading.Thread(target=self._followup_loop, args=(stop,), name="gpushare-guard", daemon=True).start()

    def followup_pending(self, block_s: float = 0.0) -> int:
        """Carry out queued follow-ups (job-log messages, early requeues) off the sampling lock."""
        from gpushare.agent.enforce import requeue_early, write_job_message

        done = 0
        while True:
            try:
                action, text = (self.followups.get(timeout=block_s) if block_s and not done
                                else self.followups.get_nowait())
            except queue.Empty:
                return done
            done += 1
            if action.kind == "adopt" and self.agent.slurm is not None:
                self.adopt(action.job, action.record["where"])
                continue
            if action.kind == "verify":
                self.verify_restored(action.job, int(action.record["restarts"]))
                continue
            if action.kind == "collateral":
                if self.agent.slurm is not None:
                    from gpushare.node.comment import annotate_fields

                    annotate_fields(self.agent.slurm, action.job, collateral=action.record)
                continue
            if self.agent.slurm is None:
                log.warning("job %s: no Slurm client; message only in the agent log", action.job)
                continue
            entry = self.agent.jobs.entry(action.job)
            stopping = action.kind == "oom" and action.record.get("action") == "stop"
            if stopping:
                self._leave_evidence(action, entry)
            write_job_message(self.agent.slurm, action.job, int(entry.get("uid", -1)), text, node_name(self.cfg))
            if stopping:
                self._stop(action)
            if action.kind != "forecast":
                continue
            if action.record.get("action") != "requeue":
                self._forecast_outcome(action.job, "warned")
                continue
            # recorded before the requeue: the requeue runs the Epilog, which writes the run's record
            self._forecast_outcome(action.job, "requeued")
            if requeue_early(self.agent.slurm, action.job, float(action.record["predicted_bytes"])):
                self.counters["oom_avoided"] += 1
            else:
                self._forecast_outcome(action.job, "requeue-failed")

    def adopt(self, job: str, where: dict[int, list[int]]) -> dict[str, Any] | None:
        """Register a running job from Slurm's record of it (``gpushare.agent.adopt``); None: not adopted."""
        try:
            slurm_job = self.agent.slurm.job(job)
        except Exception as exc:  # noqa: BLE001 - Slurm busy or down: tried again after the retry period
            log.warning("job %s: running on GPU(s) %s unregistered; Slurm's record unavailable (%s)", job,
                        sorted(where), exc)
            self.failsafe.hold("slurm", f"job {job}'s record unavailable ({str(exc)[:200]})", for_s=2 * RETRY_S)
            return None
        self.failsafe.clear("slurm")
        refusal = self.adopter.refusal(slurm_job, node_name(self.cfg), where)
        with self.lock:
            if refusal is None:
                self.adopter.refused.pop(job, None)
            else:
                self.adopter.refused[job] = refusal
        if refusal is not None:
            log.info("job %s: processes on GPU(s) %s but no registration; not adopted: %s", job, sorted(where), refusal)
            return None
        facts = registration_facts(job, int(slurm_job.user_id), slurm_job.user_name, sorted(where), slurm_job)
        entry = self.agent.register(facts, by="agent-adopted")
        if entry.get("registered_by") != "agent-adopted":  # the Prolog was only late: its registration stands
            return entry
        self.counters["adopted"] += 1
        log.warning("job %s: running on GPU(s) %s without a registration (its Prolog did not run); adopted from "
                    "Slurm's record, cap %s MiB, backstop only", job, sorted(where),
                    (entry.get("caps") or {}).get("mem_limit_mib"))
        return entry

    def verify_restored(self, job: str, restarts: int) -> str | None:
        """Close a restored run that Slurm says no longer runs here (``gpushare.agent.restore``); its reason."""
        from gpushare.agent.restore import not_here

        try:
            reason = not_here(self.agent.slurm.job(job), node_name(self.cfg), restarts)
        except Exception as exc:  # noqa: BLE001 - Slurm away: the job stays tracked, as before the restart
            log.warning("job %s: restored; Slurm's record unavailable (%s)", job, exc)
            self.failsafe.hold("slurm", f"job {job}'s record unavailable ({str(exc)[:200]})", for_s=2 * RETRY_S)
            return None
        self.failsafe.clear("slurm")
        entry = self.store.get(job) or {}
        if reason is None or entry.get("closed") or entry.get("restarts", 0) != restarts:
            return None  # running, or its Epilog or a new run's Prolog got there first
        log.warning("job %s: restored from the job store, but %s; closed as lost (no Epilog ran here)", job, reason)
        self.agent.close(job)
        self.store.update(job, lambda e: {**e, "lost": reason[:200]})
        (Path(self.cfg.run_dir) / "jobs" / f"{check_job(job)}.json").unlink(missing_ok=True)  # its Prolog's caps
        return reason

    def _leave_evidence(self, action: Action, entry: dict[str, Any]) -> None:
        """The measured peak into the job's AdminComment (``run.peak_gib``) while Slurm still takes updates:
        what OOM recovery's corroboration reads on the controller (gpushare/policy/oom_recovery.py)."""
        from gpushare.node.comment import annotate

        gpu = str(action.gpu)
        peaks = {**(entry.get("peak_bytes") or {})}
        peaks[gpu] = max(int(peaks.get(gpu) or 0), int(action.record.get("peak_bytes") or 0))
        record = {"node": node_name(self.cfg), "caps": entry.get("caps"),
                  "gpus": {g: {"peak_bytes": value} for g, value in peaks.items()}}
        kernel, start = entry.get("kernel_at"), entry.get("start")
        if kernel is not None and start is not None and entry.get("ttfk_source") != "adopted":
            record["ttfk_s"] = round(float(kernel) - float(start), 3)
        annotate(self.agent.slurm, action.job, record)

    def _stop(self, action: Action) -> None:
        from gpushare.agent.enforce import stop_processes

        stopped = stop_processes(action.job, list(action.pids), self.agent.watch.owner(action.gpu))
        self.counters["backstop_stops"] += 1
        with self.lock:
            self.agent.jobs.update(action.job, lambda e: {**e, "oom": {**(e.get("oom") or {}), "pids": stopped}})

    def _forecast_outcome(self, job: str, outcome: str) -> None:
        with self.lock:
            self.agent.jobs.update(job, lambda e: {**e, "forecast": {**(e.get("forecast") or {}), "outcome": outcome}})

    def annotate_pending(self, block_s: float = 0.0) -> int:
        """Write queued run summaries to Slurm (off the sampling lock); returns how many were tried."""
        from gpushare.node.comment import annotate

        done = 0
        while True:
            try:
                record = self.annotations.get(timeout=block_s) if block_s and not done else self.annotations.get_nowait()
            except queue.Empty:
                return done
            annotate(self.agent.slurm, record["job"], record)
            done += 1

    def _followup_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.followup_pending(block_s=1.0)
            except Exception:  # noqa: BLE001
                log.exception("guard follow-up failed")

    def _deliverer(self, stop: threading.Event) -> None:
        """Run summaries the Epilog spooled while the accounting database was away, delivered once it is back:
        every DELIVER_S while some wait, backing off (jittered, at most DELIVER_MAX_S) while the database still
        refuses them. The delivery itself is the Epilog layer's (``python -m gpushare.epilog.stored_record``,
        one short process per round, only while the spool holds something)."""
        directory, delay = Path(self.cfg.state_dir) / SPOOL, DELIVER_S
        while not stop.wait(delay * random.uniform(0.8, 1.2)):
            try:
                if not any(directory.glob("*.json")):
                    delay = DELIVER_S
                    continue
                argv = [sys.executable, "-m", "gpushare.epilog.stored_record", "--state-dir", str(self.cfg.state_dir)]
                if self.agent.slurm.conf_path:
                    argv += ["--slurm-conf", str(self.agent.slurm.conf_path)]
                if self.agent.slurm.bin_dir:
                    argv += ["--bin-dir", str(self.agent.slurm.bin_dir)]
                done = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
                if done.stderr.strip():
                    log.info("spooled records: %s", done.stderr.strip()[-300:])
                delivered = done.returncode == 0  # 0: nothing left; 3: some still pending
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("spooled record delivery failed")
                delivered = False
            delay = DELIVER_S if delivered else min(DELIVER_MAX_S, delay * 2)

    def _annotator(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.annotate_pending(block_s=1.0)
            except Exception:  # noqa: BLE001
                log.exception("AdminComment update failed")
