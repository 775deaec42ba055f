"""The pure recovery decision: shard -> all shards of the GPU, MIG -> next larger slice, bounded retries."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gpushare.config import Config
from gpushare.policy.oom_recovery import (Action, JobFacts, OomEvidence, OomVerdict, decide as decide_on,
                                          failed_size_bytes, merge_oom_comment, next_mig_profile, whole_gpu_shards)
from gpushare.slurm.hostlist import expand_hostlist
from gpushare.slurm.jobs import job_from_json
from oom_fake_slurm import FakeSlurm
from gpushare.config import parse_config

OOM = OomVerdict(True, "GPU out of memory (pytorch) in /tmp/err", "pytorch", "torch.OutOfMemoryError: ...", "/tmp/e")
NOT_OOM = OomVerdict(False, "failed (exit 1) without a GPU out-of-memory message")


def cfg(**oom: object):  # type: ignore[no-untyped-def]
    return parse_config({
        "oom": dict(oom),
        "nodes": [{"names": "n[1-2]", "gpu": "a100-40gb", "count": 2},
                  {"names": "big01", "gpu": "h200-141gb", "count": 8}],
    })


def job(**fields: str) -> JobFacts:
    return JobFacts.from_job(FakeSlurm(fields).job("1"), {})


def decide(facts: JobFacts, verdict: OomVerdict, config: Config, retries_used: int = 0,
           mig_available: set[str] | None = None, whole_gpu_as_gpu: bool = False) -> Action:
    """The decision on the evidence of a corroborated OOM (gpushare sized the job, the agent measured its share
    full), so these tests judge the sizes and the bounds; tests/oom/test_oom_decision.py judges the evidence."""
    share = failed_size_bytes(facts.gres, config)
    backed = dataclasses.replace(facts, record={"decision": "shared", **(facts.record or {})})
    return decide_on(OomEvidence(backed, verdict, ({"gpus": {"0": {"peak_bytes": share}}},) if share else (),
                                 retries_used=retries_used, mig_available=mig_available,
                                 whole_gpu_as_gpu=whole_gpu_as_gpu), config)


def test_facts_from_the_structured_record() -> None:
    facts = job(AdminComment='gpushare:{"decision":"shared","v":1}', StdErr="err.txt", WorkDir="/home/a")
    assert (facts.job_id, facts.state, facts.exit_code, facts.exit_signal) == ("1", "COMPLETING", 1, 0)
    assert (facts.node, facts.restarts, facts.uid, facts.gid) == ("n1", 0, 0, 0)
    assert facts.log_paths == ("/home/a/err.txt", "/tmp/out-1.txt")
    assert facts.record == {"decision": "shared", "v": 1}


def test_newer_releases_json_gives_the_same_facts() -> None:
    """24.11/26.05: job_state is a list with flags, exit_code and numbers are objects, GRES use 'gres/'."""
    def num(n: int) -> dict:
        return {"set": True, "infinite": False, "number": n}
    new = job_from_json({
        "job_id": 1, "user_id": 0, "group_id": 0, "job_state": ["FAILED", "COMPLETING"], "restart_cnt": 0,
        "exit_code": {"status": ["EXITED"], "return_code": num(1), "signal": {"id": {"set": False, "infinite": False,
                                                                                        "number": 0}, "name": ""}},
        "priority": num(4294901759), "nodes": "n1", "batch_host": "n1", "tres_per_node": "gres/shard:4",
        "current_working_directory": "/work", "standard_error": "/tmp/err-%j.txt", "standard_output": "",
        "admin_comment": "", "requeue": True, "array_job_id": num(0), "array_task_id": {"set": False}})
    facts = JobFacts.from_job(new, {})
    assert (facts.state, facts.exit_code, facts.exit_signal, facts.restarts, facts.node) == ("FAILED", 1, 0, 0, "n1")
    assert facts.log_paths == ("/tmp/err-1.txt", "/work/slurm-1.out")
    action = decide(facts, OOM, cfg(), retries_used=0)
    assert action.new_gres == "gres/shard:40"  # written back in the release's own form


def test_identity_comes_from_the_environment_before_the_record() -> None:
    env = {"SLURM_JOB_ID": "1", "SLURM_JOB_UID": "1000", "SLURM_JOB_GID": "100", "SLURM_JOB_EXIT_CODE2": "1:0",
           "SLURM_JOB_RESTART_COUNT": "0", "SLURM_JOB_NODELIST": "n2"}
    structured = FakeSlurm({"ExitCode": "0:0", "Restarts": "9", "UserId": "x(1001)", "GroupId": "y(101)"}).job("1")
    facts = JobFacts.from_job(structured, env)
    assert (facts.uid, facts.gid, facts.exit_code, facts.restarts, facts.node) == (1000, 100, 1, 0, "n2")
    facts = JobFacts.from_job(structured, {"SLURM_JOB_ID": "1"})
    assert (facts.uid, facts.gid, facts.restarts) == (1001, 101, 9)


def test_facts_fall_back_to_the_hook_environment() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_EXIT_CODE": str(3 << 8), "SLURM_JOB_UID": "1000",
           "SLURM_JOB_GID": "100", "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_JOB_RESTART_COUNT": "2"}
    facts = JobFacts.from_job(None, env)
    assert (facts.job_id, facts.exit_code, facts.uid, facts.gid, facts.node, facts.restarts) == \
        ("7", 3, 1000, 100, "gpu03", 2)


def test_shard_job_gets_all_shards_of_its_gpu() -> None:
    action = decide(job(), OOM, cfg(), retries_used=0)
    assert action.kind == "requeue"
    assert action.new_gres == "gres:shard:40"  # a100-40gb = 40 GiB = 40 shards on n1
    assert action.nice == 0 and action.retry == 1  # its own nice back: its place in the queue, no boost
    assert action.oom == {"n": 1, "max": 1, "fam": "pytorch", "from": "gres:shard:4", "to": "gres:shard:40"}
    assert "requeued" in action.user_message


def test_unknown_node_gets_the_largest_gpu_so_it_is_whole_wherever_it_lands() -> None:
    assert whole_gpu_shards(cfg(), "elsewhere") == 140
    assert whole_gpu_shards(cfg(), "big01") == 140
    assert decide(job(BatchHost="x9", NodeList="x9"), OOM, cfg(), 0).new_gres == "gres:shard:140"


def test_other_gres_items_are_kept() -> None:
    action = decide(job(TresPerNode="gres:shard:4,gres:license_x:1"), OOM, cfg(), 0)
    assert action.new_gres == "gres:shard:40,gres:license_x:1"


def test_mig_job_moves_to_the_next_larger_profile() -> None:
    config = cfg()
    assert next_mig_profile(config, "1g.5gb").name == "1g.10gb"
    assert next_mig_profile(config, "3g.20gb").name == "7g.40gb"
    assert next_mig_profile(config, "1g.10gb", {"1g.10gb", "2g.20gb", "3g.40gb"}).name == "2g.20gb"
    action = decide(job(TresPerNode="gres:gpu:1g.10gb:1"), OOM, config, 0, {"1g.10gb", "2g.20gb"})
    assert action.kind == "requeue" and action.new_gres == "gres:gpu:2g.20gb:1"
    # 1g.10gb exists on A100-40GB and A100-80GB: the node's own model (n1: a100-40gb) decides
    assert next_mig_profile(config, "1g.10gb", None, "a100-40gb").name == "3g.20gb"
    assert next_mig_profile(config, "1g.10gb", None, "a100-80gb").name == "1g.20gb"
    assert decide(job(TresPerNode="gres:gpu:1g.10gb:1"), OOM, config, 0).new_gres == "gres:gpu:3g.20gb:1"


def test_largest_mig_profile_and_whole_gpus_stay_failed() -> None:
    config = cfg()
    action = decide(job(TresPerNode="gres:gpu:7g.80gb:1"), OOM, config, 0)
    assert action.kind == "stay_failed" and "no larger MIG profile" in action.reason
    action = decide(job(TresPerNode="gres:gpu:1"), OOM, config, 0)
    assert action.kind == "stay_failed" and "whole GPUs" in action.reason
    action = decide(job(TresPerNode="gres:mps:50"), OOM, config, 0)
    assert action.kind == "stay_failed" and "no memory size" in action.reason
    action = decide(job(TresPerNode="gres:shard:40"), OOM, config, 0)
    assert action.kind == "stay_failed" and "all 40 shards" in action.reason


def test_retries_are_bounded_by_ledger_and_by_the_jobs_record() -> None:
    action = decide(job(), OOM, cfg(), retries_used=1)
    assert action.kind == "stay_failed"
    assert action.reason == "GPU out of memory again after 1 recovery retry; not requeued ([oom] max_retries = 1)"
    assert "stays failed" in action.user_message
    recorded = job(AdminComment='gpushare:{"oom":{"n":1},"v":1}')
    assert decide(recorded, OOM, cfg(), retries_used=0).kind == "stay_failed"  # ledger lost: record still counts
    assert decide(job(), OOM, cfg(max_retries=2), retries_used=1).retry == 2
    assert decide(job(), OOM, cfg(max_retries=0), 0).kind == "stay_failed"


@pytest.mark.parametrize("state", ["CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED"])
def test_only_failed_jobs_are_recovered(state: str) -> None:
    assert decide(job(JobState=state), OOM, cfg(), 0).kind == "none"


def test_no_requeue_jobs_stay_failed() -> None:
    """Measured: requeuehold of a --no-requeue job is refused ("presently disabled")."""
    action = decide(job(Requeue="0"), OOM, cfg(), 0)
    assert action.kind == "stay_failed" and "--no-requeue" in action.reason


def test_non_oom_failure_is_never_requeued() -> None:
    action = decide(job(), NOT_OOM, cfg(), 0)
    assert action.kind == "none" and action.reason == NOT_OOM.reason


def test_unparseable_gres_stays_failed_without_raising() -> None:
    assert decide(job(TresPerNode="gres:sh ard:x:y:z"), OOM, cfg(), 0).kind == "stay_failed"


def test_oom_entry_is_merged_into_our_record_and_never_into_a_foreign_comment() -> None:
    oom = {"n": 1, "max": 1, "fam": "pytorch", "from": "gres:shard:4", "to": "gres:shard:40"}
    merged = merge_oom_comment('gpushare:{"decision":"shared","run":{"ttfk_s":3.2},"v":1}', oom)
    assert json.loads(merged.removeprefix("gpushare:")) == {"decision": "shared", "run": {"ttfk_s": 3.2},
                                                             "v": 1, "oom": oom}
    assert json.loads(merge_oom_comment(None, oom).removeprefix("gpushare:")) == {"v": 1, "oom": oom}
    assert merge_oom_comment("ticket 4711: node swap", oom) is None  # an admin's own note stays
    huge = 'gpushare:{"v":1,"detail":"' + "x" * 2000 + '"}'
    assert len(merge_oom_comment(huge, oom)) <= 900


def test_hostlist_expansion() -> None:
    assert expand_hostlist("gpu[01-03,07],cpu1") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]
    assert expand_hostlist("n[1-100000]", limit=5) == ["n1", "n2", "n3", "n4", "n5"]


def test_whole_gpu_is_gpu_1_where_slurm_lets_a_held_job_change_gres_names() -> None:
    """24.11+ accept shard -> gpu on a held (requeuehold) job: the re-run may land on a GPU of any size."""
    action = decide(job(), OOM, cfg(), retries_used=0, whole_gpu_as_gpu=True)
    assert action.kind == "requeue" and action.new_gres == "gres:gpu:1"
    assert action.oom is not None and action.oom["to"] == "gres:gpu:1"
    again = decide(job(TresPerNode="gres:gpu:1", AdminComment=f'gpushare:{{"oom":{json.dumps(action.oom)}}}'),
                   OOM, cfg(), retries_used=1, whole_gpu_as_gpu=True)
    assert again.kind == "stay_failed"
