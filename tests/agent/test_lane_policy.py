"""Salus lane admission and turn choice (gpushare.policy.lane_policy): hand cases from the paper and a
property test that no sequence of admissions and releases ever breaks the safety condition."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushare.policy import lane_policy as lp

GB = 1_000_000_000


def job(name, p, e):
    return lp.LaneJob(name, p * GB, e * GB)


def test_first_job_opens_a_lane_of_its_ephemeral_size():
    gpu = lp.admit(lp.GpuLanes(16 * GB), job("a", 1, 7))
    assert gpu is not None
    assert [(lane.size_bytes, lane.job_ids) for lane in gpu.lanes] == [(7 * GB, ("a",))]
    assert gpu.admitted_bytes == 8 * GB


def test_salus_deadlock_example_shares_one_lane():
    # Salus §3.2.2: C = 12 GB, P = 1, E = 7 each: two lanes would need 16 GB, so B joins A's lane
    gpu = lp.admit(lp.GpuLanes(12 * GB), job("a", 1, 7))
    assert lp.find_lane(gpu, job("b", 1, 7)) == ("reuse", 0)
    gpu = lp.admit(gpu, job("b", 1, 7))
    assert len(gpu.lanes) == 1 and gpu.lanes[0].job_ids == ("a", "b")
    assert gpu.admitted_bytes == 9 * GB


def test_new_lane_is_preferred_unless_reuse_first():
    gpu = lp.admit(lp.GpuLanes(16 * GB), job("a", 1, 6))
    assert lp.find_lane(gpu, job("b", 1, 4)) == ("new", None)
    assert lp.find_lane(gpu, job("b", 1, 4), reuse_first=True) == ("reuse", 0)


def test_best_match_lane_is_the_smallest_that_fits():
    gpu = lp.GpuLanes(20 * GB)
    for name, e in (("a", 8), ("b", 5), ("c", 3)):
        gpu = lp.admit(gpu, job(name, 0, e))
    # 16 GB of lanes + 0 persistent; a 4 GB job cannot open a lane (20 < 16 + 4 + 1), fits b's lane (5)
    assert lp.find_lane(gpu, job("d", 1, 4)) == ("reuse", 1)


def test_a_lane_grows_when_nothing_else_fits():
    gpu = lp.GpuLanes(12 * GB)
    gpu = lp.admit(gpu, job("a", 1, 4))
    gpu = lp.admit(gpu, job("b", 1, 3))  # 2 + 7 = 9
    # e = 5: new lane 9 + 1 + 5 = 15 > 12; no lane >= 5; grow the 3 GB lane to 5: 9 + 1 - 3 + 5 = 12
    assert lp.find_lane(gpu, job("c", 1, 5)) == ("grow", 1)
    gpu = lp.admit(gpu, job("c", 1, 5))
    assert gpu.lane_of("c").size_bytes == 5 * GB and gpu.admitted_bytes == 12 * GB


def test_a_job_that_fits_a_full_lane_does_not_grow_another():
    # regression: a lane already large enough must not be "grown" past capacity by persistent memory alone
    gpu = lp.GpuLanes(10 * GB)
    gpu = lp.admit(gpu, job("a", 3, 6))  # 9 of 10
    assert lp.find_lane(gpu, job("b", 2, 1)) is None


def test_waits_when_nothing_fits_and_release_shrinks_and_deletes_lanes():
    gpu = lp.admit(lp.GpuLanes(10 * GB), job("a", 1, 8))
    assert lp.admit(gpu, job("b", 2, 8)) is None
    gpu = lp.admit(gpu, job("c", 0, 2))  # joins a's lane (8 >= 2), 1 + 0 + 8 = 9
    gpu = lp.release(gpu, "a")
    assert [(lane.size_bytes, lane.job_ids) for lane in gpu.lanes] == [(2 * GB, ("c",))]
    gpu = lp.release(gpu, "c")
    assert gpu.lanes == () and gpu.admitted_bytes == 0
    with pytest.raises(KeyError):
        lp.release(gpu, "c")


def test_admit_queue_skips_what_does_not_fit_without_blocking():
    gpu, admitted = lp.admit_queue(lp.GpuLanes(10 * GB), [job("big", 2, 12), job("s1", 1, 3), job("s2", 1, 3)])
    assert admitted == ["s1", "s2"]


def test_turns():
    members = [lp.TurnState("a", 0, remaining_s=50, service_s=10), lp.TurnState("b", 1, remaining_s=20, service_s=30),
               lp.TurnState("c", 2, remaining_s=20, service_s=5)]
    assert lp.next_turn(lp.LanePolicy.PACK, members) == "a"
    assert lp.next_turn(lp.LanePolicy.SRTF, members) == "b"  # tie on remaining: earlier admission
    assert lp.next_turn(lp.LanePolicy.FAIR, members) == "c"
    assert lp.next_turn(lp.LanePolicy.FAIR, []) is None
    assert lp.joining_service(members) == 5
    assert lp.time_shares(lp.LanePolicy.FAIR, members) == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})
    assert lp.time_shares(lp.LanePolicy.SRTF, members) == {"a": 0.0, "b": 1.0, "c": 0.0}


def test_negative_memory_is_refused():
    with pytest.raises(ValueError):
        lp.LaneJob("x", -1, 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6), st.integers(0, 12), st.booleans()), max_size=40),
       st.integers(4, 24))
def test_admitted_set_never_exceeds_capacity(ops, capacity):
    gpu = lp.GpuLanes(capacity * GB)
    for k, (add, p, e, reuse_first) in enumerate(ops):
        if add or not gpu.jobs:
            after = lp.admit(gpu, job(f"j{k}", p, e), reuse_first)
            if after is not None:
                gpu = after
        else:
            gpu = lp.release(gpu, sorted(gpu.jobs)[k % len(gpu.jobs)])
        assert gpu.admitted_bytes <= gpu.capacity_bytes
        assert lp.safe(gpu.capacity_bytes, gpu.jobs.values(), gpu.lanes)
        for lane in gpu.lanes:  # a lane is exactly as large as its largest member's ephemeral need
            assert lane.size_bytes == max(gpu.jobs[j].ephemeral_bytes for j in lane.job_ids)
        assert sorted(j for lane in gpu.lanes for j in lane.job_ids) == sorted(gpu.jobs)
