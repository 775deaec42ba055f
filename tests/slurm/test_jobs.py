"""gpushare.slurm: one typed job record from every release's JSON, versions, hostlists, the AdminComment record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpushare.slurm import record
from gpushare.slurm.gres_request import GresItem, format_gres, parse_gres, plain_gres
from gpushare.slurm.hostlist import HostlistError, expand_hostlist, first_host
from gpushare.slurm.jobs import check_job_id, expand_log_pattern, job_from_json, log_paths, number, states_of
from gpushare.slurm.version import SUPPORTED, SlurmVersion

# One failed job as each release's squeue --json prints it inside EpilogSlurmctld (fields we read).
OLD = {"job_id": 12, "name": "train", "user_id": 1000, "user_name": "ana", "group_id": 100,
       "job_state": "COMPLETING", "state_reason": "NonZeroExitCode", "exit_code": 3 << 8, "priority": 4294901759,
       "nice": 0, "submit_time": 1795444607, "restart_cnt": 1, "requeue": True, "admin_comment": "",
       "partition": "gpu", "nodes": "n1", "batch_host": "n1", "current_working_directory": "/home/ana",
       "standard_output": "out-%j.txt", "standard_error": "", "tres_per_node": "gres:shard:4",
       "tres_per_job": "", "array_job_id": 0, "array_task_id": None}


def _num(n: int) -> dict:
    return {"set": True, "infinite": False, "number": n}


NEW = {**OLD, "job_state": ["FAILED", "COMPLETING"], "tres_per_node": "gres/shard:4",
       "exit_code": {"status": ["EXITED"], "return_code": _num(3), "signal": {"id": {"set": False, "number": 0},
                                                                             "name": ""}},
       "priority": _num(4294901759), "submit_time": _num(1795444607), "array_job_id": _num(0),
       "array_task_id": {"set": False, "infinite": False, "number": 0}, "nice": 0}


@pytest.mark.parametrize("shape", [OLD, NEW], ids=["22.05", "24.11+"])
def test_every_release_gives_the_same_job(shape: dict) -> None:
    job = job_from_json(shape)
    assert (job.job_id, job.name, job.user_id, job.group_id, job.user_name) == ("12", "train", 1000, 100, "ana")
    assert (job.exit_status, job.exit_signal, job.priority, job.submit_time, job.restarts) == \
        (3, 0, 4294901759, 1795444607, 1)
    assert job.completing and job.array_job_id is None and job.array_task_id is None
    assert plain_gres(job.tres_per_node) == "shard:4"
    assert log_paths(job, "n1") == ("/home/ana/out-12.txt",)


def test_state_is_the_base_state_and_flags_are_kept() -> None:
    assert job_from_json(NEW).state == "FAILED"
    assert job_from_json(OLD).state == "COMPLETING"  # 22.05 shows only the flag while the epilog runs
    assert states_of(["PENDING", "REQUEUE_HOLD"]) == ("PENDING", "REQUEUE_HOLD")
    assert job_from_json({**NEW, "job_state": ["PENDING", "REQUEUE_HOLD"]}).pending
    held = job_from_json({**OLD, "job_state": "PENDING", "state_reason": "JobHeldUser", "priority": 0})
    assert held.held and not held.active
    running = job_from_json({**NEW, "job_state": ["RUNNING"]})
    assert running.active and not running.completing


def test_negative_nice_from_22_05s_unsigned_print() -> None:
    assert job_from_json({**OLD, "nice": 4294957296}).nice == -10000
    assert job_from_json({**NEW, "nice": -10000}).nice == -10000


def test_numbers_in_every_shape() -> None:
    assert number(_num(7)) == 7 and number(7) == 7 and number("7") == 7
    assert number({"set": False, "number": 5}) is None and number({"set": True, "infinite": True, "number": 0}) is None
    assert number(True) is None and number("x") is None and number(None) is None


def test_array_tasks_are_named_as_users_name_them() -> None:
    task = job_from_json({**NEW, "job_id": 15, "array_job_id": _num(12), "array_task_id": _num(3)})
    assert (task.job_id, task.array_name, task.array_job_id, task.array_task_id) == ("15", "12_3", 12, 3)
    old_task = job_from_json({**OLD, "job_id": 15, "array_job_id": 12, "array_task_id": 3})
    assert old_task.array_name == "12_3"
    assert log_paths(task) == ("/home/ana/out-15.txt",)
    default = job_from_json({**NEW, "job_id": 15, "array_job_id": _num(12), "array_task_id": _num(3),
                             "standard_output": ""})
    assert log_paths(default) == ("/home/ana/slurm-12_3.out",)


def test_log_patterns_expand_like_slurm() -> None:
    job = job_from_json({**OLD, "standard_output": "/logs/%x-%u-%5j.%N.%%.out"})
    assert expand_log_pattern(job.std_out, job, "n1.cluster") == "/logs/train-ana-00012.n1.%.out"
    assert expand_log_pattern("%t-%j.out", job) is None  # a per-task value only slurmstepd knows: skip
    assert log_paths(job_from_json({**OLD, "standard_output": "/dev/null"})) == ()


def test_job_ids_are_checked_before_they_reach_argv() -> None:
    assert check_job_id(" 12 ") == "12" and check_job_id("12_3") == "12"[:2] + "_3"
    for hostile in ("12;reboot", "-1", "12 13", "", "1" * 11):
        with pytest.raises(ValueError):
            check_job_id(hostile)


def test_versions_and_their_capabilities() -> None:
    old, new, newest = (SlurmVersion.parse(t) for t in ("slurm-wlm 22.05.8", "slurm 24.11.5", "slurm 26.05.5"))
    assert old < new < newest and str(old) == "22.05.8" and [v.release for v in (old, new, newest)] == list(SUPPORTED)
    assert (old.gres_separator, new.gres_separator) == ("gres:", "gres/")
    assert not old.scontrol_json and new.scontrol_json and not old.cgroup_disabled and new.cgroup_disabled
    assert not old.least_loaded_shared_gres and newest.least_loaded_shared_gres
    with pytest.raises(ValueError):
        SlurmVersion.parse("slurm unknown")


def test_gres_items_keep_the_separator_they_came_with() -> None:
    old, new = parse_gres("gres:gpu:1,gres:license:2")[0], parse_gres("gres/gpu:1")[0]
    assert old.replaced("shard", None, 8).format() == "gres:shard:8"
    assert new.replaced("shard", None, 8).format() == "gres/shard:8"
    assert format_gres([GresItem("gpu", "a100", 2, "")]) == "gpu:a100:2"
    assert plain_gres("gres/shard:8,gres/gpu:3g.20gb:1") == "shard:8,gpu:3g.20gb:1"


def test_hostlists() -> None:
    assert expand_hostlist("gpu[01-03,07],cpu1") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]
    assert expand_hostlist("n[1-100000]", limit=5) == ["n1", "n2", "n3", "n4", "n5"]
    assert first_host("n[3-4]") == "n3" and first_host("") == ""
    assert expand_hostlist("a[1-2]b[3]") == []  # two brackets in one name: skipped when lenient
    with pytest.raises(HostlistError):
        expand_hostlist("a[2-1]", strict=True)


def test_record_merge_keeps_other_writers_keys_and_foreign_comments() -> None:
    first = record.render({"decision": "shared", "est_gib": 3.0, "why": "fits"})
    assert first is not None and record.parse(first) == {"v": 1, "decision": "shared", "est_gib": 3.0, "why": "fits"}
    merged = record.merge(first, oom={"n": 1})
    assert record.parse(merged) == {"v": 1, "decision": "shared", "est_gib": 3.0, "why": "fits", "oom": {"n": 1}}
    assert record.merge("site note: keep me", run={"ttfk_s": 1}) is None  # never overwrite someone else's
    assert record.parse('gpushare:{"v": 2, "decision": "x"}') is None  # a newer writer's record: not ours
    long = record.render({"decision": "shared", "why": "w" * 2000, "detail": "d" * 2000})
    assert long is not None and len(long) <= record.MAX_CHARS and "detail" not in json.loads(long[9:])
    assert record.render({"decision": "x" * 2000}) is None


@pytest.mark.parametrize("release", SUPPORTED)
def test_real_squeue_output_of_every_release(release: str) -> None:
    """``squeue --json -t all`` captured from real daemons of each release (a failed GPU job with a forged
    name, a held GPU job, a held array, a running job), read the same way."""
    data = json.loads((Path(__file__).parent / "data" / f"squeue-{release}.json").read_text())
    assert SlurmVersion.parse(data["release"]).release == release
    failed, held, array, running = (job_from_json(j) for j in data["jobs"])
    assert (failed.state, failed.exit_status, failed.exit_signal, failed.completing) == ("FAILED", 3, 0, False)
    assert failed.name == "fail x StdErr=/etc/shadow" and plain_gres(failed.tres_per_node) == "gpu:1"
    assert log_paths(failed, "n1") == ("/work/work/out-1.txt",)
    assert held.held and held.reason == "JobHeldUser" and log_paths(held) == ("/work/work/slurm-2.out",)
    assert array.array_job_id == 3 and array.array_task_id is None and array.array_name == "3" and array.held
    assert running.state == "RUNNING" and running.active and running.priority and running.priority > 0
    assert record.parse(failed.admin_comment)["decision"] == "exclusive"
