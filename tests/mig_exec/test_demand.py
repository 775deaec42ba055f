"""The demand signal: hostile-safe parsing of pending jobs and the target layout the planner derives."""

from __future__ import annotations

from collections import Counter

import pytest

from gpushare.gpus import BUILTIN_GPUS
from gpushare.mig_manager.demand import Want, mark_busy, mig_request, pending_wants, target_for
from gpushare.policy.layout import Instance, format_layout
from gpushare.slurm.jobs import Job, job_from_json

A100 = BUILTIN_GPUS["a100-40gb"]
PROFILES = [p.name for p in A100.mig_profiles]


def job(jid: int, tres: str, state: str = "PENDING", priority: int = 100, partition: str = "gpu",
        reason: str = "Resources", newer: bool = False) -> Job:
    """A job as squeue --json prints it: 22.05's shape, or (``newer``) 24.11/26.05's."""
    if newer:
        def num(n: int) -> dict:
            return {"set": True, "infinite": False, "number": n}
        return job_from_json({"job_id": jid, "job_state": [state], "tres_per_node": tres.replace("gres:", "gres/"),
                              "priority": num(priority), "submit_time": num(1000 + jid), "partition": partition,
                              "state_reason": reason})
    return job_from_json({"job_id": jid, "job_state": state, "tres_per_node": tres, "priority": priority,
                          "submit_time": 1000 + jid, "partition": partition, "state_reason": reason})


def test_mig_request_accepts_only_known_profiles_in_strict_syntax() -> None:
    assert mig_request("gres:gpu:3g.20gb:1", PROFILES) == Counter({"3g.20gb": 1})
    assert mig_request("gres:gpu:1g.5gb:2,gres:shard:4", PROFILES) == Counter({"1g.5gb": 2})
    for hostile in ("gres:gpu:3g.20gb:1;rm -rf /", "gres:gpu:9g.99gb:1", "gres:gpu:3g.20gb:0",
                    "gres:gpu:1g.5gb:999", "gres:gpu:1", "gres:gpu:3g.20gb:1\ngres:gpu:7g.40gb:1",
                    "gpu:3G.20GB:1x", "x" * 10000):
        assert sum(mig_request(hostile, PROFILES).values()) == 0, hostile


def test_pending_wants_in_priority_then_age_order_and_filtered() -> None:
    jobs = [job(1, "gres:gpu:1g.5gb:1"), job(2, "gres:gpu:3g.20gb:1", priority=500),
            job(3, "gres:gpu:2g.10gb:1", state="RUNNING"), job(4, "gres:gpu:2g.10gb:1", partition="other"),
            job(5, "gres:gpu:1g.5gb:2")]
    wants = pending_wants(jobs, PROFILES, partitions=["gpu"])
    assert wants == [Want("3g.20gb", "2"), Want("1g.5gb", "1"), Want("1g.5gb", "5"), Want("1g.5gb", "5")]
    assert len(pending_wants(jobs, PROFILES)) == 5  # no partition filter: job 4 too


def test_pending_wants_read_the_same_from_every_releases_json() -> None:
    old = [job(1, "gres:gpu:1g.5gb:1"), job(2, "gres:gpu:3g.20gb:1", priority=500)]
    new = [job(1, "gres:gpu:1g.5gb:1", newer=True), job(2, "gres:gpu:3g.20gb:1", priority=500, newer=True)]
    assert pending_wants(old, PROFILES) == pending_wants(new, PROFILES) == [Want("3g.20gb", "2"), Want("1g.5gb", "1")]


def test_held_or_blocked_jobs_are_no_demand() -> None:
    """A user must not force reshapes with jobs that cannot run: held, or waiting on a dependency/begin time."""
    jobs = [job(1, "gres:gpu:1g.5gb:7", reason="JobHeldUser", priority=0),
            job(2, "gres:gpu:7g.40gb:1", reason="JobHeldAdmin", priority=0),
            job(3, "gres:gpu:3g.20gb:1", reason="Dependency"), job(4, "gres:gpu:3g.20gb:1", reason="BeginTime"),
            job(5, "gres:gpu:2g.10gb:1", reason="Priority"), job(6, "gres:gpu:2g.10gb:1", reason="None")]
    assert pending_wants(jobs, PROFILES) == [Want("2g.10gb", "5"), Want("2g.10gb", "6")]


def test_target_from_a_full_gpu_for_the_issue_mix() -> None:
    wants = [Want(p, str(n)) for n, p in enumerate(["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"])]
    target, notes = target_for({0: A100}, {0: (Instance("7g.40gb", 0),)}, wants)
    assert sorted(i.profile for i in target[0]) == ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]
    assert "destroy 7g.40gb@0" in notes[0]


def test_busy_instances_are_kept_and_idle_matches_need_no_change() -> None:
    current = mark_busy((Instance("4g.20gb", 0), Instance("3g.20gb", 4)), Counter({"4g.20gb": 1}), set())
    assert [i.busy for i in current] == [True, False]
    target, _ = target_for({0: A100}, {0: current}, [Want("2g.10gb", "1")])
    assert format_layout(target[0]).startswith("4g.20gb@0,2g.10gb@4")
    assert target_for({0: A100}, {0: current}, [Want("3g.20gb", "1")])[0] == {}  # reuse the idle 3g
    target, _ = target_for({0: A100}, {0: current}, [Want("7g.40gb", "1")])
    assert target == {}  # only by destroying the busy 4g: unmet, nothing planned


def test_two_gpus_share_the_wants() -> None:
    wants = [Want("4g.20gb", "1"), Want("4g.20gb", "2")]
    full = (Instance("7g.40gb", 0),)
    target, _ = target_for({0: A100, 1: A100}, {0: full, 1: full}, wants)
    assert sorted(target) == [0, 1]


def test_young_jobs_are_no_demand_and_each_user_is_capped() -> None:
    """Alternating fresh 1g x7 / 7g x1 jobs must not drive reshapes; one user cannot claim a whole node."""
    def owned(jid: int, tres: str, uid: int, submitted: float) -> Job:
        return job_from_json({"job_id": jid, "job_state": "PENDING", "tres_per_node": tres, "priority": 100,
                              "submit_time": submitted, "partition": "gpu", "state_reason": "Resources",
                              "user_id": uid})
    now = 10_000.0
    jobs = [owned(1, "gres:gpu:1g.5gb:7", 1001, now - 10),  # just submitted: not yet demand
            owned(2, "gres:gpu:1g.5gb:7", 1002, now - 900), owned(3, "gres:gpu:2g.10gb:2", 1002, now - 800),
            owned(4, "gres:gpu:3g.20gb:1", 1003, now - 700)]
    wants = pending_wants(jobs, PROFILES, min_age_s=300, max_per_user=4, now=now)
    assert [w.job_id for w in wants] == ["2", "2", "2", "2", "4"]
    assert len(pending_wants(jobs, PROFILES, now=now)) == 17  # without the bounds every instance counts


@pytest.mark.hostile
def test_a_job_pinned_to_another_node_is_no_demand_here() -> None:
    """Issue 22: ``sbatch -w n2`` with n2 drained waits forever (ReqNodeNotAvail) and counted as MIG demand
    on every node; it counts only on the nodes it may run on (an unreadable list: nowhere)."""
    def pinned(nodes: str) -> Job:
        return job_from_json({"job_id": 9, "job_state": "PENDING", "tres_per_node": "gres:gpu:1g.5gb:1",
                              "priority": 1, "submit_time": 1, "partition": "gpu", "required_nodes": nodes,
                              "state_reason": "ReqNodeNotAvail,_UnavailableNodes:n2"})
    assert pending_wants([pinned("n2")], PROFILES, node="n1") == []
    assert pending_wants([pinned("n[1-2]")], PROFILES, node="n1") == [Want("1g.5gb", "9")]
    assert pending_wants([pinned("n[")], PROFILES, node="n1") == []
    assert pending_wants([pinned("")], PROFILES, node="n1") == [Want("1g.5gb", "9")]
