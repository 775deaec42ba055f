"""The MIG partition state machine of one GPU model (MIGM §4.2).

A *state* is the set of occupied placements, each a (profile name, start memory slice) pair; the empty
set is the unpartitioned GPU. A state is *legal* when its placements' memory slices do not overlap, their
compute slices sum to at most the GPU's budget (7, or 4 on A30), and no profile exceeds its max count.
Transitions allocate a profile at a free legal placement, or free one. *Final* states are the maximal
layouts: legal states to which no selected profile can be added.

Why precompute: legality is downward closed (every subset of a legal state is legal), so every legal
superset of a state is reachable from it by allocations in any order, and the *future configuration
reachability* of a state is simply the number of maximal layouts containing it. The state space is small
(A100, classic five profiles: 297 non-empty states, 19 maximal; with the double-memory 1g: 722 and 78), so
one table per (model, profile set) is built once — milliseconds — and cached; the planner then answers
each allocation with dictionary look-ups.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations

from gpushare.gpus import GpuModel, MigProfile

from gpushare.policy.profiles import select_profiles, total_compute_slices

Placement = tuple[str, int]  # (profile name, start memory slice)
State = frozenset[Placement]
EMPTY: State = frozenset()


@dataclass(frozen=True)
class MigSpace:
    """The legality rules of one model restricted to a set of profiles."""

    model_name: str
    profiles: tuple[MigProfile, ...]
    memory_slices: int
    compute_slices: int

    @classmethod
    def of(cls, model: GpuModel, profile_names: Iterable[str] | None = None) -> MigSpace:
        names = select_profiles(model) if profile_names is None else tuple(profile_names)
        profiles = tuple(model.mig_profile(n) for n in dict.fromkeys(names))
        if not profiles:
            raise ValueError(f"{model.name}: no MIG profiles selected")
        full = tuple(p for p in model.mig_profiles)
        memory = model.memory_slices or max(max(p.placements) + p.memory_slices for p in full)
        return cls(model.name, profiles, memory, total_compute_slices(full))

    def profile(self, name: str) -> MigProfile:
        for profile in self.profiles:
            if profile.name == name:
                return profile
        known = ", ".join(p.name for p in self.profiles)
        raise KeyError(f"{self.model_name}: profile {name!r} is not in the profile set ({known})")

    def all_placements(self) -> tuple[Placement, ...]:
        """Every (profile, start) pair of the selected profiles."""
        return tuple((p.name, s) for p in self.profiles for s in p.placements)

    def span(self, placement: Placement) -> range:
        """The memory slices a placement occupies."""
        name, start = placement
        return range(start, start + self.profile(name).memory_slices)

    def is_legal(self, state: Iterable[Placement]) -> bool:
        used: set[int] = set()
        compute = 0
        counts: dict[str, int] = {}
        for name, start in state:
            profile = self.profile(name)
            if start not in profile.placements:
                return False
            slices = set(range(start, start + profile.memory_slices))
            if used & slices:
                return False
            used |= slices
            compute += profile.compute_slices
            counts[name] = counts.get(name, 0) + 1
            if counts[name] > profile.max_count:
                return False
        return compute <= self.compute_slices

    def can_add(self, state: State, placement: Placement) -> bool:
        return placement not in state and self.is_legal(state | {placement})

    def successors(self, state: State) -> tuple[tuple[Placement, State], ...]:
        """Allocation transitions out of ``state``: (placement added, next state)."""
        return tuple((p, state | {p}) for p in self.all_placements() if self.can_add(state, p))

    def is_maximal(self, state: State) -> bool:
        return not self.successors(state)

    def free_slices(self, state: Iterable[Placement]) -> tuple[int, ...]:
        used = {s for p in state for s in self.span(p)}
        return tuple(s for s in range(self.memory_slices) if s not in used)


@dataclass(frozen=True)
class FsmTable:
    """All legal states of a :class:`MigSpace`, its maximal layouts and every state's reachability."""

    space: MigSpace
    states: tuple[State, ...]  # every legal state, the empty one first
    maximal: tuple[State, ...]  # final states, in a stable order (see layout_sort_key)
    reachability: Mapping[State, int]  # maximal layouts that contain the state

    def reach(self, state: State) -> int:
        """Future configuration reachability; 0 for an illegal state."""
        return self.reachability.get(state, 0)

    def maximal_from(self, state: State) -> tuple[State, ...]:
        """The maximal layouts still reachable from ``state``."""
        return tuple(m for m in self.maximal if state <= m)


def build_table(space: MigSpace) -> FsmTable:
    """Enumerate the legal states breadth-first from the empty GPU and count reachability.

    Legality is checked incrementally with slice bitmasks (the same rules as :meth:`MigSpace.is_legal`).
    """
    moves = []
    for profile in space.profiles:
        for start in profile.placements:
            mask = ((1 << profile.memory_slices) - 1) << start
            moves.append(((profile.name, start), mask, profile.compute_slices, profile.max_count))
    seen: set[State] = {EMPTY}
    frontier: list[tuple[State, int, int]] = [(EMPTY, 0, 0)]  # (state, used slices, used compute)
    maximal: list[State] = []
    while frontier:
        nxt: list[tuple[State, int, int]] = []
        for state, used, compute in frontier:
            grown = False
            for placement, mask, comp, max_count in moves:
                if used & mask or compute + comp > space.compute_slices:
                    continue
                if sum(1 for n, _ in state if n == placement[0]) >= max_count:
                    continue
                grown = True
                child = state | {placement}
                if child not in seen:
                    seen.add(child)
                    nxt.append((child, used | mask, compute + comp))
            if not grown:
                maximal.append(state)
        frontier = nxt
    reach: dict[State, int] = dict.fromkeys(seen, 0)
    for layout in maximal:  # each subset of a maximal layout can still reach it
        items = tuple(layout)
        for k in range(len(items) + 1):
            for subset in combinations(items, k):
                reach[frozenset(subset)] += 1
    order = sorted(maximal, key=lambda s: layout_sort_key(space, s))
    states = sorted(seen, key=lambda s: (len(s), layout_sort_key(space, s)))
    return FsmTable(space, tuple(states), tuple(order), reach)


def layout_sort_key(space: MigSpace, state: Iterable[Placement]) -> tuple:
    """Largest profiles first, then by start: 7g, 4g+3g, ... 1g×7 — the guide's order."""
    items = sorted(state, key=lambda p: p[1])
    sizes = sorted((-space.profile(n).compute_slices, -space.profile(n).memory_slices) for n, _ in items)
    return (sizes, [p[1] for p in items], [p[0] for p in items])


@lru_cache(maxsize=64)
def fsm_table(model: GpuModel, profile_names: tuple[str, ...] | None = None) -> FsmTable:
    """The table for a model and profile set, built once per process (models are frozen, hence hashable)."""
    return build_table(MigSpace.of(model, profile_names))
