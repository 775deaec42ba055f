"""``gpushare mig``: list a model's maximal MIG layouts and plan a repartition, without touching a GPU.

Why a CLI over pure code: admins check what a layout change would do (and why) before letting the agent
do it, and the same command documents the layout syntax (``3g.20gb@0*,2g.10gb@4,1g.5gb@6``; ``*`` = busy).
Bad input is a usage error through click's own path (exit 2, one line naming the bad item). ``plan``
exits 1 when some wanted profile cannot be served without touching a busy instance.
"""

from __future__ import annotations

import json

import click

from gpushare.gpus import GpuModel, parse_target

from gpushare.policy.fsm import FsmTable, MigSpace, fsm_table
from gpushare.policy.layout import Instance, format_layout, parse_layout
from gpushare.policy.planner import describe, plan, plan_profile_set
from gpushare.policy.profiles import all_profiles, select_profiles


def _model(gpu: str) -> GpuModel:
    try:
        model, _ = parse_target(gpu)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--gpu'") from None
    if not model.mig_capable:
        raise click.BadParameter(f"{model.name} does not support MIG", param_hint="'--gpu'")
    return model


def _profile_set(model: GpuModel, everything: bool, listed: str | None) -> tuple[str, ...]:
    if everything and listed:
        raise click.UsageError("use --all-profiles or --profiles, not both")
    if listed:
        names = tuple(n.strip().lower() for n in listed.split(",") if n.strip())
        for name in names:
            try:
                model.mig_profile(name)
            except KeyError as exc:
                raise click.BadParameter(exc.args[0], param_hint="'--profiles'") from None
        return plan_profile_set(model, (), names)
    return all_profiles(model) if everything else select_profiles(model)


def _strip(space: MigSpace, layout: frozenset) -> str:
    """A slice map: each instance as its compute size repeated over its memory slices, '.' = free."""
    cells: list[str] = []
    slice_ = 0
    for name, start in sorted(layout, key=lambda p: p[1]):
        cells.extend("." for _ in range(start - slice_))
        profile = space.profile(name)
        cells.append(str(profile.compute_slices) * profile.memory_slices)
        slice_ = start + profile.memory_slices
    cells.extend("." for _ in range(space.memory_slices - slice_))
    return "|".join(cells)


def _layout_json(table: FsmTable, layout: frozenset) -> dict:
    space = table.space
    return {
        "layout": format_layout(layout),
        "instances": [{"profile": n, "start": s, "memory_slices": space.profile(n).memory_slices,
                       "compute_slices": space.profile(n).compute_slices}
                      for n, s in sorted(layout, key=lambda p: p[1])],
        "compute_slices": sum(space.profile(n).compute_slices for n, _ in layout),
        "free_memory_slices": list(space.free_slices(layout)),
    }


@click.group(name="mig")
def command() -> None:
    """MIG layouts and repartition plans; apply/reconcile change a node (root, on the node)."""


@command.command()
@click.option("--gpu", required=True, help="GPU model from the catalogue, e.g. a100-40gb.")
@click.option("--all-profiles", "everything", is_flag=True,
              help="Include the double-memory 1g and the +me profiles.")
@click.option("--profiles", "listed", metavar="P1,P2,...", help="Exact profile set to use.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def layouts(gpu: str, everything: bool, listed: str | None, as_json: bool) -> None:
    """List the maximal layouts (final states) of a GPU model."""
    model = _model(gpu)
    table = fsm_table(model, _profile_set(model, everything, listed))
    names = [p.name for p in table.space.profiles]
    if as_json:
        click.echo(json.dumps({"gpu": model.name, "profiles": names,
                               "placement_sets": len(table.states) - 1,
                               "maximal_layouts": [_layout_json(table, m) for m in table.maximal]},
                              indent=2))
        return
    click.echo(f"{model.name}: {len(table.maximal)} maximal layouts, {len(table.states) - 1} non-empty "
               f"placement sets; profiles: {', '.join(names)}")
    width = max(len(_strip(table.space, m)) for m in table.maximal)
    for n, layout in enumerate(table.maximal, 1):
        click.echo(f"{n:>4}  {_strip(table.space, layout):<{width}}  {format_layout(layout)}")


@command.command("plan")
@click.option("--gpu", required=True, help="GPU model from the catalogue, e.g. a100-40gb.")
@click.option("--current", default="empty", show_default=True, metavar="LAYOUT",
              help="Instances now, e.g. 3g.20gb@0*,2g.10gb@4 (* = busy).")
@click.option("--want", "wants", multiple=True, required=True, metavar="PROFILE",
              help="Wanted profile; repeat or comma-separate.")
@click.option("--busy", "busy", multiple=True, metavar="PROFILE@START",
              help="Mark an instance of --current busy (same as a * after it).")
@click.option("--all-profiles", "everything", is_flag=True,
              help="Count reachability over all profiles, not only the classic ones.")
@click.option("--in-order", is_flag=True, help="Serve wants in the order given, not largest first.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plan_command(gpu: str, current: str, wants: tuple[str, ...], busy: tuple[str, ...],
                 everything: bool, in_order: bool, as_json: bool) -> None:
    """Print the actions that serve the wanted profiles, and why."""
    model = _model(gpu)
    base = all_profiles(model) if everything else select_profiles(model)
    want_list = [w.strip().lower() for item in wants for w in item.split(",") if w.strip()]
    for want in want_list:
        if not any(p.name == want for p in model.mig_profiles):
            known = ", ".join(p.name for p in model.mig_profiles)
            raise click.BadParameter(f"{model.name} has no MIG profile {want!r} (known: {known})",
                                     param_hint="'--want'")
    space = MigSpace.of(model, all_profiles(model))
    try:
        instances = list(parse_layout(current, space))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--current'") from None
    for item in busy:
        text = item.strip().rstrip("*").lower()
        matches = [i for i, inst in enumerate(instances) if inst.text().rstrip("*") == text]
        if not matches:
            raise click.BadParameter(f"{item!r} is not an instance of --current "
                                     f"({format_layout(instances)})", param_hint="'--busy'")
        instances[matches[0]] = Instance(instances[matches[0]].profile, instances[matches[0]].start, True)
    result = plan(model, instances, want_list, profiles=base, in_order=in_order)
    if as_json:
        click.echo(json.dumps({
            "gpu": model.name, "profiles": list(result.profiles),
            "current": format_layout(instances), "wants": want_list,
            "actions": [{"action": a.kind, "profile": a.profile, "start": a.start, "reason": a.reason}
                        for a in result.actions],
            "assignments": [None if a is None else {"profile": a[0], "start": a[1]}
                            for a in result.assignments],
            "notes": list(result.notes), "unmet": [want_list[i] for i in result.unmet],
            "result": format_layout(result.final),
            "reachable_before": result.reach_before, "reachable_after": result.reach_after,
            "maximal_layouts": result.maximal_total}, indent=2))
    else:
        click.echo(describe(result))
    if result.unmet:
        missing = ", ".join(want_list[i] for i in result.unmet)
        raise click.ClickException(f"cannot serve {missing} without touching a busy instance; "
                                   "wait for a job to finish or pick another GPU")


def _register_executor_commands() -> None:
    """``apply``, ``reconcile`` (node side) and ``controller`` (gpushare.mig_manager.mig_exec_cli) join the pure
    commands above."""
    from gpushare.mig_manager.mig_exec_cli import apply_command, controller_command, reconcile_command

    command.add_command(apply_command)
    command.add_command(reconcile_command)
    command.add_command(controller_command)


_register_executor_commands()
