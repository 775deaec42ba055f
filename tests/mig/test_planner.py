"""The planner: Algorithm 3 placement, reuse, fusion, fission, and busy instances left alone."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpushare.gpus import BUILTIN_GPUS
from gpushare.policy.fsm import fsm_table
from gpushare.policy.layout import Instance, parse_layout
from gpushare.policy.planner import choose_placement, describe, plan
from gpushare.policy.profiles import all_profiles, select_profiles

A100 = BUILTIN_GPUS["a100-40gb"]
SPACE = fsm_table(A100, all_profiles(A100)).space


def layout(text: str) -> tuple[Instance, ...]:
    return parse_layout(text, SPACE)


def test_first_1g_on_empty_a100_takes_the_highest_reachability_placement() -> None:
    result = plan(A100, (), ["1g.5gb"])
    assert [a.text() for a in result.actions] == ["create 1g.5gb@6"]
    assert "keeps 12 of 19" in result.actions[0].reason
    assert result.reach_after == 12


def test_ties_go_to_the_highest_start() -> None:
    table = fsm_table(A100, select_profiles(A100))
    # 2g.10gb at 0, 2 or 4 each keep 6 layouts; slice 4 leaves 4g@0 possible
    assert choose_placement(table, frozenset(), "2g.10gb") == (("2g.10gb", 4), 6)
    assert choose_placement(table, frozenset(), "3g.20gb") == (("3g.20gb", 4), 6)
    assert choose_placement(table, frozenset({("7g.40gb", 0)}), "1g.5gb") is None


def test_idle_instance_is_reused_without_actions() -> None:
    result = plan(A100, layout("3g.20gb@0*,2g.10gb@4,1g.5gb@6"), ["2g.10gb"])
    assert result.actions == () and result.assignments == (("2g.10gb", 4),)
    assert "reuse" in result.notes[0]


def test_fusion_merges_idle_neighbours() -> None:
    result = plan(A100, layout("3g.20gb@0*,1g.5gb@4,1g.5gb@5,1g.5gb@6*"), ["2g.10gb"])
    assert [a.text() for a in result.actions] == ["destroy 1g.5gb@4", "destroy 1g.5gb@5",
                                                  "create 2g.10gb@4"]
    assert all("fusion" in a.reason for a in result.actions)


def test_fission_splits_an_idle_larger_instance() -> None:
    result = plan(A100, layout("4g.20gb@0*,3g.20gb@4"), ["1g.5gb"])
    assert [a.text() for a in result.actions] == ["destroy 3g.20gb@4", "create 1g.5gb@6"]
    assert result.actions[0].reason.startswith("fission")


def test_reshaping_prefers_destroying_fewer_slices() -> None:
    # a 2g can replace the two idle 1g (2 slices) or split the idle 3g (4 slices): the 1g pair goes
    result = plan(A100, layout("3g.20gb@0,1g.5gb@4,1g.5gb@5,1g.5gb@6*"), ["2g.10gb"])
    assert [a.text() for a in result.actions] == ["destroy 1g.5gb@4", "destroy 1g.5gb@5",
                                                  "create 2g.10gb@4"]


def test_reuse_is_claimed_before_reshaping() -> None:
    # the idle 3g serves the 3g want; the 2g may not take it apart, and slices 4-5 are busy
    result = plan(A100, layout("3g.20gb@0,2g.10gb@4*,1g.5gb@6"), ["3g.20gb", "2g.10gb"])
    assert result.assignments[0] == ("3g.20gb", 0)
    assert result.unmet == (1,) and "assigned 3g.20gb@0" in result.notes[1]


def test_the_issue_example_from_7g_to_four_instances() -> None:
    result = plan(A100, layout("7g.40gb@0"), ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"])
    assert result.unmet == ()
    assert result.actions[0].text() == "destroy 7g.40gb@0"
    kinds = sorted(i.profile for i in result.final)
    assert kinds == ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]
    assert SPACE.is_legal(i.placement for i in result.final)


def test_busy_instance_blocks_and_is_reported() -> None:
    result = plan(A100, layout("7g.40gb@0*"), ["1g.5gb"])
    assert result.actions == () and result.unmet == (0,)
    assert "busy 7g.40gb@0" in result.notes[0]
    assert "unmet" in describe(result)


def test_seven_1g_fill_an_empty_gpu() -> None:
    result = plan(A100, (), ["1g.5gb"] * 7)
    assert result.unmet == () and len(result.final) == 7
    assert plan(A100, (), ["1g.5gb"] * 8).unmet == (7,)


def test_in_order_serves_as_given() -> None:
    # largest first fits both; given order puts the 1g at slice 6 first, the 3g still fits at 0
    assert plan(A100, (), ["1g.5gb", "4g.20gb"]).unmet == ()
    ordered = plan(A100, (), ["1g.5gb", "4g.20gb"], in_order=True)
    assert [a.text() for a in ordered.actions] == ["create 1g.5gb@6", "create 4g.20gb@0"]


PROFILES = [p.name for p in A100.mig_profiles]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[tuple[Instance, ...], list[str]]:
    table = fsm_table(A100, all_profiles(A100))
    layout_ = draw(st.sampled_from(table.maximal))
    kept = draw(st.lists(st.sampled_from(sorted(layout_)), unique=True))
    instances = tuple(Instance(n, s, draw(st.booleans())) for n, s in kept)
    wants = draw(st.lists(st.sampled_from(PROFILES), max_size=5))
    return instances, wants


@settings(max_examples=300, deadline=None)
@given(scenarios(), st.booleans())
def test_busy_instances_are_never_touched(scenario: tuple, in_order: bool) -> None:
    instances, wants = scenario
    result = plan(A100, instances, wants, profiles=all_profiles(A100), in_order=in_order)
    busy = {i.placement for i in instances if i.busy}
    destroyed = [(a.profile, a.start) for a in result.actions if a.kind == "destroy"]
    assert not busy & set(destroyed)
    final = {i.placement for i in result.final}
    assert busy <= final
    assert SPACE.is_legal(final)
    served = [a for a in result.assignments if a is not None]
    assert len(served) == len(set(served)) and set(served) <= final
    assert not busy & set(served)
    for want, got in zip(wants, result.assignments):
        assert got is None or got[0] == want
    # replaying the actions from the current layout gives the final layout
    state = {i.placement for i in instances}
    for action in result.actions:
        if action.kind == "destroy":
            state.remove((action.profile, action.start))
        else:
            assert (action.profile, action.start) not in state
            state.add((action.profile, action.start))
            assert SPACE.is_legal(state)
    assert state == final


def test_same_size_replacement_is_a_reshape() -> None:
    result = plan(A100, layout("4g.20gb@0,3g.20gb@4*"), ["3g.20gb"])
    assert [a.text() for a in result.actions] == ["destroy 4g.20gb@0", "create 3g.20gb@0"]
    assert result.actions[0].reason.startswith("reshape")
