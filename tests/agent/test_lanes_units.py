"""Lanes, the pure parts: admission onto a GPU's lanes, turn order, demotion, leaving; the submit-side
directive and shard charge; the record field the agent reads; the TaskProlog's PYTHONPATH merge."""

from __future__ import annotations

import math

import pytest

from gpushare.agent.jobs import clean_facts, lane_facts_of
from gpushare.agent.lanes import LaneBoard, Member, Waiter, round_robin
from gpushare.config import parse_config
from gpushare.prolog.task_prolog import lane_lines, lane_site_dir
from gpushare.slurm_plugins.decision import LANE_SHARE, Estimate, SubmitRequest, decide, lane_charge
from gpushare.slurm_plugins.directives import parse_directives
from gpushare.slurm_plugins.estimate_source import split_from_json

GiB = 1 << 30
CAP = 40 * GiB


def member(job: str, p: float, e: float, gpu: int = 0, own: bool = False) -> Member:
    return Member(job, gpu, int(p * GiB), int(e * GiB), own)


def test_a_job_joins_a_lane_that_holds_its_ephemeral_else_a_new_lane():
    board = LaneBoard()
    assert board.join(member("a", 2, 10), CAP)
    assert board.join(member("b", 2, 8), CAP)  # fits a's lane: adds only its persistent memory
    assert board.members["a"].lane == board.members["b"].lane
    assert board.join(member("c", 2, 12), CAP)  # larger than every lane: a lane of its own
    assert board.members["c"].lane != board.members["a"].lane
    assert board.used(0) == 6 * GiB + 10 * GiB + 12 * GiB


def test_admission_keeps_persistent_plus_lane_sizes_within_capacity_and_waits_in_order():
    board = LaneBoard()
    assert board.join(member("a", 10, 20), CAP)  # 30 of 40
    assert not board.join(member("big", 5, 25), CAP)  # a new lane would need 60: waits
    assert not board.join(member("small", 1, 5), CAP)  # fits a's lane, but is not let past "big"
    assert board.pending == ["big", "small"]
    board.leave("a", 0.0)
    assert board.admit("big", CAP) and board.admit("small", CAP)
    assert board.used(0) <= CAP


def test_a_job_without_a_split_never_shares_a_lane():
    board = LaneBoard()
    board.join(member("own", 0, 6, own=True), CAP)
    board.join(member("x", 1, 4), CAP)
    assert board.members["x"].lane != board.members["own"].lane
    board.join(member("own2", 0, 3, own=True), CAP)
    assert len({m.lane for m in board.members.values()}) == 3


def test_one_holder_per_lane_and_round_robin_order():
    board = LaneBoard()
    for job in "abc":
        board.join(member(job, 1, 4), CAP)
    assert board.request("a", 0.0)
    assert not board.request("b", 1.0) and not board.request("c", 2.0)
    order = []
    for now in range(3, 12):
        holder = next(j for j in "abc" if board.holder(j))
        order.append(holder)
        assert board.release(holder, float(now))
        board.request(holder, float(now))  # asks again at once: queues behind the others
    assert order == list("abcabcabc")


def test_other_gpus_lanes_are_independent():
    board = LaneBoard()
    board.join(member("a", 1, 4, gpu=0), CAP)
    board.join(member("b", 1, 4, gpu=1), CAP)
    assert board.request("a", 0.0) and board.request("b", 0.0)


def test_an_overdue_holder_is_demoted_only_when_someone_waits():
    board = LaneBoard()
    board.join(member("hog", 1, 4), CAP)
    board.join(member("b", 1, 4), CAP)
    assert board.request("hog", 0.0)
    assert board.overdue(100.0, 10.0) == []  # nobody waits: nothing to take away
    board.request("b", 100.0)
    assert board.overdue(105.0, 10.0) == ["hog"] and board.holder("b")
    assert not board.release("hog", 106.0)  # its turn was taken: the release says so
    assert board.members["hog"].demoted == 1
    assert not board.request("hog", 107.0)  # at the back


def test_a_leaving_holder_hands_the_turn_on_and_an_empty_lane_disappears():
    board = LaneBoard()
    board.join(member("a", 1, 4), CAP)
    board.join(member("b", 1, 4), CAP)
    board.request("a", 0.0)
    board.request("b", 0.0)
    board.leave("a", 1.0)
    assert board.holder("b")
    board.leave("b", 2.0)
    assert board.lanes == {} and board.members == {}


def test_the_turn_policy_is_pluggable_and_must_choose_a_waiting_job():
    def longest_job_last(waiting):  # e.g. an SRTF-like policy: fewest turns so far first
        return min(waiting, key=lambda w: (w.turns, w.queued_at)).job

    board = LaneBoard(longest_job_last)
    for job in "ab":
        board.join(member(job, 1, 4), CAP)
    board.request("a", 0.0)
    board.release("a", 1.0)
    assert board.request("a", 1.0)  # nobody else waits: a again
    board.request("b", 2.0)
    board.release("a", 3.0)
    assert board.holder("b")
    assert round_robin([Waiter("x", 2.0, 0, 0.0, 1), Waiter("y", 1.0, 5, 9.0, 1)]) == "y"
    bad = LaneBoard(lambda waiting: "nobody")
    bad.join(member("a", 1, 4), CAP)
    with pytest.raises(ValueError):
        bad.request("a", 0.0)


# -- submit side ---------------------------------------------------------------------------------
def test_lanes_directive_bare_or_yes_no():
    assert parse_directives("#GPUSHARE lanes\n").lanes
    assert parse_directives("#GPUSHARE mem=4G lanes=yes\n").lanes
    assert not parse_directives("#GPUSHARE lanes=no\n").lanes
    assert parse_directives("#GPUSHARE lanes=maybe\n").problems


def test_lane_charge_with_and_without_a_split():
    split = Estimate(12 * GiB, "directive:estimate", "", 4 * GiB, 8 * GiB)
    assert lane_charge(split) == (4 * GiB + 8 * GiB // LANE_SHARE, {"p_gib": 4.0, "e_gib": 8.0})
    whole = Estimate(12 * GiB, "directive:mem")
    assert lane_charge(whole) == (12 * GiB, {"p_gib": 0.0, "e_gib": 12.0, "own": True})


def test_decision_records_lanes_and_charges_fewer_shards():
    cfg = parse_config({})
    request = SubmitRequest(user_id=1000, tres_per_node="gres/gpu:1", script="#!/bin/sh\n#GPUSHARE lanes\n")
    estimate = Estimate(12 * GiB, "directive:estimate", "", 4 * GiB, 8 * GiB)
    plain = decide(request, parse_directives(""), estimate, cfg)
    lanes = decide(request, parse_directives(request.script), estimate, cfg)
    assert lanes.record["lanes"] == {"p_gib": 4.0, "e_gib": 8.0} and "lanes" not in plain.record
    shards = int(str(lanes.tres_per_node).rsplit(":", 1)[1])
    margin = max(12 * GiB * cfg.policy.margin_fraction, cfg.policy.margin_min_gib * GiB)
    assert shards == math.ceil((8 * GiB + margin) / GiB) < int(str(plain.tres_per_node).rsplit(":", 1)[1])
    assert '"lanes":{' in lanes.admin_comment


def test_split_is_read_from_the_chosen_target():
    document = {"targets": [{"gpu": "a100-40gb", "peak_total_bytes": 9, "persistent_bytes": 3, "ephemeral_bytes": 6},
                            {"gpu": "h100-80gb", "peak_total_bytes": 9}]}
    assert split_from_json(document, "a100-40gb") == (3, 6)
    assert split_from_json(document, "h100-80gb") is None
    assert split_from_json({"targets": [{"gpu": "x", "persistent_bytes": -1, "ephemeral_bytes": 2}]}, "x") is None


# -- node side -----------------------------------------------------------------------------------
def test_the_agent_reads_the_record_field_and_validates_facts():
    assert lane_facts_of({"p_gib": 1.5, "e_gib": 4}) == {"lanes": True, "persistent_bytes": int(1.5 * GiB),
                                                         "ephemeral_bytes": 4 * GiB, "own_lane": False}
    assert lane_facts_of({"p_gib": "x", "e_gib": 4}) == {} and lane_facts_of(True) == {}
    base = {"job": "7", "uid": 1000, "user": "u", "gpus": [0], "shared": True}
    with pytest.raises(ValueError):
        clean_facts({**base, "lanes": True, "persistent_bytes": -1, "ephemeral_bytes": 1})
    assert "lanes" not in clean_facts({**base, "lanes": "yes"})


def test_task_prolog_merges_pythonpath():
    site = lane_site_dir()
    assert lane_lines({}) == [f"export PYTHONPATH={site}"]
    assert lane_lines({"PYTHONPATH": "/home/u/lib:/opt/x"}) == [f"export PYTHONPATH={site}:/home/u/lib:/opt/x"]
    assert lane_lines({"PYTHONPATH": "/home/u/my lib"}) == ["export GPUSHARE_LANES=0"]
