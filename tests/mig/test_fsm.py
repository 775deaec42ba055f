"""The MIG state machine: layout counts from docs/mig-profiles.md, reachability, NVML-built models."""

from __future__ import annotations

import time

import pytest

from gpushare.gpus import BUILTIN_GPUS
from gpushare.policy.fsm import EMPTY, MigSpace, build_table, fsm_table
from gpushare.policy.profiles import all_profiles, model_from_nvml, select_profiles

AMPERE_HOPPER = ["a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb"]


@pytest.mark.parametrize("name", AMPERE_HOPPER)
def test_classic_five_profiles_give_297_sets_and_19_maximal_layouts(name: str) -> None:
    model = BUILTIN_GPUS[name]
    names = select_profiles(model)
    assert [model.mig_profile(n).compute_slices for n in names] == [1, 2, 3, 4, 7]
    table = fsm_table(model, names)
    assert len(table.states) - 1 == 297  # minus the empty state
    assert len(table.maximal) == 19


@pytest.mark.parametrize("name", AMPERE_HOPPER)
def test_double_memory_1g_gives_722_sets_and_78_maximal_layouts(name: str) -> None:
    model = BUILTIN_GPUS[name]
    names = select_profiles(model, extra_memory=True)
    assert any(model.mig_profile(n).gi_profile_id == 15 for n in names)
    table = fsm_table(model, names)
    assert (len(table.states) - 1, len(table.maximal)) == (722, 78)


def test_a30_gives_25_sets_and_5_maximal_layouts() -> None:
    model = BUILTIN_GPUS["a30-24gb"]
    names = select_profiles(model)
    assert names == ("1g.6gb", "2g.12gb", "4g.24gb")
    table = fsm_table(model, names)
    assert (len(table.states) - 1, len(table.maximal)) == (25, 5)
    assert table.space.compute_slices == 4


def test_fourteen_distinct_mixes_on_a100() -> None:
    model = BUILTIN_GPUS["a100-40gb"]
    table = fsm_table(model, select_profiles(model))
    mixes = {tuple(sorted(n.split("g")[0] for n, _ in layout)) for layout in table.maximal}
    assert len(mixes) == 14
    # a mix that is maximal only at particular placements: slice 7 stays idle
    assert frozenset({("3g.20gb", 0), ("2g.10gb", 4), ("1g.5gb", 6)}) in table.maximal
    assert frozenset({("4g.20gb", 0), ("3g.20gb", 4)}) in table.maximal  # legal since R510


def test_reachability_counts_maximal_supersets() -> None:
    model = BUILTIN_GPUS["a100-40gb"]
    table = fsm_table(model, select_profiles(model))
    assert table.reach(EMPTY) == 19
    for state in table.states:
        assert table.reach(state) == len(table.maximal_from(state)) >= 1
        if state in table.maximal:
            assert table.reach(state) == 1
    illegal = frozenset({("3g.20gb", 0), ("2g.10gb", 2)})
    assert table.reach(illegal) == 0 and not table.space.is_legal(illegal)


def test_migm_example_first_1g_goes_to_the_last_slice() -> None:
    # MIGM §4.2: on an empty A100-40GB, a first 1g.5gb request has seven legal placements. Slices 0-5
    # each keep 6 of the 19 maximal layouts reachable; slice 6 keeps 12. A 1g at slice 6 sits where
    # every maximal layout without a 3g at slice 4 (or a 7g) has an instance anyway (slice 7 is
    # unusable by a 1g, so slices 4-7 hold 1g/2g pieces or a 3g@4): it blocks only 7g and 3g@4 layouts.
    # A 1g at slice 0-5 also blocks 4g@0/3g@0 (slices 0-3) or 2g pairs, losing more. MIGM reports 7 vs 9
    # with its older layout set (before 4g+3g became legal); the winner is the same: the last slice.
    model = BUILTIN_GPUS["a100-40gb"]
    table = fsm_table(model, select_profiles(model))
    scores = {s: table.reach(frozenset({("1g.5gb", s)})) for s in range(7)}
    assert scores == {0: 6, 1: 6, 2: 6, 3: 6, 4: 6, 5: 6, 6: 12}


def test_all_profiles_include_media_extension_variants() -> None:
    model = BUILTIN_GPUS["a100-40gb"]
    table = fsm_table(model, all_profiles(model))
    assert len(table.maximal) > 78
    # only one +me instance at a time (max count 1)
    assert not table.space.is_legal({("1g.5gb+me", 0), ("1g.5gb+me", 1)})


def test_table_is_cached_and_builds_fast() -> None:
    model = BUILTIN_GPUS["h100-80gb"]
    names = select_profiles(model, extra_memory=True)
    t0 = time.perf_counter()
    build_table(MigSpace.of(model, names))
    assert time.perf_counter() - t0 < 2.0  # ~0.1 s measured; generous for slow CI
    assert fsm_table(model, names) is fsm_table(model, names)


def _nvml_records(model_name: str) -> list[tuple]:
    """The built-in rows as NVML would list them: placements as (start, size) pairs."""
    model = BUILTIN_GPUS[model_name]
    return [(p.name, p.gi_profile_id, p.memory_slices, p.compute_slices,
             [(s, p.memory_slices) for s in p.placements]) for p in model.mig_profiles]


@pytest.mark.parametrize("name,classic,double", [("a100-40gb", (297, 19), (722, 78)),
                                                  ("a30-24gb", (25, 5), (25, 5))])
def test_model_built_from_nvml_data_matches_the_catalogue(name: str, classic: tuple, double: tuple) -> None:
    built = model_from_nvml(name, _nvml_records(name))
    original = BUILTIN_GPUS[name]
    assert built.memory_slices == original.memory_slices
    for got, want in zip(built.mig_profiles, original.mig_profiles):
        assert (got.placements, got.memory_slices, got.compute_slices) == \
               (want.placements, want.memory_slices, want.compute_slices)
        if not want.media_extensions:
            assert got.max_count == want.max_count  # derived from placements and compute budget
    for names, expected in ((select_profiles(built), classic),
                            (select_profiles(built, extra_memory=True), double)):
        table = fsm_table(built, names)
        assert (len(table.states) - 1, len(table.maximal)) == expected


def test_new_model_needs_no_code() -> None:
    # a hypothetical 4-slice GPU with a 3-slice profile
    model = model_from_nvml("future-gpu", [("1g.a", 1, 1, 1, [0, 1, 2, 3]), ("3g.b", 2, 3, 3, [0, 1]),
                                           ("4g.c", 3, 4, 4, [0])])
    table = fsm_table(model)
    assert table.space.compute_slices == 4 and table.space.memory_slices == 4
    assert {len(m) for m in table.maximal} == {1, 2, 4}
    with pytest.raises(ValueError, match="does not span"):
        model_from_nvml("x", [("2g", 1, 2, 2, [(0, 1)])])


@pytest.mark.parametrize("name", AMPERE_HOPPER + ["a30-24gb"])
def test_free_memory_slices_are_the_binding_constraint(name: str) -> None:
    # Why the planner only frees overlapping instances: with the classic and double-memory sets, any
    # placement whose memory slices are free can be added (compute budget and max counts never bind).
    model = BUILTIN_GPUS[name]
    table = fsm_table(model, select_profiles(model, extra_memory=True))
    space = table.space
    for state in table.states:
        used = {s for p in state for s in space.span(p)}
        for placement in space.all_placements():
            if placement not in state and not used & set(space.span(placement)):
                assert space.can_add(state, placement)
