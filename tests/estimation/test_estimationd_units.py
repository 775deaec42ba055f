"""The estimation driver's Slurm-facing pieces, against a recording fake client (no cluster needed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from gpushare.config import parse_config
from gpushare.slurm_plugins.estimation_plan import HeldJob
from gpushare.slurm_plugins.estimation_result import MAX_CHARS, condense, parse, render
from gpushare.slurm_plugins.estimationd import EstimationService
from gpushare.estimate.script_discovery import TrainingCommand
from gpushare.slurm.jobs import Job, job_from_json


class FakeClient:
    """Records sbatch/scontrol calls; answers squeue with the jobs given."""

    def __init__(self, jobs: list[dict] | None = None) -> None:
        self.listing = jobs or []
        self.calls: list[tuple] = []
        self.comments: dict[int, str] = {}

    def jobs(self) -> list[Job]:
        return [job_from_json(j) for j in self.listing]

    def run(self, tool: str, *args: str, check: bool = True) -> str:
        self.calls.append((tool, *args))
        return "#!/bin/sh\npython train.py --bs 4\n" if args[:2] == ("write", "batch_script") else ""

    def sbatch(self, *args: str, script: str | None = None) -> tuple[int, str]:
        self.calls.append(("sbatch", *args, script))
        return 77, ""

    def update_job(self, job_id, **fields) -> None:
        self.calls.append(("update", job_id, fields))
        if "admincomment" in fields:
            self.comments[int(job_id)] = fields["admincomment"]

    def job(self, job_id) -> Job:
        """Slurm's current record: the listing's, with the AdminComment last written."""
        found = next((j for j in self.listing if j["job_id"] == int(job_id)), {"job_id": int(job_id)})
        return job_from_json(dict(found, admin_comment=self.comments.get(int(job_id), found.get("admin_comment", ""))))


def service(tmp_path: Path, jobs: list[dict] | None = None, now: float = 1000.0) -> EstimationService:
    cfg = parse_config({"estimation": {"partition": "cpu", "spool_dir": str(tmp_path / "spool"),
                                       "command": "/opt/est/gpu-estimate", "memory": "2G"},
                        "nodes": [{"names": "n1", "gpu": "a100-40gb"}]})
    return EstimationService(cfg, FakeClient(jobs), clock=lambda: now)  # type: ignore[arg-type]


def test_submit_runs_as_the_user_with_limits_and_its_output_on_the_node(tmp_path):
    svc = service(tmp_path)
    job = HeldJob(5, os.getuid(), os.getgid(), 990.0, {"decision": "estimating"}, "/home/ana/run", "k",
                  TrainingCommand("train.py", ("--bs", "4 8"), "python", 2))
    assert svc.submit(job) == 77
    call, mark, release = svc.client.calls[-3:]  # type: ignore[attr-defined]
    args, script = call[1:-1], call[-1]
    assert mark[:2] == ("update", 77) and json.loads(mark[2]["admincomment"][9:])["est_for"] == "5-990"
    assert "--hold" in args and release == ("scontrol", "release", "77")  # never runs before its mark
    assert f"--uid={os.getuid()}" in args and "--partition=cpu" in args and "--export=NONE" in args
    assert "--job-name=gpushare-estimate-5" in args and "--mem=2048M" in args and "--chdir=/home/ana/run" in args
    assert "--output=/dev/null" in args  # no guessable path in a shared /tmp: the result is in its Comment
    assert not (tmp_path / "spool").exists()  # root makes nothing for the job on the controller
    assert "/opt/est/gpu-estimate --json --no-progress" in script
    assert "--gpu a100-40gb" in script and "train.py --bs '4 8'" in script
    assert "gpushare.slurm_plugins.estimation_result" in script and script.rstrip().endswith("exit $rc")


def test_tick_discovers_holds_and_attaches(tmp_path):
    record = 'gpushare:{"v":1,"decision":"estimating","old":"gres:gpu:1","new":"gres:shard:40"}'
    jobs = [{"job_id": 5, "name": "train", "job_state": "PENDING", "user_id": os.getuid(), "group_id": os.getgid(),
             "submit_time": 990, "admin_comment": record, "current_working_directory": str(tmp_path)}]
    svc = service(tmp_path, jobs)
    svc.tick()
    calls = svc.client.calls  # type: ignore[attr-defined]
    assert calls[0][:3] == ("scontrol", "write", "batch_script")
    assert calls[1][0] == "sbatch"
    assert calls[1][0] == "sbatch" and "--hold" in calls[1]
    assert calls[2][:2] == ("update", 77)  # root marks its estimation job (est_for) before anything else
    assert calls[3] == ("scontrol", "release", "77")  # and only then lets it run
    update = calls[4]
    assert update[:2] == ("update", 5) and json.loads(update[2]["admincomment"][9:])["est_job"] == 77


def test_a_release_interrupted_after_its_decision_is_finished_by_the_next_round(tmp_path):
    """The record is written with ``releasing`` before ``scontrol release`` and cleared after it; a job still
    held with the key (the service was killed in between) is released by the next round, decision kept."""
    decided = 'gpushare:{"v":1,"decision":"shared","new":"gres:shard:4","held_s":3.0,"releasing":1}'
    jobs = [{"job_id": 5, "name": "train", "job_state": "PENDING", "user_id": os.getuid(), "group_id": os.getgid(),
             "submit_time": 990, "priority": 0, "admin_comment": decided}]
    svc = service(tmp_path, jobs)
    svc.tick()
    calls = svc.client.calls  # type: ignore[attr-defined]
    assert calls[0] == ("scontrol", "release", "5")
    record = json.loads(svc.client.comments[5][9:])  # type: ignore[attr-defined]
    assert "releasing" not in record and record["decision"] == "shared" and record["new"] == "gres:shard:4"
    settled = dict(jobs[0], admin_comment=svc.client.comments[5])  # type: ignore[attr-defined]
    again = service(tmp_path, [settled])
    again.tick()
    assert not again.client.calls  # type: ignore[attr-defined]  # an administrator's later hold is left alone


def test_estimation_holds_are_read_from_the_reason(tmp_path):
    svc = service(tmp_path)
    held = dict(estimation_job(77, "PENDING", ""), priority=0, state_reason="JobHeldAdmin")
    assert svc._estimation(job_from_json(held), 5).hold == "admin"
    assert svc._estimation(job_from_json(dict(held, state_reason="JobHeldUser")), 5).hold == "user"
    assert svc._estimation(job_from_json(estimation_job(77, "RUNNING", "")), 5).hold == ""


def estimation_job(job_id: int, state: str, comment: str, uid: int | None = None,
                   mark: str = 'gpushare:{"v":1,"est_for":"5-990"}') -> dict:
    return {"job_id": job_id, "user_id": os.getuid() if uid is None else uid, "job_state": state,
            "standard_output": "/dev/null", "admin_comment": mark, "comment": comment}


def test_results_are_read_from_the_estimation_jobs_comment_and_checked(tmp_path):
    svc = service(tmp_path)
    good = render({"v": 1, "exit": 0, "bytes": 3 << 30, "gpu": "a100-40gb",
                   "python": {"executable": "/home/ana/venv/bin/python", "python_version": "3.11.2",
                              "torch_version": "2.5.1"}})
    est = svc._estimation(job_from_json(estimation_job(77, "COMPLETED", good)), 5)
    assert est.ours and est.spool_name == "5-990" and est.outcome.total_bytes == 3 << 30
    assert est.interpreter == "/home/ana/venv/bin/python (Python 3.11.2, PyTorch 2.5.1)"
    for forged in (render({"v": 1, "exit": 0, "bytes": 3 << 30, "gpu": "h100-80gb"}),  # not this cluster's GPU
                   render({"v": 1, "exit": 0, "bytes": -5, "gpu": "a100-40gb"}),
                   render({"v": 1, "exit": 0, "bytes": True, "gpu": "a100-40gb"}),
                   'gpushare-estimate:{"v":1,"exit":0,"bytes":1e99,"gpu":"a100-40gb"}'):
        outcome = svc._estimation(job_from_json(estimation_job(77, "COMPLETED", forged)), 5).outcome
        assert isinstance(outcome, str) and "no usable result" in outcome, forged
    missing = svc._estimation(job_from_json(estimation_job(77, "COMPLETED", "gpushare: GPU memory estimate")), 5)
    assert "no result reached the controller" in missing.outcome
    outside = svc._estimation(job_from_json(estimation_job(79, "COMPLETED", good, mark="")), 5)
    assert not outside.ours and outside.outcome is None
    failed = svc._estimation(job_from_json(estimation_job(77, "FAILED", render({"v": 1, "exit": 3}))), 5)
    assert failed.outcome == "estimation job 77: the training script failed under gpu-estimate"


def test_the_comment_carries_what_the_node_saw_and_stays_short(tmp_path):
    (tmp_path / "result.json").write_text(json.dumps({"targets": [{"gpu": "a100-40gb", "peak_total_bytes": 3 << 30}],
                                                      "python": {"executable": "/p/" + "a" * 180}}))
    (tmp_path / "env_failed").write_text("4\n")
    (tmp_path / "stderr.txt").write_text("gpu-estimate: --python /opt/py: not a Python\n")
    ok = condense(tmp_path, 0, ["a100-40gb"])
    assert (ok["bytes"], ok["gpu"], ok["env_failed"]) == (3 << 30, "a100-40gb", 4)
    assert parse(render(ok))["bytes"] == 3 << 30 and len(render(ok)) <= MAX_CHARS
    usage = parse(render(condense(tmp_path, 2, ["a100-40gb"])))
    assert usage["python_error"] == "--python /opt/py: not a Python" and "bytes" not in usage
    assert parse("gpushare-estimate:" + "x" * 2000) is None and parse('gpushare-estimate:{"v":2,"exit":0}') is None


def test_a_submission_slurmctld_did_not_answer_leaves_the_job_held_for_the_next_round(tmp_path):
    """slurmctld restarting: the job is not released with the fallback (it would lose its estimate); a
    refusal from a controller that answered still releases it at once."""
    from gpushare.slurm.client import SlurmError

    record = 'gpushare:{"v":1,"decision":"estimating","old":"gres:gpu:1","new":"gres:shard:40"}'
    jobs = [{"job_id": 5, "name": "train", "job_state": "PENDING", "user_id": os.getuid(), "group_id": os.getgid(),
             "submit_time": 990, "admin_comment": record, "current_working_directory": str(tmp_path)}]
    for stderr, released in (("sbatch: error: Batch job submission failed: Unable to contact slurm controller "
                              "(connect failure)", False),
                             ("sbatch: error: Batch job submission failed: Invalid partition name specified", True)):
        svc = service(tmp_path, jobs)

        def refuse(*args: str, script: str | None = None, why: str = stderr) -> tuple[int, str]:
            raise SlurmError(f"sbatch: {why}")

        svc.client.sbatch = refuse  # type: ignore[attr-defined,method-assign]
        svc.tick()
        calls = svc.client.calls  # type: ignore[attr-defined]
        assert (("scontrol", "release", "5") in calls) is released, (stderr, calls)
