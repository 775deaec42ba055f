"""Gimbal's coordination on one GPU (gpushare.policy.gimbal): the speed model's shape and Algorithm 1."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushare.policy import gimbal as gb


def test_alone_and_free_competition_match_the_collocation_model():
    a = gb.GimbalJob("a", 100, demand=0.85)
    assert gb.coordinate([a], "jct") == {"a": 100}
    assert gb.thread_share_speeds([a], {"a": 100}) == {"a": 1.0}
    b = gb.GimbalJob("b", 100, demand=0.85)
    free = gb.thread_share_speeds([a, b], {"a": 100, "b": 100})
    assert free["a"] == pytest.approx(0.95 / (1 + 0.7))  # x = 1, over-subscription .85 + .85 - 1


def test_a_cap_slows_the_capped_job_and_speeds_its_co_runner():
    a, b = gb.GimbalJob("a", 100, demand=0.85), gb.GimbalJob("b", 100, demand=0.85)
    free = gb.thread_share_speeds([a, b], {"a": 100, "b": 100})
    capped = gb.thread_share_speeds([a, b], {"a": 100, "b": 50})
    assert capped["b"] < free["b"] and capped["a"] > free["a"]
    # a cap above the job's own demand costs it nothing
    assert gb.thread_share_speeds([a], {"a": 90}) == {"a": 1.0}


def test_measured_curve_is_used_and_checked():
    curve = tuple(k / 10 for k in range(1, 11))
    job = gb.GimbalJob("a", 10, demand=0.5, curve=curve)
    assert job.own_speed(30) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        gb.GimbalJob("b", 10, demand=0.5, curve=(1.0,)).own_speed(10)


def test_jct_squeezes_the_busier_job():
    heavy = gb.GimbalJob("heavy", 100, demand=0.9)
    medium = gb.GimbalJob("medium", 100, demand=0.6)
    plan = gb.coordinate([heavy, medium], gb.Objective.JCT)
    assert plan["medium"] == 100 and plan["heavy"] < 100
    speeds = gb.thread_share_speeds([heavy, medium], plan)
    free = gb.thread_share_speeds([heavy, medium], {"heavy": 100, "medium": 100})
    assert gb.objective_value([heavy, medium], speeds, gb.Objective.JCT) < \
        gb.objective_value([heavy, medium], free, gb.Objective.JCT)


def test_makespan_squeezes_the_shorter_job():
    long = gb.GimbalJob("long", 1000, demand=0.85)
    short = gb.GimbalJob("short", 100, demand=0.85)
    plan = gb.coordinate([long, short], "makespan")
    assert plan["long"] == 100 and plan["short"] < 100


def test_no_gain_keeps_free_competition():
    # two light jobs do not over-subscribe the GPU: any squeeze only slows one of them
    a, b = gb.GimbalJob("a", 100, demand=0.3), gb.GimbalJob("b", 50, demand=0.3)
    assert gb.coordinate([a, b], "jct") == {"a": 100, "b": 100}


def test_custom_speed_model_drives_the_search():
    calls = []

    def model(jobs, plan):
        calls.append(dict(plan))
        return {j.job_id: 1.0 for j in jobs}  # nothing ever improves

    jobs = [gb.GimbalJob("a", 10, 0.9, world_size=2), gb.GimbalJob("b", 10, 0.9)]
    assert gb.coordinate(jobs, "jct", model) == {"a": 100, "b": 100}
    assert len(calls) == 1 + gb.PATIENCE  # free competition, then three failed squeezes


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.floats(1, 1e5), st.floats(0.05, 1.0), st.integers(1, 4)), min_size=1, max_size=4),
       st.sampled_from(list(gb.Objective)))
def test_percentages_are_multiples_of_ten_within_range(features, objective):
    jobs = [gb.GimbalJob(f"j{k}", r, d, w) for k, (r, d, w) in enumerate(features)]
    plan = gb.coordinate(jobs, objective)
    assert set(plan) == {j.job_id for j in jobs}
    assert all(p % 10 == 0 and gb.MIN_PERCENT <= p <= gb.MAX_PERCENT for p in plan.values())
    free = gb.thread_share_speeds(jobs, {j.job_id: 100 for j in jobs})
    chosen = gb.thread_share_speeds(jobs, plan)
    assert gb.objective_value(jobs, chosen, objective) <= gb.objective_value(jobs, free, objective) + 1e-9
