"""Lanes, the pure parts: admission onto a GPU's lanes, turn order, demotion, leaving; the submit-side
directive and shard charge; the record field the agent reads; the TaskProlog's PYTHONPATH merge."""

from __future__ import annotations

import math

import pytest

from gpushare.node.jobs import DEFAULT_REMAINING_S, clean_facts, lane_facts_of, time_left
from gpushare.gpus import GiB
from gpushare.policy.lane_policy import LanePolicy
from gpushare.agent.lane_service import LaneFacts, LaneService
from gpushare.agent.lanes import POLICY_NAMES, LaneBoard, Member, Waiter, round_robin, turn_policy
from gpushare.config import ConfigError, parse_config
from gpushare.prolog.task_prolog import lane_lines, lane_site_dir
from gpushare.slurm_plugins.decision import LANE_SHARE, Estimate, SubmitRequest, decide, lane_charge
from gpushare.estimate.directives import parse_directives
from gpushare.estimate.source import split_from_json

CAP = 40 * GiB


def member(job: str, p: float, e: float, gpu: int = 0, own: bool = False, deadline: float = math.inf) -> Member:
    return Member(job, gpu, int(p * GiB), int(e * GiB), own, deadline=deadline)


def lane_of(policy: str, *jobs: tuple[str, float]) -> LaneBoard:
    """One lane of ``jobs`` (name, deadline on the board's clock), admitted in that order."""
    board = LaneBoard(turn_policy(policy))
    for job, deadline in jobs:
        assert board.join(member(job, 1, 4, deadline=deadline), CAP)
    assert len(board.lanes) == 1
    return board


def holder(board: LaneBoard) -> str:
    return next(j for j in board.members if board.holder(j))


def iterate(board: LaneBoard, start: float, turn_s: dict[str, float], turns: int) -> list[str]:
    """Every member keeps asking: the holder runs one iteration of ``turn_s[job]`` seconds, then releases
    and asks again in the same step (what the job side does between iterations). The holders, in order."""
    now = start
    order = []
    for _ in range(turns):
        job = holder(board)
        order.append(job)
        now += turn_s[job]
        assert board.release(job, now, again=True)
    return order


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


# -- turn policies: lane_policy.next_turn's decisions, live ----------------------------------------
def test_srtf_gives_the_turn_to_the_job_with_the_least_time_limit_left():
    board = lane_of("srtf", ("long", 5000.0), ("mid", 900.0), ("short", 300.0))
    assert board.request("long", 0.0)  # alone: it holds
    board.request("mid", 1.0)
    board.request("short", 2.0)
    assert iterate(board, 2.0, {"long": 1.0, "mid": 1.0, "short": 1.0}, 4) == ["long", "short", "short", "short"]
    board.leave("short", 10.0)  # the shortest ended: the next shortest, which keeps it
    assert iterate(board, 10.0, {"long": 1.0, "mid": 1.0}, 3) == ["mid", "mid", "mid"]
    assert [w.remaining_s for w in [board.waiter("long", 0.0, 13.0)]] == [5000.0 - 13.0]


def test_fair_equalises_turn_seconds_not_turns():
    board = lane_of("fair", ("slow", math.inf), ("quick", math.inf))
    board.request("slow", 0.0)
    board.request("quick", 0.0)
    order = iterate(board, 0.0, {"slow": 3.0, "quick": 1.0}, 16)
    assert order[:8] == ["slow", "quick", "quick", "quick", "slow", "quick", "quick", "quick"]
    held = {j: board.members[j].held_s for j in ("slow", "quick")}
    assert abs(held["slow"] - held["quick"]) <= 3.0
    rr = lane_of("round-robin", ("slow", math.inf), ("quick", math.inf))  # the same jobs, equal turns
    rr.request("slow", 0.0)
    rr.request("quick", 0.0)
    assert iterate(rr, 0.0, {"slow": 3.0, "quick": 1.0}, 6) == ["slow", "quick"] * 3


def test_fair_starts_a_joining_job_at_the_lanes_least_service():
    board = lane_of("fair", ("a", math.inf), ("b", math.inf))
    board.request("a", 0.0)
    board.request("b", 0.0)
    iterate(board, 0.0, {"a": 1.0, "b": 1.0}, 20)  # 10 s each
    assert board.join(member("late", 1, 4), CAP) and board.members["late"].lane == board.members["a"].lane
    assert board.members["late"].service_s() == 10.0  # not 0: it would hold the lane for 20 turns
    board.request("late", 20.0)
    order = iterate(board, 20.0, {"a": 1.0, "b": 1.0, "late": 1.0}, 9)
    assert all(len(set(order[i:i + 3])) == 3 for i in range(0, 9, 3)), order


def test_pack_keeps_the_earliest_admitted_job_on_until_it_stops_asking():
    board = lane_of("pack", ("first", math.inf), ("second", math.inf), ("third", math.inf))
    board.request("second", 0.0)  # asked first, but admitted after "first"
    board.request("first", 0.5)
    board.request("third", 0.5)
    assert iterate(board, 1.0, {"first": 1.0, "second": 1.0, "third": 1.0}, 4) == ["second", "first", "first", "first"]
    assert board.release("first", 10.0)  # releases without asking again (it ended its loop)
    assert holder(board) == "second"


def test_a_demoted_job_is_passed_over_once_whatever_the_policy():
    board = lane_of("pack", ("hog", math.inf), ("b", math.inf))
    board.request("hog", 0.0)
    board.request("b", 1.0)
    assert board.overdue(100.0, 10.0) == ["hog"] and board.holder("b")
    assert not board.release("hog", 101.0)
    board.request("hog", 101.0)
    # PACK would give it straight back at b's next release; demotion costs it that one grant
    assert iterate(board, 101.0, {"hog": 1.0, "b": 1.0}, 3) == ["b", "b", "hog"]


def test_round_robin_alternates_with_release_and_ask_again():
    board = lane_of("round-robin", ("a", math.inf), ("b", math.inf), ("c", math.inf))
    for at, job in enumerate("abc"):
        board.request(job, float(at))
    assert iterate(board, 3.0, {j: 1.0 for j in "abc"}, 6) == list("abcabc")
    board.leave("b", 20.0)
    board.leave("c", 20.0)
    assert iterate(board, 20.0, {"a": 1.0}, 2) == ["a", "a"]  # alone: it keeps the turn


def test_the_service_takes_the_policy_by_name_and_srtf_remaining_from_the_facts():
    now = [0.0]
    left = {"7": 7200.0, "8": 600.0, "9": 3600.0}

    def facts(job: str) -> LaneFacts:
        return LaneFacts(job, 1000, 0, GiB, 4 * GiB, False, CAP, left[job])

    service = LaneService(facts, policy="srtf", clock=lambda: now[0])
    for job in ("7", "8", "9"):
        service.join(job)
    assert service.turn("7", lambda: True, 0.0)["granted"]
    assert not service.turn("9", lambda: True, 0.0)["granted"]
    assert not service.turn("8", lambda: True, 0.0)["granted"]
    now[0] = 5.0
    assert service.release("7", again=True)["released"]
    assert service.turn("8", lambda: True, 0.0)["granted"]  # 595 s left, the least
    assert service.snapshot()["policy"] == "srtf"
    assert LaneService(facts).snapshot()["policy"] == "fair"  # the default


def test_time_left_is_the_slurm_limit_less_the_time_run():
    assert time_left({"time_limit_s": 3600.0, "start": 1000.0}, 1600.0) == 3000.0
    assert time_left({"time_limit_s": 60.0, "start": 0.0}, 600.0) == 0.0
    assert time_left({"time_limit_s": None, "start": 0.0}, 100.0) == DEFAULT_REMAINING_S - 100.0


def test_policy_names_are_lane_policys_plus_round_robin_and_the_config_accepts_exactly_those():
    assert set(POLICY_NAMES) == {p.value for p in LanePolicy} | {"round-robin"}
    for name in POLICY_NAMES:
        assert parse_config({"agent": {"lane_policy": name}}).agent.lane_policy == name
        assert callable(turn_policy(name))
    assert parse_config({}).agent.lane_policy == "fair"
    with pytest.raises(ValueError, match="unknown lane policy 'lottery'"):
        turn_policy("lottery")


def test_an_unknown_lane_policy_in_the_config_is_one_line_naming_the_key():
    with pytest.raises(ConfigError) as info:
        parse_config({"agent": {"lane_policy": "srft"}})
    message = str(info.value)
    assert "\n" not in message and "[agent].lane_policy" in message
    assert all(name in message for name in POLICY_NAMES)


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
    cfg = parse_config({"policy": {"max_jobs_per_gpu": 0}})  # shards = memory, whatever the jobs per GPU
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


def test_the_agent_uses_the_configured_policy_and_gives_the_lane_service_the_time_limit_left(tmp_path, clock):
    from prometheus_client import CollectorRegistry

    from gpushare.agent.daemon import Agent
    from gpushare.gres.sim_backend import SimBackend

    scenario = {"version": 1, "name": "lanes", "processes": [], "gpus": [{"model": "a100-40gb"}]}
    cfg = parse_config({"agent": {"state_dir": str(tmp_path / "state"), "run_dir": str(tmp_path / "run"),
                                  "collocation": "fraction", "lane_policy": "srtf"}}).agent
    agent = Agent(cfg, SimBackend.from_scenario(scenario, clock=clock), clock=clock, registry=CollectorRegistry(),
                  pid_job=lambda pid: None)
    agent.register({"job": "7", "uid": 1000, "user": "u", "gpus": [0], "shared": True, "est_gib": 5.0,
                    "margin_gib": 1.0, "shards": 5, "time_limit_s": 3600.0, "lanes": True,
                    "persistent_bytes": GiB, "ephemeral_bytes": 4 * GiB})
    clock.advance(600.0)
    assert agent.lane_facts("7").remaining_s == 3000.0
    assert agent.lanes.snapshot()["policy"] == "srtf"
