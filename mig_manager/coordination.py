"""Controller coordination (``[mig] coordination = "controller"``): one place decides, files live on the controller.

Why: with the node-side demand path every MIG node's timer reads the same pending jobs and may reshape for
the same job, and each node rewrites slurm.conf/gres.conf, which a configless node does not have and a
controller on another host does not share. Here the work is split by where it can be done:

- **controller** (:func:`controller_pass`, ``gpushare mig controller`` from a timer on the controller host):
  reads every MIG node's report from Slurm, writes the gres.conf lines and ``Gres=`` a node published into
  the controller's own files, makes Slurm read them (``scontrol reconfigure`` on 24.11+, the
  ``controller_restart_commands`` — slurmctld — on 22.05), acknowledges, and then, from the pending jobs,
  decides which node serves which MIG demand (each want is offered to one node only) and publishes each
  chosen node's target layout;
- **node** (:class:`RecordSlurmActions` under the unchanged executor, ``gpushare mig apply --from-demand``
  from the node's timer, see ``gpushare.mig_manager.reshape.follow_controller``): reads its own target,
  drains, waits, changes the GPUs (NVML is only there), publishes what it now has and waits for the
  controller's acknowledgement, restarts its own slurmd where the release needs that (22.05), verifies
  and resumes — with the same journal, steps and crash recovery as on one host.

Everything between the two travels in the node's Slurm record (gpushare.mig_manager.node_record): an
admin-only, munge-authenticated ``scontrol update``, readable from every Slurm host; no shared disk.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from gpushare.atomic import flock_within
from gpushare.config import Config
from gpushare.gpus import GpuModel
from gpushare.gres.device import GpuBackend
from gpushare.gres.gres_conf import gres_conf_lines, node_gres

from gpushare.mig_manager.demand import Want, held_profiles, mark_busy, pending_wants, target_for
from gpushare.mig_manager.device_ops import node_gpus_by_placement, read_layout
from gpushare.policy.fsm import MigSpace
from gpushare.mig_manager.gres_files import GresFileError, rewrite_site_node_gres
from gpushare.mig_manager.journal import JournalError, JournalStore
from gpushare.policy.layout import format_layout, parse_layout
from gpushare.mig_manager.node_record import (RecordError, Report, Target, parse_report, parse_target,
                                              read_records, write_field)
from gpushare.policy.profiles import all_profiles
from gpushare.mig_manager.slurm_actions import NodeStatus, SlurmNodeQueries, gpu_jobs_on
from gpushare.slurm.client import SlurmClient, SlurmError

log = logging.getLogger("gpushare.mig")
# node states in which the controller plans nothing for a node (it could not run the jobs, or an admin has it)
_UNAVAILABLE = {"DOWN", "DRAIN", "DRAINED", "DRAINING", "NOT_RESPONDING", "FUTURE", "FAIL", "MAINT",
                "INVAL", "INVALID", "INVALID_REG", "REBOOT_REQUESTED", "REBOOT_ISSUED", "POWERED_DOWN",
                "POWERING_DOWN", "UNKNOWN"}


def new_token() -> str:
    return uuid.uuid4().hex[:8]


def node_report(backend: GpuBackend, catalogue: Mapping[str, GpuModel], run: str, state: str, dev_dir: str,
                shards: bool, files: str = "-", answered: str = "-") -> Report:
    """What this node has now: per MIG GPU its model and layout, and the gres.conf lines and Gres= for it."""
    gpus = node_gpus_by_placement(backend)
    layouts: dict[int, tuple[str, str]] = {}
    for info in backend.gpus():
        model = catalogue.get(info.model or "")
        if info.mig_current is True and model is not None:
            layouts[info.index] = (model.name, format_layout(read_layout(backend, info.index)))
    return Report(run, state, layouts, node_gres(gpus, shards=shards),
                  tuple(gres_conf_lines(gpus, dev_dir, shards=shards)), files, answered)


class RecordSlurmActions(SlurmNodeQueries):
    """Node side of controller coordination: the executor's Slurm actions without Slurm's files.

    ``write_gres`` publishes the new lines in the node's ``Comment`` (state ``files`` with a fresh token)
    instead of editing slurm.conf/gres.conf; ``reconfigure`` and ``restart`` first wait until the
    controller echoes that token in the node's ``Extra`` — it has written the files and made slurmctld
    read them — then the release decides: 24.11+ applies it by the controller's reconfigure (slurmd
    re-reads or, configless, re-fetches its files), 22.05 needs this node's slurmd restarted
    (``restart``: ``[mig] node_restart_commands``). The token lives in Slurm, so a run killed while
    waiting picks the wait up again in ``reconcile``.
    """

    def __init__(self, client: SlurmClient, node: str, backend: GpuBackend, catalogue: Mapping[str, GpuModel],
                 store: JournalStore, dev_dir: str, shards: bool, restart: Callable[[str], None],
                 wait_s: float, poll_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(client)
        self.node, self.backend, self.catalogue, self.store = node, backend, catalogue, store
        self.dev_dir, self.shards, self._restart = dev_dir, shards, restart
        self.wait_s, self.poll_s, self.clock, self.sleep = wait_s, poll_s, clock, sleep
        self._answered = False  # Slurm answered a status call in this process (see status)

    def status(self, node: str) -> NodeStatus:
        """As on one host, but once Slurm has answered in this run, a tool that fails for a moment is asked
        again (up to ``wait_s``): on a configless node the tools read slurmd's cached configuration, which
        a slurmd restart renews. A first call that fails (at boot, before slurmd) fails at once."""
        deadline = self.clock() + self.wait_s
        while True:
            try:
                status = super().status(node)
                self._answered = True
                return status
            except SlurmError:
                if not self._answered or self.clock() >= deadline:
                    raise
                self.sleep(self.poll_s)

    def write_gres(self, node: str, lines: list[str], gres: str) -> bool:
        prefix = f"NodeName={node} "
        if any(not line.startswith(prefix) for line in lines):
            raise RecordError(f"gres.conf line for another node than {node}: {lines}")
        run = self.store.load(node).run_id or "-"
        before = parse_report(read_records(self.client, node)[0].comment, node)  # a foreign Comment: refused
        report = node_report(self.backend, self.catalogue, run, "files", self.dev_dir, self.shards, new_token())
        report = Report(report.run, "files", report.gpus, gres, tuple(line[len(prefix):] for line in lines),
                        report.files, before.answered if before else "-")
        write_field(self.client, node, "comment", report.encode())
        return True

    def await_controller(self) -> None:
        """Return once the controller has acknowledged this node's published files (or none are pending).

        Slurm failing to answer meanwhile is waited through, up to the same deadline: the controller may be
        restarting to apply these very files (24.11's scontrol then fails at once with "Connection reset by
        peer" where 22.05 and 26.05 wait for it)."""
        deadline = self.clock() + self.wait_s
        while True:
            try:
                record = read_records(self.client, self.node)[0]
            except SlurmError:
                if self.clock() >= deadline:
                    raise
                self.sleep(self.poll_s)
                continue
            report = parse_report(record.comment, self.node)
            target = parse_target(record.extra, self.node)
            if report is None or report.state != "files" or (target is not None and target.written == report.files):
                return
            if self.clock() >= deadline:
                raise RuntimeError(f"the controller has not written {self.node}'s gres.conf lines and "
                                   f"Gres={report.gres} within {self.wait_s:g} s; run `gpushare mig controller` "
                                   "on the controller (its timer), then gpushare mig reconcile here")
            self.sleep(self.poll_s)

    def reconfigure(self) -> bool:
        self.await_controller()
        return self.client.version.reconfigure_applies_gres

    def restart(self, node: str) -> None:
        self.await_controller()
        self._restart(node)


@contextmanager
def _controller_lock(directory: Path) -> Iterator[None]:
    """One controller pass at a time: the controller is the only writer of every node's ``Extra``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ".controller.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if not flock_within(fd, 0):
            raise JournalError(f"another gpushare mig controller holds {path}; let it finish")
        yield
    finally:
        os.close(fd)


def wait_controller_up(client: SlurmClient, timeout_s: float = 60.0, sleep: Callable[[float], None] = time.sleep
                       ) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if "UP" in client.run("scontrol", "ping"):
                return
        except SlurmError:
            pass
        if time.monotonic() >= deadline:
            raise SlurmError(f"slurmctld did not answer within {timeout_s:g} s after its restart")
        sleep(0.2)


def _without(wants: list[Want], served: list[Want]) -> list[Want]:
    """``wants`` less those already served on another node (by job and profile, counted)."""
    left = Counter((w.job_id, w.profile) for w in served)
    out = []
    for want in wants:
        if left[(want.job_id, want.profile)] > 0:
            left[(want.job_id, want.profile)] -= 1
            continue
        out.append(want)
    return out


def controller_pass(cfg: Config, client: SlurmClient, slurm_conf: Path, gres_conf: Path,
                    restart_controller: Callable[[], None], now: float | None = None) -> list[str]:
    """One pass of the controller side; returns what it did, one line each (also logged).

    1. Files: for every node whose report is ``files`` and not yet acknowledged, write its lines and
       ``Gres=`` into our include files beside ``gres_conf``/``slurm_conf`` (``[mig] gres_include`` and
       ``slurm_include``, gpushare.mig_manager.gres_files, only that node's lines; the site's files are
       read only), make Slurm read them once for all such nodes, then acknowledge each in its ``Extra``.
       A pass killed between the write and the acknowledgement writes (no change) and reloads again.
    2. Demand: the pending MIG wants (gpushare.mig_manager.demand, ``[mig]`` partitions, age and per-user
       bounds) are offered node by node, in name order, to nodes that are idle in this protocol (last
       target answered) and available in Slurm; a want one node serves — by an idle instance or by its
       new target — is not offered to the next. Busy instances are those a running job on the node holds
       (the node itself also refuses to destroy an instance with a process in it).
    """
    with _controller_lock(Path(cfg.mig.journal_dir)):
        notes: list[str] = []
        parsed: dict[str, tuple[str, Report, Target | None]] = {}
        for record in read_records(client):
            try:
                report = parse_report(record.comment, record.name)
                target = parse_target(record.extra, record.name)
            except RecordError as exc:
                notes.append(str(exc))
                continue
            if report is not None:
                parsed[record.name] = (record.state, report, target)
        acked = []
        for name, (_, report, target) in sorted(parsed.items()):
            if report.state != "files" or (target is not None and target.written == report.files):
                continue
            try:
                changed = rewrite_site_node_gres(slurm_conf, gres_conf, name, report.node_lines(name), report.gres,
                                                 cfg.mig.slurm_include, cfg.mig.gres_include)
            except GresFileError as exc:  # this node's lines cannot be edited alone: say so, go on with others
                notes.append(f"{name}: {exc}")
                continue
            notes.append(f"{name}: wrote Gres={report.gres} and {len(report.lines)} gres.conf line(s)"
                         + ("" if changed else " (already there)"))
            acked.append(name)
        if acked:
            if cfg.mig.reconfigure and client.version.reconfigure_applies_gres:
                client.run("scontrol", "reconfigure")
                notes.append("scontrol reconfigure")
            else:
                restart_controller()
                wait_controller_up(client)
                notes.append("restarted slurmctld ([mig] controller_restart_commands)")
            for name in acked:
                state, report, target = parsed[name]
                ack = Target(target.run, target.layouts, report.files) if target else Target(report.run, {},
                                                                                            report.files)
                write_field(client, name, "extra", ack.encode())
                parsed[name] = (state, report, ack)
                notes.append(f"{name}: acknowledged files {report.files}")
        notes += _plan(cfg, client, parsed, now)
        for note in notes:
            log.info("%s", note)
        return notes


def _plan(cfg: Config, client: SlurmClient, parsed: Mapping[str, tuple[str, Report, Target | None]],
          now: float | None) -> list[str]:
    notes: list[str] = []
    jobs = client.jobs()
    queries = SlurmNodeQueries(client)
    served: list[Want] = []
    for name, (state, report, target) in sorted(parsed.items()):
        if report.state == "files" or (target is not None and target.layouts and target.run != report.answered):
            notes.append(f"{name}: reshape {target.run if target else report.run} in progress")
            continue
        flags = set(state.upper().replace("*", "").split("+")) & _UNAVAILABLE
        if flags:
            notes.append(f"{name}: {'+'.join(sorted(flags))}, nothing planned")
            continue
        held = held_profiles(gpu_jobs_on(jobs, name, queries.hosts))
        models: dict[int, GpuModel] = {}
        current = {}
        for gpu, (model_name, layout) in report.gpus.items():
            model = cfg.gpus.get(model_name)
            if model is None or not model.mig_capable:
                continue
            try:
                items = parse_layout(layout, MigSpace.of(model, all_profiles(model)))
            except ValueError as exc:
                notes.append(f"{name}: GPU {gpu}: {exc}")
                continue
            current[gpu] = mark_busy(items, held, set())
            models[gpu] = model
        if not models:
            continue
        profiles = {p.name for m in models.values() for p in m.mig_profiles}
        wants = _without(pending_wants(jobs, profiles, cfg.mig.partitions, cfg.mig.demand_min_age_s,
                                       cfg.mig.demand_max_per_user, now=now, node=name), served)
        if not wants:
            continue
        taken: list[Want] = []
        wanted, plan_notes = target_for(models, current, wants, taken)
        served.extend(taken)
        notes += [f"{name}: {note}" for note in plan_notes]
        if wanted:
            run = new_token()
            new = Target(run, {g: format_layout(v) for g, v in wanted.items()}, target.written if target else "-")
            write_field(client, name, "extra", new.encode())
            notes.append(f"{name}: target {run}: " + "; ".join(f"GPU {g}: {t}" for g, t in new.layouts.items()))
    return notes
