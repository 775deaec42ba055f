"""The node-side MIG executor: move a node's GPUs to a target layout without touching a busy instance.

Slurm cannot repartition MIG (docs/architecture.md), so the executor does what sites do by hand, one journaled step
at a time (``gpushare.mig_manager.journal.STEPS``):

  planned       journal written: layout before, target, the destroy/create ops, the drain Reason
  drained       node drained with a Reason naming the run (``[mig] drain = "node"``; "none" skips it)
  idle          no process and no running Slurm job uses an instance to be destroyed
  applied       each op through the backend, explicit placements, each op journaled when done
  gres_written  this node's gres.conf lines and slurm.conf Gres= regenerated from the backend's state
  restarted     Slurm made to read them: ``scontrol reconfigure`` where that applies a layout (24.11+),
                else (or when it did not show) slurmctld then slurmd restarted (see slurm_actions)
  verified      slurmctld reports the new GPU counts and the node is not INVAL
  resumed       the node resumed — only if it still carries our own drain Reason

Under ``[policy] mode = "observe"`` a new run stops after planning: the reshape it would make (layouts, ops,
the include files it would write, the restart or reconfigure) is logged and written to
``<journal_dir>/<node>.proposal.json``, and no device, drain, file or daemon is touched; ``off`` plans nothing.
Reconciling a run begun before the switch still finishes or rolls it back (a half-done reshape is worse).

Assert, then apply (docs/style.md #4): a target already in place with Slurm agreeing returns at once, and every
step checks before acting, so a rerun is harmless. ``reconcile`` converges after a kill anywhere: a run
that changed no device yet is rolled back (resume, done); one that did is finished, and if an instance it
must destroy is busy past the timeout it is rolled back instead (created instances destroyed when idle,
destroyed ones recreated), Slurm's files rewritten from the GPU's actual state, and the node resumed.
A busy instance is never destroyed; the driver's IN_USE is the last line of defence.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from typing import Callable

from gpushare.atomic import write_text_atomic
from gpushare.gpus import BUILTIN_GPUS
from gpushare.gres.device import GpuBackend
from gpushare.gres.errors import GpuError
from gpushare.gres.gres_conf import gres_conf_lines, node_gpus, node_gres

from gpushare.mig_manager.device_ops import (Layout, create_instance, destroy_instance, diff_ops, has_processes,
                                    node_gpus_by_placement, read_layout)
from gpushare.mig_manager.gres_files import ensure_cap_devices
from gpushare.mig_manager.exec_settings import ExecSettings, Outcome, Result
from gpushare.policy.fsm import MigSpace
from gpushare.mig_manager.journal import STEPS, Journal, JournalStore
from gpushare.policy.layout import check_layout, format_layout
from gpushare.policy.profiles import all_profiles
from gpushare.mig_manager.slurm_actions import NodeStatus, SlurmActions, gpu_counts

log = logging.getLogger("gpushare.mig")
# How long a reconfigure may take to show the new layout before the executor restarts the daemons instead
# (measured: about 0.3 s on 24.11 and 26.05; capped by [mig] verify_timeout_s).
RECONFIGURE_WAIT_S = 20.0


class Blocked(Exception):
    """An instance to be destroyed stayed busy past the timeout."""


class Executor:
    """Applies and reconciles one node. ``hook(label)`` runs after every journaled step (tests crash there)."""

    def __init__(self, node: str, backend: GpuBackend, slurm: SlurmActions, store: JournalStore,
                 settings: ExecSettings = ExecSettings(), clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep, hook: Callable[[str], None] | None = None) -> None:
        self.node, self.backend, self.slurm, self.store = node, backend, slurm, store
        self.settings, self.clock, self.sleep = settings, clock, sleep
        self._restarted_at: float | None = None  # when this run restarted the node's slurmd, if it did
        self.hook = hook or (lambda label: None)

    # --- entry points --------------------------------------------------------------------------
    def apply(self, target: Layout, *, rate_limit: bool = True, run_id: str | None = None) -> Result:
        """Move the GPUs named in ``target`` to exactly those instances (``rate_limit=False``: restores).

        ``run_id`` names the run (default: a fresh one); controller coordination passes the id of the
        target the controller published, so the node's report and journal name the same run."""
        with self.store.lock(self.node):
            if self.store.load(self.node).phase == "running":
                self._reconcile()
            return self._apply(target, rate_limit, run_id)

    def reconcile(self) -> Result:
        """Finish or roll back an interrupted run; resume a node we left drained. Safe to run any time."""
        with self.store.lock(self.node):
            return self._reconcile()

    def _apply(self, target: Layout, rate_limit: bool, run_id: str | None = None) -> Result:
        journal = self.store.load(self.node)
        for gpu, items in target.items():
            info = self.backend.gpu(gpu)
            if info.mig_current is not True:
                raise ValueError(f"GPU {gpu} of {self.node} is not in MIG mode; enable it first "
                                 "(nvidia-smi -i N -mig 1, then a GPU reset)")
            model = BUILTIN_GPUS.get(info.model or "")
            if model is not None:  # else the driver is the judge
                check_layout(items, MigSpace.of(model, all_profiles(model)))
        current = {gpu: read_layout(self.backend, gpu) for gpu in target}
        ops = diff_ops(current, target)
        status = self.slurm.status(self.node)
        if not ops and gpu_counts(status.gres) == self._actual_counts() and not status.invalid:
            return Result("already", "layout in place and Slurm agrees")
        now = self.clock()
        if ops and rate_limit and journal.recent(now) >= self.settings.max_per_hour:
            return Result("rate_limited", f"{journal.recent(now)} reshapes of {self.node} in the last hour "
                          f"(max {self.settings.max_per_hour}, [mig] max_reconfigurations_per_hour)")
        run_id = run_id or uuid.uuid4().hex[:8]
        if self.settings.mode != "enforce":
            return self._propose(run_id, current, target, ops, now)
        journal = Journal(node=self.node, run_id=run_id, phase="running", step="planned",
                          before={str(g): format_layout(v) for g, v in current.items()},
                          target={str(g): format_layout(v) for g, v in target.items()}, ops=ops,
                          drain_reason=f"{self.settings.reason_prefix} reshape {run_id}",
                          started_at=now, history=journal.history)
        journal.note(now, "planned: " + "; ".join(op.text() for op in ops))
        self._save(journal, "planned")
        return self._forward(journal)

    def _propose(self, run_id: str, current: Layout, target: Layout, ops: list, now: float) -> Result:
        """Observe (or off): record the reshape this run would make and make none of it."""
        if self.settings.mode == "off":
            return Result("nothing", "[policy] mode = off: no reshape planned")
        files = getattr(self.slurm, "includes", None)
        restart = "scontrol reconfigure" if getattr(getattr(getattr(self.slurm, "client", None), "version", None),
                                                    "reconfigure_applies_gres", False) else "restart_commands"
        proposal = {"node": self.node, "run": run_id, "at": now, "mode": self.settings.mode,
                    "before": {str(g): format_layout(v) for g, v in current.items()},
                    "target": {str(g): format_layout(v) for g, v in target.items()},
                    "ops": [op.text() for op in ops], "drain": self.settings.drain,
                    "would_write": list(files) if files else "the node's report (controller coordination)",
                    "would_apply_by": restart}
        path = self.store.directory / f"{self.node}.proposal.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(proposal, sort_keys=True) + "\n")
        text = (f"would reshape {self.node} ({run_id}): " + "; ".join(op.text() for op in ops)
                if ops else f"would rewrite {self.node}'s GRES ({run_id}): Slurm disagrees with the layout")
        log.info("[policy] mode = observe: %s (recorded in %s)", text, path)
        return Result("proposed", f"{text} (observe; recorded in {path})")

    def _reconcile(self) -> Result:
        journal = self.store.load(self.node)
        if journal.phase != "running":
            status = self.slurm.status(self.node)
            if status.drained and status.reason.startswith(self.settings.reason_prefix + " "):
                self.slurm.resume(self.node)  # our Reason, but no run in progress: a leftover
                return Result("rolled_back", f"resumed {self.node}, drained by an earlier run")
            return Result("nothing", "no run in progress")
        if journal.mode == "rollback" or STEPS.index(journal.step) < STEPS.index("idle"):
            return self._rollback(journal, "" if journal.mode == "rollback" else
                                  "interrupted before any device change")
        self._note(journal, f"reconcile: continuing after step {journal.step}")
        self._drain_again(journal)
        return self._forward(journal)

    def _drain_again(self, journal: Journal) -> None:
        """A node lost mid-reshape comes back undrained (set DOWN, then resumed by hand or by
        ReturnToService), with Slurm still offering its old layout: drain it again with the run's Reason
        before the rest of the reshape, so no job starts on an instance being changed. A node still DOWN,
        or drained by someone else, is left as it is."""
        if not journal.drain_reason or self.settings.drain == "none" or journal.step in ("planned", "resumed"):
            return  # "resumed": the run had ended its reshape and resumed the node itself
        status = self.slurm.status(self.node)
        if not status.drained and "DOWN" not in status.flags:
            self.slurm.drain(self.node, journal.drain_reason)
            self._note(journal, f"{self.node} came back undrained mid-reshape ({status.state}): drained again")

    # --- forward -------------------------------------------------------------------------------
    def _forward(self, journal: Journal) -> Result:
        steps: list[tuple[str, Callable[[Journal], None]]] = [
            ("drained", self._drain), ("idle", self._wait_idle), ("applied", self._apply_ops),
            ("gres_written", self._write_files), ("restarted", self._restart),
            ("verified", self._verify), ("resumed", self._resume)]
        for name, step in steps:
            if STEPS.index(name) <= STEPS.index(journal.step):
                continue
            try:
                step(journal)
            except Blocked as exc:
                return self._rollback(journal, str(exc))
            except GpuError as exc:  # the driver refused a change: undo what was done, say why
                if exc.gpu_lost:
                    raise
                return self._rollback(journal, f"driver refused: {exc}")
            self._save(journal, name)
        return self._finish(journal, "done", "applied",
                            "; ".join(f"GPU {g}: {t}" for g, t in journal.target.items()))

    def _drain(self, journal: Journal) -> None:
        if self.settings.drain == "none":
            return
        status = self.slurm.status(self.node)
        if status.drained and status.reason != journal.drain_reason:
            journal.drain_reason = ""  # drained by someone else: leave their Reason, never resume it
            self._note(journal, f"node already drained ({status.reason!r}); it stays drained afterwards")
            return
        if not status.drained:
            self.slurm.drain(self.node, journal.drain_reason)

    def _busy(self, journal: Journal) -> list[str]:
        """Why the remaining destroys cannot run now (empty: they can)."""
        pending = [op for op in journal.ops if op.kind == "destroy" and not op.done]
        if not pending:
            return []
        jobs = self.slurm.running_gpu_jobs(self.node)
        held: Counter[str] = Counter()
        for types in jobs.values():
            held.update(types)
        reasons = []
        for op in pending:
            if has_processes(self.backend, op.gpu, op.profile, op.start):
                reasons.append(f"{op.text()}: a process runs in it")
            elif self.settings.wait == "node" and jobs:
                reasons.append(f"{op.text()}: GPU jobs {', '.join(sorted(jobs))} run on {self.node}")
            elif op.profile in held or "*" in held:
                ids = [j for j, t in jobs.items() if op.profile in t or "*" in t]
                reasons.append(f"{op.text()}: jobs {', '.join(sorted(ids))} hold gpu:{op.profile}")
        return reasons

    def _wait_idle(self, journal: Journal) -> None:
        deadline = self.clock() + self.settings.wait_timeout_s
        while True:
            reasons = self._busy(journal)
            if not reasons:
                return
            if self.clock() >= deadline:
                raise Blocked(f"still busy after {self.settings.wait_timeout_s:g} s: {reasons[0]}")
            self.sleep(self.settings.poll_s)

    def _apply_ops(self, journal: Journal) -> None:
        for index, op in enumerate(journal.ops):
            if op.done:
                continue
            if op.kind == "destroy":
                self._wait_idle(journal)  # assert again right before the irreversible call
                destroy_instance(self.backend, op)
            else:
                create_instance(self.backend, op)
            op.done = True
            self._note(journal, f"done: {op.text()}")
            self._save(journal, f"op{index}")

    # --- Slurm side ----------------------------------------------------------------------------
    def _actual_counts(self) -> Counter[str]:
        return gpu_counts(node_gres(node_gpus(self.backend), shards=False))

    def _write_files(self, journal: Journal) -> None:
        """This node's gres.conf lines and Gres= from the GPUs' actual state (not from the plan)."""
        gpus = node_gpus_by_placement(self.backend)
        if self.settings.cap_device_major:
            minors = [m for g in gpus for s in (g.mig or ()) for m in (s.gi_cap_minor, s.ci_cap_minor)
                      if m is not None]
            ensure_cap_devices(self.settings.dev_dir, minors, self.settings.cap_device_major)
        lines = gres_conf_lines(gpus, self.settings.dev_dir, shards=self.settings.shards, node_name=self.node)
        journal.expected_gres = node_gres(gpus, shards=self.settings.shards)
        self.slurm.write_gres(self.node, lines, journal.expected_gres)

    def _restart(self, journal: Journal) -> None:
        """Make Slurm read the new files when a device changed (cap minors may differ at equal counts) or
        Slurm disagrees: ``scontrol reconfigure`` first where the release applies a layout that way, the
        restart commands when it does not or when Slurm does not show the layout in time.

        A second restart after a crash is harmless; a missed one would leave Slurm on stale devices.
        """
        status = self.slurm.status(self.node)
        if not (any(op.done or op.undone for op in journal.ops) or status.invalid or
                gpu_counts(status.gres) != gpu_counts(journal.expected_gres)):
            return
        if self.slurm.reconfigure():
            self._note(journal, f"scontrol reconfigure for Gres={journal.expected_gres}")
            left = self._settled(journal, min(self.settings.verify_timeout_s, RECONFIGURE_WAIT_S))
            if left is None:
                return
            self._note(journal, f"reconfigure left {self.node} at {left.state} Gres={left.gres}")
        self._note(journal, f"restarting Slurm daemons for Gres={journal.expected_gres}")
        self._restarted_at = self.clock()
        self.slurm.restart(self.node)

    def _verify(self, journal: Journal) -> None:
        status = self._settled(journal, self.settings.verify_timeout_s)
        if status is not None:
            raise RuntimeError(f"Slurm shows {self.node} as {status.state} Gres={status.gres}, expected "
                               f"Gres={journal.expected_gres}; see slurmctld's log, then run "
                               "gpushare mig reconcile")

    def _settled(self, journal: Journal, timeout_s: float) -> NodeStatus | None:
        """None once Slurm shows the journal's GPU counts on a valid, responding node; else, after
        ``timeout_s``, the last status seen."""
        want = gpu_counts(journal.expected_gres)
        deadline = self.clock() + timeout_s
        while True:
            status = self.slurm.status(self.node)
            # After a restart, the node's new slurmd must have registered: until then a restarted slurmctld
            # shows the configured counts from its files, and jobs it starts on the node get no device
            # (measured on 22.05: CUDA_VISIBLE_DEVICES empty for jobs placed before the registration).
            registered = (self._restarted_at is None or status.slurmd_started is None
                          or status.slurmd_started >= int(self._restarted_at) - 1)
            settled = not (status.flags & {"UNKNOWN", "NOT_RESPONDING"}) and registered
            if gpu_counts(status.gres) == want and not status.invalid and settled:
                return None
            if self.clock() >= deadline:
                return status
            self.sleep(min(self.settings.poll_s, 0.5))

    def _resume(self, journal: Journal) -> None:
        status = self.slurm.status(self.node)
        if journal.drain_reason and status.drained and status.reason == journal.drain_reason:
            self.slurm.resume(self.node)

    # --- rollback ------------------------------------------------------------------------------
    def _rollback(self, journal: Journal, why: str) -> Result:
        """Undo done ops where safe, make Slurm match the GPUs, resume. Idempotent like the forward path."""
        if journal.mode != "rollback":
            journal.mode = "rollback"
            self._note(journal, f"rolling back: {why}")
            self._save(journal, "rollback")
        kept = []
        for index in reversed(range(len(journal.ops))):
            op = journal.ops[index]  # done or not: the op in flight at a crash may be half done
            if op.undone:
                continue
            try:
                if op.kind == "create" and has_processes(self.backend, op.gpu, op.profile, op.start):
                    kept.append(op.text())  # in use already: never destroy a busy instance
                    continue
                changed = (destroy_instance if op.kind == "create" else create_instance)(self.backend, op)
            except GpuError as exc:
                if exc.gpu_lost:
                    raise
                kept.append(f"{op.text()} ({exc.code.name})")
                continue
            if op.done or changed:
                op.undone = True
                self._save(journal, f"undo{index}")
        if STEPS.index(journal.step) >= STEPS.index("idle"):  # the devices may have changed
            self._write_files(journal)
            self._save(journal, "rollback_files")
            self._restart(journal)
            self._verify(journal)
        self._resume(journal)
        detail = why or "rolled back"
        if kept:
            detail += f"; kept busy {', '.join(kept)}"
        return self._finish(journal, "rolled_back", "busy" if why.startswith("still busy") else "rolled_back",
                            detail)

    # --- journal -------------------------------------------------------------------------------
    def _finish(self, journal: Journal, phase: str, outcome: Outcome, detail: str) -> Result:
        journal.phase = phase  # type: ignore[assignment]
        if phase == "done":
            journal.history.append(self.clock())
        self._note(journal, f"{phase}: {detail}")
        self._save(journal, phase)
        return Result(outcome, detail)

    def _note(self, journal: Journal, text: str) -> None:
        log.info("%s: %s", self.node, text)
        journal.note(self.clock(), text)

    def _save(self, journal: Journal, label: str) -> None:
        if label in STEPS:
            journal.step = label
        self.store.save(journal)
        self.hook(label)
