"""The Slurm adapter against real daemons of the release under test (GPUSHARE_TEST_SLURM).

What must hold on every release: the version is detected, single-job reads are structured, array tasks
and finished jobs are found, and text a user controls (job name, the 26.05 SubmitLine) never changes
what root-run code reads.
"""

from __future__ import annotations

import json

import pytest

from gpushare.policy.oom_recovery import JobFacts
from gpushare.slurm.gres_request import plain_gres
from gpushare.slurm.jobs import ENDED_STATES
from gpushare.slurm.version import SUPPORTED

FORGED = ('true WorkDir=/forged AdminComment=gpushare:{"decision":"shared","v":1} StdErr=/etc/shadow '
          'StdOut=/etc/shadow TresPerNode=gres:gpu:9 JobState=COMPLETED Restarts=9 UserId=root(0)')

pytestmark = [pytest.mark.slurm, pytest.mark.version_sensitive(
    "the adapter reads each release's own JSON shapes (squeue data parser v0.0.38, v0.0.42, v0.0.45)")]


def test_version_is_detected_and_supported(slurm_cluster) -> None:
    version = slurm_cluster.client.version
    assert version.release in SUPPORTED
    assert version.release == slurm_cluster.slurm_version


def test_forged_submit_line_and_name_change_nothing_root_code_reads(slurm_cluster, job_dir) -> None:
    """26.05 prints the user's SubmitLine= before WorkDir/AdminComment/StdErr/StdOut/TresPerNode in
    ``scontrol show job -o``: the structured read must give Slurm's own values on every release."""
    client = slurm_cluster.client
    job_id, _ = client.sbatch("--hold", "-D", str(job_dir), "--gres=gpu:1", "-o", str(job_dir / "o-%j.txt"),
                              f"--job-name=x {FORGED}", "--wrap", FORGED)
    job = client.require_job(job_id)
    assert job.work_dir == str(job_dir)
    assert job.std_out == str(job_dir / "o-%j.txt") or job.std_out == str(job_dir / f"o-{job_id}.txt")
    assert job.std_err in ("", job.std_out)
    assert plain_gres(job.tres_per_node) == "gpu:1"
    assert job.state == "PENDING" and job.restarts == 0 and job.user_id == 0
    record = json.loads(job.admin_comment.removeprefix("gpushare:"))
    assert record["decision"] == "exclusive"  # the hook's own record, not the forged one
    facts = JobFacts.from_job(job, {})
    assert "/etc/shadow" not in facts.log_paths
    assert facts.log_paths == (str(job_dir / f"o-{job_id}.txt"),)
    client.run("scancel", str(job_id))


def test_finished_jobs_and_array_tasks_are_found(slurm_cluster, job_dir) -> None:
    client = slurm_cluster.client
    job_id, _ = client.sbatch("-D", str(job_dir), "-o", "/dev/null", "--wrap", "exit 3")
    array_id, _ = client.sbatch("-D", str(job_dir), "-o", "/dev/null", "--array=1-2", "--wrap", "true")
    done = slurm_cluster.wait_job(job_id)
    assert done.state == "FAILED" and done.exit_status == 3 and done.exit_signal == 0
    assert done.state in ENDED_STATES and not done.completing
    task = slurm_cluster.wait_job(f"{array_id}_2")
    assert (task.array_job_id, task.array_task_id, task.state) == (array_id, 2, "COMPLETED")
    assert task.array_name == f"{array_id}_2"
    listed = {j.job_id for j in client.jobs()}
    assert str(job_id) in listed  # finished jobs are listed on every release
    assert client.job("4000000000") is None  # never existed
