"""The MIG planner: which instances to destroy and create so that wanted profiles get an idle instance.

Input: a model, the current instances with busy/idle flags, and the wanted profiles. Output: a
:class:`Plan` — ordered destroy/create actions with explicit placements, each with a one-line reason, plus
which instance serves each want. The plan is pure; the executor (node side) applies it.

For each want, in order of preference (MIGM §2.3, §4.2):

1. **Reuse** an idle instance of exactly that profile — no reconfiguration. All wants claim their reusable
   instances first, so serving one want never destroys an idle instance another want could have used.
2. **Create** in free slices. Among the legal placements pick the one whose successor state keeps the most
   maximal layouts reachable (MIGM Algorithm 3). Ties go to the *highest* start slice: 4g and 7g can only
   start at slice 0 and 3g at 0 or 4, so packing small instances towards the top keeps the big starts free
   (it is also where the driver auto-places small profiles).
3. **Fusion / fission**: destroy idle instances overlapping one placement of the wanted profile (several
   small neighbours = fusion, one larger instance = fission) and create it there. Among candidates, the
   fewest destroyed memory slices win (keep what is already built), then fewer instances, then
   reachability, then the highest start. Busy instances, and instances assigned to an earlier want of the
   same plan, are never touched.

Wants are served largest first by default (a small instance placed first can only take room from a large
one, never the other way round); ``in_order=True`` serves them as given. Anything left over is reported as
unmet with the instances that block it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from gpushare.gpus import GpuModel

from gpushare.policy.fsm import FsmTable, MigSpace, Placement, State, fsm_table
from gpushare.policy.layout import Instance, check_layout, format_layout
from gpushare.policy.profiles import select_profiles


@dataclass(frozen=True)
class Action:
    """One step for the executor: destroy or create a GPU instance at an explicit placement."""

    kind: Literal["destroy", "create"]
    profile: str
    start: int
    reason: str

    def text(self) -> str:
        return f"{self.kind} {self.profile}@{self.start}"


@dataclass(frozen=True)
class Plan:
    """What to do, and why. ``final`` marks the instances assigned to wants as busy."""

    model: str
    profiles: tuple[str, ...]  # the profile set the reachability counts are over
    actions: tuple[Action, ...]
    assignments: tuple[Placement | None, ...]  # per want, in the order given; None when unmet
    notes: tuple[str, ...]  # per want, in the order given: how it is served or why not
    final: tuple[Instance, ...]
    reach_before: int  # maximal layouts reachable from the current state
    reach_after: int  # ... from the final state
    maximal_total: int  # maximal layouts of the profile set

    @property
    def unmet(self) -> tuple[int, ...]:
        """Indices of the wants that could not be served."""
        return tuple(i for i, a in enumerate(self.assignments) if a is None)


def plan_profile_set(
    model: GpuModel, names: Iterable[str] = (), profiles: Sequence[str] | None = None
) -> tuple[str, ...]:
    """The profile set for planning: the given one (classic by default) plus any profile in use."""
    base = select_profiles(model) if profiles is None else tuple(profiles)
    order = {p.name: i for i, p in enumerate(model.mig_profiles)}
    chosen = set(base)
    for name in names:
        model.mig_profile(name)  # raises KeyError naming the known profiles
        chosen.add(name)
    return tuple(sorted(chosen, key=order.__getitem__))


def choose_placement(table: FsmTable, state: State, profile: str) -> tuple[Placement, int] | None:
    """MIGM Algorithm 3: the free legal placement with the highest successor reachability (ties: higher start)."""
    best: tuple[int, int] | None = None
    for start in table.space.profile(profile).placements:
        reach = table.reach(state | {(profile, start)}) if (profile, start) not in state else 0
        if reach and (best is None or (reach, start) > best):
            best = (reach, start)
    return None if best is None else ((profile, best[1]), best[0])


def _slices(space: MigSpace, placement: Placement) -> str:
    span = space.span(placement)
    return f"slice {span[0]}" if len(span) == 1 else f"slices {span[0]}-{span[-1]}"


def _alternatives(table: FsmTable, state: State, profile: str, chosen: int) -> str:
    others = [f"@{s}: {table.reach(state | {(profile, s)})}" for s in table.space.profile(profile).placements
              if s != chosen and table.reach(state | {(profile, s)})]
    return f" (other placements: {', '.join(others)})" if others else ""


def _fuse_or_split(
    table: FsmTable, insts: dict[Placement, Instance], locked: set[Placement], want: str
) -> tuple[tuple[Placement, ...], Placement, int] | str:
    """Best placement reachable by destroying idle overlapping instances, or a line saying what blocks."""
    space = table.space
    state = frozenset(insts)
    best: tuple[tuple[int, int, int, int], tuple[Placement, ...], Placement, int] | None = None
    blocked: dict[str, list[int]] = {}
    for start in space.profile(want).placements:
        target = (want, start)
        span = set(space.span(target))
        hits = tuple(sorted((p for p in state if span & set(space.span(p))), key=lambda p: p[1]))
        stuck = [insts[p] for p in hits if p in locked]
        if stuck:
            why = ", ".join(("busy " if i.busy else "assigned ") + i.text().rstrip("*") for i in stuck)
            blocked.setdefault(why, []).append(start)
            continue
        after = (state - set(hits)) | {target}
        reach = table.reach(after)
        if not reach:
            blocked.setdefault("the compute budget or max count", []).append(start)
            continue
        cost = (sum(space.profile(p[0]).memory_slices for p in hits), len(hits), -reach, -start)
        if best is None or cost < best[0]:
            best = (cost, hits, target, reach)
    if best is None:
        return "no room: " + "; ".join(
            f"@{','.join(map(str, starts))} blocked by {why}" for why, starts in blocked.items())
    return best[1], best[2], best[3]


def plan(
    model: GpuModel,
    current: Iterable[Instance],
    wants: Sequence[str],
    *,
    profiles: Sequence[str] | None = None,
    in_order: bool = False,
) -> Plan:
    """Plan actions so that each wanted profile gets an idle instance; never touch a busy one."""
    current = tuple(current)
    names = plan_profile_set(model, [i.profile for i in current] + list(wants), profiles)
    table = fsm_table(model, names)
    space = table.space
    check_layout(current, space)
    insts: dict[Placement, Instance] = {i.placement: i for i in current}
    locked = {p for p, i in insts.items() if i.busy}
    actions: list[Action] = []
    assignments: list[Placement | None] = [None] * len(wants)
    notes = [""] * len(wants)

    def size(i: int) -> tuple[int, int]:
        p = space.profile(wants[i])
        return (-p.memory_slices, -p.compute_slices)

    order = range(len(wants)) if in_order else sorted(range(len(wants)), key=lambda i: (size(i), i))
    for i in order:  # first pass: reuse, so no want destroys an idle instance another could use
        idle = sorted((p for p, inst in insts.items() if inst.profile == wants[i] and p not in locked),
                      key=lambda p: -p[1])
        if idle:
            assignments[i], notes[i] = idle[0], f"{wants[i]}: reuse idle {wants[i]}@{idle[0][1]}"
            locked.add(idle[0])
    for i in order:
        want = wants[i]
        if assignments[i] is not None:
            continue
        state = frozenset(insts)
        chosen = choose_placement(table, state, want)
        if chosen is not None:
            target, reach = chosen
            why = (f"free {_slices(space, target)}; keeps {reach} of {len(table.maximal)} maximal layouts "
                   f"reachable{_alternatives(table, state, want, target[1])}")
            notes[i] = f"{want}: create {want}@{target[1]}"
        else:
            found = _fuse_or_split(table, insts, locked, want)
            if isinstance(found, str):
                notes[i] = f"{want}: unmet, {found}"
                continue
            hits, target, reach = found
            if len(hits) > 1:
                kind = "fusion"  # several idle neighbours merged into one placement
            elif hits and space.profile(hits[0][0]).memory_slices > space.profile(want).memory_slices:
                kind = "fission"  # one larger idle instance split
            else:
                kind = "reshape"  # one idle instance of the same size (4g.20gb -> 3g.20gb)
            for hit in hits:
                actions.append(Action("destroy", hit[0], hit[1],
                                      f"{kind}: idle {hit[0]}@{hit[1]} frees {_slices(space, hit)} "
                                      f"for {want}@{target[1]}"))
                del insts[hit]
            why = (f"{kind} of {len(hits)} idle instance(s) into {_slices(space, target)}; keeps {reach} "
                   f"of {len(table.maximal)} maximal layouts reachable")
            notes[i] = f"{want}: {kind}, then create {want}@{target[1]}"
        actions.append(Action("create", want, target[1], why))
        insts[target] = Instance(want, target[1])
        locked.add(target)
        assignments[i] = target
    final = tuple(sorted((Instance(p[0], p[1], p in locked) for p in insts), key=lambda x: x.start))
    return Plan(model.name, names, tuple(actions), tuple(assignments), tuple(notes), final,
                table.reach(frozenset(i.placement for i in current)), table.reach(frozenset(insts)),
                len(table.maximal))


def describe(plan_: Plan) -> str:
    """Human-readable rendering of a plan (the CLI's text output)."""
    lines = [f"{plan_.model}: {len(plan_.actions)} action(s); profiles: {', '.join(plan_.profiles)}"]
    for n, action in enumerate(plan_.actions, 1):
        lines.append(f"{n:>3}. {action.text():<22} {action.reason}")
    lines.extend(f"  want {note}" for note in plan_.notes)
    lines.append(f"result (* = busy or assigned): {format_layout(plan_.final)} (maximal layouts reachable: "
                 f"{plan_.reach_before} -> {plan_.reach_after} of {plan_.maximal_total})")
    return "\n".join(lines)
