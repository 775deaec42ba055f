"""MIG instances and the compact layout text syntax.

Syntax: comma-separated ``PROFILE@START`` items, ``*`` after an item marks it busy (a job runs in it);
``empty`` (or an empty string) is the unpartitioned GPU. Example: ``3g.20gb@0*,2g.10gb@4,1g.5gb@6``.
Why explicit starts: the driver's own placement depends on creation order (docs/mig-profiles.md), so a layout
is only meaningful with its placements, and the planner creates with explicit placements too.

Parsing checks everything the state machine would reject and says which item is wrong and what would be
right, in one line (a ``ValueError`` the CLI turns into a usage error).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpushare.policy.fsm import MigSpace, Placement


@dataclass(frozen=True, order=True)
class Instance:
    """A GPU instance present on the GPU."""

    profile: str
    start: int  # first memory slice
    busy: bool = False  # a job runs in it: the planner never destroys it

    @property
    def placement(self) -> Placement:
        return (self.profile, self.start)

    def text(self) -> str:
        return f"{self.profile}@{self.start}{'*' if self.busy else ''}"


def format_layout(instances: Iterable[Instance | Placement]) -> str:
    """Render instances (or bare placements) in the layout syntax, ordered by start slice."""
    items = [i if isinstance(i, Instance) else Instance(i[0], i[1]) for i in instances]
    return ",".join(i.text() for i in sorted(items, key=lambda i: i.start)) or "empty"


def parse_layout(text: str, space: MigSpace) -> tuple[Instance, ...]:
    """Parse the layout syntax against a model's profile set; raise ValueError naming the bad item."""
    text = text.strip()
    if text.lower() in ("", "empty", "none"):
        return ()
    known = ", ".join(p.name for p in space.profiles)
    out: list[Instance] = []
    for raw in text.split(","):
        item = raw.strip()
        busy = item.endswith("*")
        body = item[:-1].strip() if busy else item
        name, at, start_text = body.partition("@")
        name = name.strip().lower()
        if not item or not at:
            raise ValueError(f"layout item {item!r}: expected PROFILE@START, e.g. 3g.20gb@0")
        try:
            profile = space.profile(name)
        except KeyError:
            raise ValueError(f"layout item {item!r}: unknown profile {name!r} for {space.model_name} "
                             f"(known: {known})") from None
        try:
            start = int(start_text)
        except ValueError:
            raise ValueError(f"layout item {item!r}: start {start_text.strip()!r} is not a slice number") from None
        if start not in profile.placements:
            legal = ", ".join(map(str, profile.placements))
            raise ValueError(f"layout item {item!r}: {name} cannot start at slice {start} "
                             f"(legal starts: {legal})")
        out.append(Instance(name, start, busy))
    check_layout(out, space)
    return tuple(out)


def check_layout(instances: Iterable[Instance], space: MigSpace) -> None:
    """Raise ValueError with the first conflict of a layout (overlap, compute budget, max count)."""
    seen: dict[int, Instance] = {}
    compute = 0
    counts: dict[str, int] = {}
    for inst in instances:
        profile = space.profile(inst.profile)
        if inst.start not in profile.placements:
            raise ValueError(f"{inst.text()}: {inst.profile} cannot start at slice {inst.start}")
        for s in space.span(inst.placement):
            if s in seen:
                raise ValueError(f"{seen[s].text()} and {inst.text()} both use memory slice {s}")
            seen[s] = inst
        compute += profile.compute_slices
        counts[inst.profile] = counts.get(inst.profile, 0) + 1
        if counts[inst.profile] > profile.max_count:
            raise ValueError(f"at most {profile.max_count} × {inst.profile} fit on {space.model_name}")
    if compute > space.compute_slices:
        raise ValueError(f"layout uses {compute} compute slices; {space.model_name} has "
                         f"{space.compute_slices}")
