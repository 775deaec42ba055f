"""The estimation driver's Slurm-facing pieces, against a recording fake client (no cluster needed)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from gpushare.config import parse_config
from gpushare.slurm_plugins.estimation_plan import HeldJob
from gpushare.slurm_plugins.estimationd import EstimationService
from gpushare.slurm_plugins.script_discovery import TrainingCommand
from gpushare.slurm.jobs import Job, job_from_json


class FakeClient:
    """Records sbatch/scontrol calls; answers squeue with the jobs given."""

    def __init__(self, jobs: list[dict] | None = None) -> None:
        self.listing = jobs or []
        self.calls: list[tuple] = []

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


def service(tmp_path: Path, jobs: list[dict] | None = None, now: float = 1000.0) -> EstimationService:
    cfg = parse_config({"estimation": {"partition": "cpu", "spool_dir": str(tmp_path / "spool"),
                                       "command": "/opt/est/gpu-estimate", "memory": "2G"},
                        "nodes": [{"names": "n1", "gpu": "a100-40gb"}]})
    return EstimationService(cfg, FakeClient(jobs), clock=lambda: now)  # type: ignore[arg-type]


def test_submit_runs_as_the_user_with_limits_and_a_private_result_directory(tmp_path):
    svc = service(tmp_path)
    job = HeldJob(5, os.getuid(), os.getgid(), 990.0, {"decision": "estimating"}, "/home/ana/run", "k",
                  TrainingCommand("train.py", ("--bs", "4 8"), "python", 2))
    assert svc.submit(job) == 77
    call = svc.client.calls[-1]  # type: ignore[attr-defined]
    args, script = call[1:-1], call[-1]
    assert f"--uid={os.getuid()}" in args and "--partition=cpu" in args and "--export=NONE" in args
    assert "--job-name=gpushare-estimate-5" in args and "--mem=2048M" in args and "--chdir=/home/ana/run" in args
    directory = (tmp_path / "spool" / "5-990").resolve()
    assert directory.is_dir() and oct(directory.stat().st_mode & 0o777) == "0o700"
    assert "/opt/est/gpu-estimate --json --no-progress" in script
    assert "--gpu a100-40gb" in script and "train.py --bs '4 8'" in script
    assert f"> {directory}/result.json" in script and f"echo $rc > {directory}/exit" in script


def test_tick_discovers_holds_and_attaches(tmp_path):
    record = 'gpushare:{"v":1,"decision":"estimating","old":"gres:gpu:1","new":"gres:shard:40"}'
    jobs = [{"job_id": 5, "name": "train", "job_state": "PENDING", "user_id": os.getuid(), "group_id": os.getgid(),
             "submit_time": 990, "admin_comment": record, "current_working_directory": str(tmp_path)}]
    svc = service(tmp_path, jobs)
    svc.tick()
    calls = svc.client.calls  # type: ignore[attr-defined]
    assert calls[0][:3] == ("scontrol", "write", "batch_script")
    assert calls[1][0] == "sbatch"
    update = calls[2]
    assert update[:2] == ("update", 5) and json.loads(update[2]["admincomment"][9:])["est_job"] == 77


def test_results_are_read_only_from_the_spool_and_only_when_owned(tmp_path):
    svc = service(tmp_path)
    spool = (tmp_path / "spool").resolve()
    directory = spool / "5-990"
    directory.mkdir(parents=True)
    (directory / "result.json").write_text(json.dumps({"targets": [{"gpu": "a100-40gb",
                                                                    "peak_total_bytes": 3 << 30}]}))
    est = svc._estimation(job_from_json({"job_id": 77, "user_id": os.getuid(), "job_state": "COMPLETED",
                           "standard_output": str(directory / "slurm.out")}), 5)
    assert est.ours and est.outcome.total_bytes == 3 << 30
    other = svc._estimation(job_from_json({"job_id": 78, "user_id": os.getuid() + 1, "job_state": "COMPLETED",
                             "standard_output": str(directory / "slurm.out")}), 5)
    assert "no usable result" in other.outcome and "that you own" in other.outcome
    outside = svc._estimation(job_from_json({"job_id": 79, "user_id": os.getuid(), "job_state": "COMPLETED",
                               "standard_output": str(tmp_path / "elsewhere" / "x" / "slurm.out")}), 5)
    assert not outside.ours and outside.outcome is None
    (directory / "exit").write_text("3\n")
    failed = svc._estimation(job_from_json({"job_id": 77, "user_id": os.getuid(), "job_state": "FAILED",
                              "standard_output": str(directory / "slurm.out")}), 5)
    assert failed.outcome == "estimation job 77: the training script failed under gpu-estimate"


def test_old_result_directories_are_pruned_by_roots_record_not_the_users_mtime(tmp_path):
    """The directory is the user's: a future mtime once kept it forever. Its name is root's record."""
    now = time.time()
    spool = tmp_path / "spool"
    old, new = spool / f"5-{int(now - 3 * 3600 * 2)}", spool / f"6-{int(now - 60)}"
    old.mkdir(parents=True)
    new.mkdir()
    future = now + 10 * 365 * 86400
    os.utime(old, (future, future))  # what a user can do to their own directory
    svc = service(tmp_path, now=now)
    svc.prune_spool()
    assert sorted(p.name for p in spool.iterdir()) == [new.name]


def test_a_users_spool_is_bounded_oldest_first(tmp_path):
    now = time.time()
    spool = tmp_path / "spool"
    names = [f"{job}-{int(now - 600 + job)}" for job in (1, 2, 3)]
    for name in names:
        (spool / name).mkdir(parents=True)
        (spool / name / "fill").write_bytes(b"x" * (3 << 20))  # 3 MiB each, 9 MiB in all
    svc = service(tmp_path, now=now)
    svc.cfg.estimation.spool_max_mib_per_user = 7
    svc.prune_spool()
    assert sorted(p.name for p in spool.iterdir()) == names[1:]  # the oldest went
