"""``gpushare mig apply`` and ``gpushare mig reconcile``: the node-side executor from the command line.

Why two commands: ``apply`` changes a node (to an explicit layout, or to what pending jobs ask for);
``reconcile`` only finishes or undoes an interrupted change, resumes a node left drained and recreates
the last applied layout on a GPU a reboot emptied — it is what a boot script or a timer runs (before
slurmd starts, ideally), and it is always safe. Both run as root on the node (they call the
driver, rewrite gres.conf/slurm.conf and restart Slurm's daemons).

With ``[mig] coordination = "controller"`` a third command, ``controller``, runs on the controller host: it
decides which node serves which pending MIG job and owns slurm.conf/gres.conf, while ``apply --from-demand``
on a node follows the target the controller published (gpushare.mig_manager.coordination).

Exit status: 0 applied, already in place, or nothing to do; 1 not done (busy past the timeout, rate
limited, rolled back); ``reconcile`` exits 0 whenever it converged; 2 bad input; 3 an error left a run
in progress — fix the cause, then ``gpushare mig reconcile``.
"""

from __future__ import annotations

import json

import click

from gpushare.config import Config, ConfigError, load_config
from gpushare.gres.device import GpuBackend
from gpushare.gres.errors import GpuError

from gpushare.mig_manager.coordination import controller_pass
from gpushare.mig_manager.device_ops import Layout
from gpushare.mig_manager.exec_settings import Result
from gpushare.policy.fsm import MigSpace
from gpushare.mig_manager.journal import JournalError
from gpushare.mig_manager.node_record import RecordError
from gpushare.policy.layout import parse_layout
from gpushare.policy.profiles import all_profiles
from gpushare.mig_manager.reshape import (build_executor, node_name, reshape_for_demand, restore_after_reset,
                                 slurm_paths)
from gpushare.mig_manager.slurm_actions import command_runner
from gpushare.slurm.client import SlurmClient, SlurmError

_OK = {"applied", "already", "nothing", "proposed"}  # proposed: [policy] mode = observe recorded it


class RunError(click.ClickException):
    """A run stopped on an error; its journal keeps it for reconcile."""

    exit_code = 3


def _load(config: str | None) -> Config:
    try:
        return load_config(config)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def _targets(cfg: Config, backend: GpuBackend, items: tuple[str, ...]) -> Layout:
    """``GPU=LAYOUT`` items against each GPU's model (``0=3g.20gb@4,2g.10gb@2``)."""
    out: Layout = {}
    for item in items:
        index_text, eq, layout = item.partition("=")
        if not eq or not index_text.strip().isdigit():
            raise click.BadParameter(f"{item!r}: expected GPU=LAYOUT, e.g. 0=3g.20gb@4,2g.10gb@0",
                                     param_hint="'--target'")
        index = int(index_text)
        try:
            model = cfg.gpu(backend.gpu(index).model or "")
            out[index] = tuple(i for i in parse_layout(layout, MigSpace.of(model, all_profiles(model))))
        except (ValueError, GpuError) as exc:
            raise click.BadParameter(f"{item!r}: {exc}", param_hint="'--target'") from None
        if any(i.busy for i in out[index]):
            raise click.BadParameter(f"{item!r}: a target has no busy marks (*)", param_hint="'--target'")
    return out


def _report(result: Result, notes: list[str], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"outcome": result.outcome, "detail": result.detail, "plan": notes}))
        return
    for note in notes:
        click.echo(f"plan: {note}")
    click.echo(f"{result.outcome}: {result.detail}")
    if result.outcome not in _OK:
        raise SystemExit(1)


@click.command("apply")
@click.option("--node", default=None, help="Slurm node name (default: [agent] node_name, $SLURMD_NODENAME, host).")
@click.option("--target", "targets", multiple=True, metavar="GPU=LAYOUT",
              help="Wanted layout of one GPU, e.g. 0=3g.20gb@4,2g.10gb@2,1g.5gb@1,1g.5gb@0; repeatable.")
@click.option("--from-demand", is_flag=True, help="Reshape for what pending jobs ask for (squeue --json).")
@click.option("--config", default=None, help="gpushare.toml (default: $GPUSHARE_CONFIG, /etc/slurm/gpushare.toml).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result.")
def apply_command(node: str | None, targets: tuple[str, ...], from_demand: bool, config: str | None,
                  as_json: bool) -> None:
    """Move this node's GPUs to a MIG layout: drain, wait, apply, regenerate GRES, restart, resume.

    With [mig] coordination = "controller", --from-demand follows the target the controller published."""
    if bool(targets) == from_demand:
        raise click.UsageError("give --target GPU=LAYOUT (repeatable) or --from-demand, not both")
    cfg = _load(config)
    try:
        # a configless node has no slurm.conf: its tools then find slurmd's cached copy on their own
        client = (SlurmClient.from_config(cfg) if cfg.mig.coordination == "controller" else
                  SlurmClient(slurm_paths(cfg)[0], cfg.slurm.bin_dir or None))
        executor = build_executor(cfg, node_name(cfg, node), client=client)
        if from_demand:
            result, notes = reshape_for_demand(cfg, executor, client)
        else:
            result, notes = executor.apply(_targets(cfg, executor.backend, targets)), []
    except (GpuError, SlurmError, JournalError, OSError, RuntimeError, ValueError) as exc:  # RecordError too
        raise RunError(f"{exc}\nthe journal keeps the run; fix the cause, then run "
                                   "gpushare mig reconcile") from None
    _report(result, notes, as_json)


@click.command("reconcile")
@click.option("--node", default=None, help="Slurm node name (default: [agent] node_name, $SLURMD_NODENAME, host).")
@click.option("--config", default=None, help="gpushare.toml (default: $GPUSHARE_CONFIG, /etc/slurm/gpushare.toml).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result.")
def reconcile_command(node: str | None, config: str | None, as_json: bool) -> None:
    """Finish or roll back an interrupted repartition, resume the node if we drained it, and recreate the
    last applied layout on a GPU that came back empty (reboot, GPU reset)."""
    cfg = _load(config)
    try:
        executor = build_executor(cfg, node_name(cfg, node))
        result = executor.reconcile()
        restored = restore_after_reset(cfg, executor)
        if restored is not None and result.outcome == "nothing":
            result = restored
    except (GpuError, SlurmError, JournalError, OSError, RuntimeError, ValueError) as exc:
        raise RunError(f"{exc}\nrun gpushare mig reconcile again once the cause is fixed") from None
    if as_json:
        click.echo(json.dumps({"outcome": result.outcome, "detail": result.detail}))
    else:
        click.echo(f"{result.outcome}: {result.detail}")  # converged either way: exit 0


@click.command("controller")
@click.option("--config", default=None, help="gpushare.toml (default: $GPUSHARE_CONFIG, /etc/slurm/gpushare.toml).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result.")
def controller_command(config: str | None, as_json: bool) -> None:
    """On the controller ([mig] coordination = "controller"): write the MIG nodes' published GRES into
    slurm.conf/gres.conf and make Slurm read them, then publish each node's target for the pending jobs."""
    cfg = _load(config)
    if cfg.mig.coordination != "controller":
        raise click.UsageError("gpushare mig controller needs [mig] coordination = \"controller\" "
                               f"(it is {cfg.mig.coordination!r})")
    conf, gres = slurm_paths(cfg)
    restart = command_runner(list(cfg.mig.controller_restart_commands))
    try:
        notes = controller_pass(cfg, SlurmClient(conf, cfg.slurm.bin_dir or None), conf, gres,
                                lambda: restart(""))
    except (SlurmError, JournalError, RecordError, OSError, RuntimeError, ValueError) as exc:
        raise RunError(f"{exc}\nthe nodes keep their reports; gpushare mig controller picks them up again") from None
    if as_json:
        click.echo(json.dumps({"notes": notes}))
    else:
        for note in notes:
            click.echo(note)
