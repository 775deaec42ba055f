"""Wiring for one node: an executor built from the configuration, and "reshape for the pending jobs".

Why a separate module: the executor, the demand signal and the Slurm actions are each testable alone;
this is the only place that reads ``[mig]``, opens the device backend and decides which files and
commands the real Slurm gets, so the CLI and the integration test build exactly the same thing.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable

from gpushare.config import Config
from gpushare.gres import open_backend
from gpushare.gres.device import GpuBackend

from gpushare.mig_manager.coordination import RecordSlurmActions, node_report
from gpushare.mig_manager.demand import held_profiles, mark_busy, pending_wants, target_for
from gpushare.mig_manager.device_ops import busy_instance_ids, read_layout
from gpushare.mig_manager.executor import ExecSettings, Executor, Result
from gpushare.policy.fsm import MigSpace
from gpushare.policy.layout import parse_layout
from gpushare.policy.profiles import all_profiles
from gpushare.mig_manager.journal import JournalStore
from gpushare.mig_manager.node_record import parse_report, parse_target, read_records, write_field
from gpushare.mig_manager.slurm_actions import SlurmActions, SlurmNodeActions, command_runner
from gpushare.slurm.client import SlurmClient


def node_name(cfg: Config, explicit: str | None = None) -> str:
    """``--node``, else ``[agent] node_name``, else $SLURMD_NODENAME, else the short host name."""
    return explicit or cfg.agent.node_name or os.environ.get("SLURMD_NODENAME") or \
        socket.gethostname().split(".")[0]


def settings(cfg: Config) -> ExecSettings:
    mig = cfg.mig
    return ExecSettings(drain=mig.drain, wait=mig.wait, wait_timeout_s=mig.wait_timeout_s,
                        verify_timeout_s=mig.verify_timeout_s, poll_s=mig.poll_s,
                        max_per_hour=mig.max_reconfigurations_per_hour, dev_dir=mig.device_dir,
                        cap_device_major=mig.cap_device_major, mode=cfg.policy.mode)


def slurm_paths(cfg: Config) -> tuple[Path, Path]:
    conf = Path(cfg.slurm_conf_path() or "/etc/slurm/slurm.conf")
    return conf, Path(cfg.mig.gres_conf) if cfg.mig.gres_conf else conf.with_name("gres.conf")


def build_executor(cfg: Config, node: str, backend: GpuBackend | None = None,
                   slurm: SlurmActions | None = None, restart: Callable[[str], None] | None = None,
                   hook: Callable[[str], None] | None = None, client: SlurmClient | None = None) -> Executor:
    """The executor for ``node`` as configured; tests may pass their own backend, Slurm, client or restart.

    With ``[mig] coordination = "controller"`` its Slurm actions never touch slurm.conf or gres.conf: the
    new lines go to the controller through the node's record (gpushare.mig_manager.coordination), and
    ``restart`` (default ``[mig] node_restart_commands``) restarts this node's slurmd only."""
    if backend is None:
        backend = open_backend(cfg.agent.device_backend or None)
    store = JournalStore(cfg.mig.journal_dir)
    if slurm is None and cfg.mig.coordination == "controller":
        client = client or SlurmClient(cfg.slurm_conf_path(), cfg.slurm.bin_dir or None)
        mig = cfg.mig
        slurm = RecordSlurmActions(client, node, backend, cfg.gpus, store, mig.device_dir, settings(cfg).shards,
                                   restart or command_runner(list(mig.node_restart_commands)),
                                   wait_s=mig.verify_timeout_s, poll_s=min(mig.poll_s, 1.0))
    elif slurm is None:
        conf, gres = slurm_paths(cfg)
        client = client or SlurmClient(conf, cfg.slurm.bin_dir or None)
        includes = (cfg.mig.slurm_include, cfg.mig.gres_include)
        slurm = (SlurmNodeActions(client, conf, gres, restart, cfg.mig.reconfigure, includes) if restart is not None
                 else SlurmNodeActions.with_commands(client, conf, gres, list(cfg.mig.restart_commands),
                                                     cfg.mig.reconfigure, includes))
    return Executor(node, backend, slurm, store, settings(cfg), hook=hook)


def demand_target(cfg: Config, executor: Executor, client: SlurmClient) -> tuple[dict, list[str]]:
    """Target layout (changed GPUs only) serving the pending MIG jobs, and the planner's notes."""
    backend = executor.backend
    held = held_profiles(executor.slurm.running_gpu_jobs(executor.node))
    current, models = {}, {}
    for info in backend.gpus():
        model = cfg.gpus.get(info.model or "")
        if info.mig_current is not True or model is None or not model.mig_capable:
            continue
        busy = {(gi.profile_name, gi.placement.start) for gi in backend.gpu_instances(info.index)
                if gi.id in busy_instance_ids(backend, info.index)}
        current[info.index] = mark_busy(read_layout(backend, info.index), held, busy)
        models[info.index] = model
    profiles = {p.name for m in models.values() for p in m.mig_profiles}
    wants = pending_wants(client.jobs(), profiles, cfg.mig.partitions, cfg.mig.demand_min_age_s,
                          cfg.mig.demand_max_per_user, node=executor.node)
    if not wants:
        return {}, ["no pending job asks for a MIG profile of this node"]
    return target_for(models, current, wants)


def restore_after_reset(cfg: Config, executor: Executor) -> Result | None:
    """Recreate the last applied layout on GPUs that came back empty; None when there is nothing to do.

    MIG instances do not survive a reboot or GPU reset (docs/mig-profiles.md), while gres.conf still lists
    them and Slurm would hand jobs devices that are gone. Only a GPU with *no* instance is restored
    (nothing can be busy on it, and a layout an admin changed by hand is left alone); the rate limit
    does not apply, since this restores the configuration Slurm already has.
    """
    journal = executor.store.load(executor.node)
    if journal.phase != "done":
        return None
    target = {}
    for gpu_text, layout in journal.target.items():
        info = executor.backend.gpu(int(gpu_text))
        model = cfg.gpus.get(info.model or "")
        if layout == "empty" or model is None or info.mig_current is not True or \
                read_layout(executor.backend, info.index):
            continue
        target[info.index] = parse_layout(layout, MigSpace.of(model, all_profiles(model)))
    return executor.apply(target, rate_limit=False) if target else None


def reshape_for_demand(cfg: Config, executor: Executor, client: SlurmClient) -> tuple[Result, list[str]]:
    """Reconcile any interrupted run and restore a reset GPU, then reshape for pending jobs (rate-limited).

    With ``[mig] coordination = "controller"`` the node does not read the demand: it follows the target
    the controller published for it (:func:`follow_controller`)."""
    if cfg.mig.coordination == "controller":
        return follow_controller(cfg, executor, client)
    executor.reconcile()
    restore_after_reset(cfg, executor)
    target, notes = demand_target(cfg, executor, client)
    if not target:
        detail = "; ".join(notes) if notes else "idle instances already serve the pending jobs"
        return Result("nothing", f"no change: {detail}"), notes
    return executor.apply(target), notes


_REPORTED = {"applied": "done"}  # executor outcome -> report state (the others keep their names)
_FINAL = {"done": "done", "rolled_back": "rolled_back"}  # journal phase -> report state


def follow_controller(cfg: Config, executor: Executor, client: SlurmClient) -> tuple[Result, list[str]]:
    """Node side of controller coordination: apply the target in this node's ``Extra`` once, report in ``Comment``.

    Reconciles first (an interrupted run is finished or rolled back, waiting again for the controller
    where it had published files), restores a GPU a reset emptied, then applies a target whose run this
    node has not answered yet, under the same executor, journal and rate limit as on one host. Whatever
    happened, the node's report ends up naming the run, its outcome and the GPUs' actual layouts, which
    is what the controller plans from.
    """
    node = executor.node
    executor.reconcile()
    restore_after_reset(cfg, executor)
    record = read_records(client, node)[0]
    target = parse_target(record.extra, node)
    report = parse_report(record.comment, node)
    journal = executor.store.load(node)
    answered = target is None or not target.layouts or (report is not None and report.answered == target.run) or (
        journal.run_id == target.run and journal.phase != "running")
    if target is not None and not answered:
        layout = {}
        for gpu, text in target.layouts.items():
            model = cfg.gpu(executor.backend.gpu(gpu).model or "")
            layout[gpu] = parse_layout(text, MigSpace.of(model, all_profiles(model)))
        result = executor.apply(layout, run_id=target.run)
        run, state = target.run, _REPORTED.get(result.outcome, result.outcome)
        notes = [f"target {target.run} from the controller: "
                 + "; ".join(f"GPU {g}: {t}" for g, t in sorted(target.layouts.items()))]
    else:
        result, notes = Result("nothing", "no new target from the controller"), []
        if report is not None and report.state != "files":
            run, state = report.run, report.state
        else:
            run, state = (journal.run_id, _FINAL.get(journal.phase, "idle")) if journal.run_id else ("-", "idle")
    last = target.run if target is not None else (report.answered if report is not None else "-")
    text = node_report(executor.backend, cfg.gpus, run, state, cfg.mig.device_dir, settings(cfg).shards,
                       answered=last).encode()
    if text != record.comment:
        write_field(client, node, "comment", text)
    return result, notes
