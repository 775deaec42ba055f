"""The asynchronous-estimation state machine, pure: snapshots and a clock in, actions out."""

from __future__ import annotations

import pytest

from gpushare.config import ConfigError, parse_config
from gpushare.gpus import GiB
from gpushare.slurm_plugins.decision import Estimate, SubmitRequest, decide, parse_record
from gpushare.estimate.directives import parse_directives
from gpushare.slurm_plugins.estimation_plan import (Attach, Cancel, EstimationJob, HeldJob, Release, Resume, Submit,
                                                    overdue, plan)
from gpushare.slurm_plugins.protocol import encode_reply
from gpushare.estimate.script_discovery import NotFound, TrainingCommand

NODES = [{"names": "n1", "gpu": "a100-40gb", "count": 2}]


def config(**estimation):
    table = {"partition": "cpu", "max_per_user": 2, "max_total": 3, "watchdog_s": 900, "time_limit_s": 600}
    table.update(estimation)
    return parse_config({"estimation": table, "nodes": NODES, "policy": {"max_jobs_per_gpu": 0}})  # shards = memory


CFG = config()
TRAIN = TrainingCommand("train.py", ("--bs", "8"), "python", 3)
RECORD = {"v": 1, "decision": "estimating", "old": "gres:gpu:1", "new": "gres:shard:40", "script": "train.py"}


def held(job_id, uid=1000, t=100.0, key=None, command=TRAIN, **record):
    return HeldJob(job_id, uid, uid, t, dict(RECORD, **record), "/home/u", key or f"k{job_id}", command)


def est(job_id, for_job, state="RUNNING", uid=1000, outcome=None, spool=None):
    """An estimation job as root submits it: for ``for_job`` (held at t=100), writing into its spool directory."""
    return EstimationJob(job_id, uid, state, for_job, outcome, True, f"{for_job}-100" if spool is None else spool)


def test_config_turns_async_on_where_a_cpu_partition_exists_and_checks_it():
    assert CFG.policy.without_estimate == "async"
    assert parse_config({}).policy.without_estimate == "exclusive"
    chosen = parse_config({"estimation": {"partition": "cpu"}, "policy": {"without_estimate": "recover"}})
    assert chosen.policy.without_estimate == "recover"
    with pytest.raises(ConfigError, match=r"'async' needs \[estimation\] partition"):
        parse_config({"policy": {"without_estimate": "async"}})
    with pytest.raises(ConfigError, match="watchdog_s: must exceed time_limit_s"):
        config(watchdog_s=60, time_limit_s=600)
    with pytest.raises(ConfigError, match=r"\[estimation\].memory"):
        config(memory="lots")


def test_submit_hook_holds_on_all_shards_with_a_clear_record():
    script = "#!/bin/bash\n#SBATCH --gres=gpu:1\nsrun python train.py --bs 8\n"
    decision = decide(SubmitRequest(user_id=1000, tres_per_node="gres:gpu:1", script=script),
                      parse_directives(script), None, CFG)
    assert decision.action == "modify" and decision.hold and decision.tres_per_node == "gres:shard:40"
    assert decision.record["decision"] == "estimating" and "train.py --bs 8" in decision.record["script"]
    assert "held while gpu-estimate" in decision.user_message
    assert b"hold=1\n" in encode_reply(decision)
    assert parse_record(decision.admin_comment)["decision"] == "estimating"


@pytest.mark.parametrize("uid, array, script, why", [
    (0, False, "python train.py\n", "root's jobs"),
    (1000, True, "python train.py\n", "array jobs"),
    (1000, False, "./run.sh\n", "#GPUSHARE script="),
])
def test_submit_hook_falls_back_when_it_cannot_hold(uid, array, script, why):
    decision = decide(SubmitRequest(user_id=uid, tres_per_node="gres:gpu:1", array=array, script=script),
                      parse_directives(script), None, CFG)
    assert not decision.hold and decision.action == "accept" and why in decision.record["why"]
    recover = config(fallback="recover")
    shared = decide(SubmitRequest(user_id=uid, tres_per_node="gres:gpu:1", array=array, script=script),
                    parse_directives(script), None, recover)
    assert shared.tres_per_node == "gres:shard:9" and why in shared.record["why"]


def test_new_jobs_get_estimation_jobs_within_caps_and_duplicates_share_one():
    jobs = [held(1, key="same"), held(2, key="same"), held(3), held(4), held(5, uid=2000), held(6, uid=2000)]
    actions = plan(jobs, {}, 200.0, CFG)
    submits = [a for a in actions if isinstance(a, Submit)]
    assert [a.job.job_id for a in submits] == [1, 3, 5]  # user 1000 capped at 2, cluster at 3
    assert [f.job_id for f in submits[0].followers] == [2]
    assert len(actions) == 3


def test_running_estimation_is_left_alone_and_a_late_duplicate_attaches():
    jobs = [held(1, key="same", est_job=10), held(2, key="same")]
    actions = plan(jobs, {10: est(10, 1)}, 200.0, CFG)
    assert actions == [Attach(2, 10, dict(RECORD, est_job=10))]


def test_completed_estimation_shrinks_and_releases():
    outcome = Estimate(int(5.5 * GiB), "async", "gpu-estimate job 10 for a100-40gb")
    [action] = plan([held(1, est_job=10)], {10: est(10, 1, "COMPLETED", outcome=outcome)}, 160.0, CFG)
    assert isinstance(action, Release) and action.outcome == "estimated"
    assert action.tres_per_node == "gres:shard:7"
    record = action.record
    assert record["decision"] == "shared" and record["src"] == "async" and record["est_job"] == 10
    assert record["held_s"] == 60.0 and record["old"] == "gres:gpu:1" and record["script"] == "train.py"


def test_estimate_too_large_keeps_every_shard():
    outcome = Estimate(39 * GiB, "async")
    [action] = plan([held(1, est_job=10)], {10: est(10, 1, "COMPLETED", outcome=outcome)}, 160.0, CFG)
    assert action.tres_per_node is None and action.record["decision"] == "exclusive"
    assert action.record["new"] == "gres:shard:40" and action.record["src"] == "async"


@pytest.mark.parametrize("state, outcome, why", [
    ("FAILED", "estimation job 10: the training script failed under gpu-estimate", "script failed"),
    ("TIMEOUT", None, "hit its time limit"),
    ("CANCELLED", None, "was cancelled"),
    ("COMPLETED", "estimation job 10: no usable result (not JSON)", "no usable result"),
])
def test_failed_estimation_releases_with_the_fallback(state, outcome, why):
    [action] = plan([held(1, est_job=10)], {10: est(10, 1, state, outcome=outcome)}, 160.0, CFG)
    assert action.outcome == "fallback" and action.tres_per_node is None and why in action.record["why"]
    [shared] = plan([held(1, est_job=10)], {10: est(10, 1, state, outcome=outcome)}, 160.0,
                    config(fallback="recover"))
    assert shared.tres_per_node == "gres:shard:9" and shared.record["src"] == "default"


def test_vanished_estimation_job_releases():
    [action] = plan([held(1, est_job=10)], {}, 160.0, CFG)
    assert action.outcome == "fallback" and "vanished" in action.record["why"]


def test_watchdog_releases_and_cancels_the_estimation():
    actions = plan([held(1, est_job=10, t=0.0)], {10: est(10, 1)}, 901.0, CFG)
    release, cancel = actions
    assert isinstance(release, Release) and release.record["why"].startswith("estimation: watchdog: held 901 s")
    assert cancel == Cancel(10, "job 1 released without it")


def test_watchdog_spares_an_estimation_another_job_still_waits_on():
    jobs = [held(1, key="k", est_job=10, t=0.0), held(2, key="k", est_job=10, t=500.0)]
    actions = plan(jobs, {10: est(10, 1)}, 901.0, CFG)
    assert [type(a) for a in actions] == [Release]


def test_overdue_is_the_watchdog_alone_and_submits_nothing():
    """What `gpushare estimates --release-overdue` does while gpushare-submitd is down."""
    jobs = [held(1, key="k", est_job=10, t=0.0), held(2, key="k", est_job=10, t=500.0),  # 2 still waits on 10
            held(3, key="m", est_job=11, t=0.0), held(4, uid=2000, key="n", t=850.0)]  # plan() submits for 4
    estimations = {10: est(10, 1), 11: est(11, 3)}
    actions = overdue(jobs, estimations, 901.0, CFG)
    assert [(type(a).__name__, getattr(a, "job_id", None) or a.est_job) for a in actions] == \
        [("Release", 1), ("Release", 3), ("Cancel", 11)]
    assert all(a.record["why"].startswith("estimation: watchdog: held") for a in actions if isinstance(a, Release))
    full = plan(jobs, estimations, 901.0, CFG)
    assert all(a in full for a in actions) and any(isinstance(a, Submit) for a in full)
    assert overdue(jobs, estimations, 400.0, CFG) == []


def test_script_not_found_or_unreadable_releases_at_once():
    actions = plan([held(1, command=NotFound("no python line")), held(2, command=None)], {}, 101.0, CFG)
    assert [a.record["why"] for a in actions] == ["estimation: no python line",
                                                  "estimation: batch script not readable"]


def test_orphaned_estimation_is_cancelled():
    actions = plan([], {10: est(10, 1), 11: est(11, 2, "COMPLETED")}, 200.0, CFG)
    assert actions == [Cancel(10, "job 1 no longer waits for it")]


def test_held_jobs_are_handled_oldest_first_and_finished_estimations_free_the_caps():
    jobs = [held(3, t=300.0), held(1, t=100.0), held(2, t=200.0)]
    estimations = {10: est(10, 99, "COMPLETED"), 11: est(11, 98, "FAILED")}
    submits = [a.job.job_id for a in plan(jobs, estimations, 400.0, CFG) if isinstance(a, Submit)]
    assert submits == [1, 2]


def test_jobs_merely_named_like_ours_neither_use_the_caps_nor_get_cancelled():
    lookalikes = {20 + i: est(20 + i, 900 + i, uid=1000, outcome=None) for i in range(5)}
    lookalikes = {k: EstimationJob(v.job_id, v.user_id, v.state, v.for_job, None, ours=False)
                  for k, v in lookalikes.items()}
    actions = plan([held(1), held(2, uid=2000)], lookalikes, 200.0, CFG)
    assert [type(a) for a in actions] == [Submit, Submit]


def test_jobs_their_user_released_get_their_record_closed_and_estimation_cancelled():
    actions = plan([], {10: est(10, 1)}, 160.0, CFG, started=(held(1, est_job=10),))
    release, cancel = actions
    assert release.outcome == "user" and release.tres_per_node is None
    assert release.record["decision"] == "exclusive" and "released by its user" in release.record["why"]
    assert cancel == Cancel(10, "job 1 no longer waits for it")


def test_an_estimation_submitted_just_before_a_crash_is_adopted_not_duplicated():
    """submitd killed between ``sbatch`` and writing est_job into the record: the restarted service finds
    the estimation job (ours, for that held job) and attaches it instead of submitting a second one;
    a second such orphan for the same job is cancelled."""
    actions = plan([held(1)], {10: est(10, 1), 12: est(12, 1)}, 200.0, CFG)
    assert Attach(1, 10, dict(RECORD, est_job=10)) in actions
    assert not [a for a in actions if isinstance(a, Submit)]
    assert Cancel(12, "job 1 already has an estimation job") in actions


def test_an_estimation_still_held_from_its_submission_is_released_or_cancelled():
    """Estimation jobs are submitted held, marked, then released. Killed after the mark: the adopted job is
    released (Resume). Killed before it: the unmarked held job of the same user is cancelled unrun and the
    held job gets one of its own; another user's held look-alike is left alone."""
    marked = EstimationJob(10, 1000, "PENDING", 1, None, True, "1-100", hold="user")
    actions = plan([held(1)], {10: marked}, 200.0, CFG)
    assert Attach(1, 10, dict(RECORD, est_job=10)) in actions and Resume(10) in actions
    unmarked = EstimationJob(11, 1000, "PENDING", 2, None, False, "", hold="user")
    lookalike = EstimationJob(12, 2000, "PENDING", 2, None, False, "", hold="user")
    running = EstimationJob(13, 1000, "RUNNING", 2, None, False, "")
    actions = plan([held(2)], {11: unmarked, 12: lookalike, 13: running}, 200.0, CFG)
    assert [a.job.job_id for a in actions if isinstance(a, Submit)] == [2]
    assert [a.est_job for a in actions if isinstance(a, Cancel)] == [11]
    assert not [a for a in actions if isinstance(a, Resume)]


@pytest.mark.hostile
@pytest.mark.parametrize("decoy, why", [
    (est(66, 1, uid=2000, spool="9-100"), "another user's job, renamed, writing into its own spool directory"),
    (est(66, 1, uid=2000), "another user's job pointing its output at the victim's directory"),
    (est(66, 1, spool="1-99"), "the user's own job, into another directory"),
    (EstimationJob(66, 1000, "RUNNING", 1, None, False, ""), "output outside the spool"),
])
def test_a_job_renamed_like_an_estimation_is_never_adopted(decoy, why):
    """The forgery of issue 22: a held decoy renamed ``gpushare-estimate-<victim>`` with ``scontrol update
    name=`` while the victim waits. The name is a user's to set, so it proves nothing: the decoy is not
    attached, the victim gets its own estimation job, and the decoy (if in the spool) is cancelled."""
    actions = plan([held(1)], {66: decoy}, 200.0, CFG)
    assert not [a for a in actions if isinstance(a, Attach)], why
    assert [a.job.job_id for a in actions if isinstance(a, Submit)] == [1], why
    if decoy.ours:
        assert Cancel(66, "job 1 has its own estimation job; this one "
                          f"(uid {decoy.user_id}) only bears its name") in actions


@pytest.mark.hostile
def test_a_recorded_estimation_of_another_user_never_sizes_the_job():
    """Defence in depth: even an id in the root-written record sizes the job only with its own user's estimate."""
    small = Estimate(1 * GiB, "async", "gpu-estimate job 66 for a100-40gb")
    forged = plan([held(1, est_job=66)], {66: est(66, 1, state="COMPLETED", uid=2000, outcome=small)}, 200.0, CFG)
    (release,) = [a for a in forged if isinstance(a, Release)]
    assert release.outcome == "fallback" and "is not this job's (uid 2000)" in release.record["why"]
    own = plan([held(1, est_job=66)], {66: est(66, 1, state="COMPLETED", outcome=small)}, 200.0, CFG)
    (release,) = [a for a in own if isinstance(a, Release)]
    assert release.outcome == "estimated"
