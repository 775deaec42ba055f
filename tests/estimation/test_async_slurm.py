"""Asynchronous estimation on a real local Slurm: held, estimated as the user on the CPU partition, released."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from gpushare.slurm_plugins.decision import parse_record
from gpushare.slurm_plugins.estimation_plan import ESTIMATION_JOB_PREFIX
from gpushare.slurm.gres_request import plain_gres
from gpushare.slurm.jobs import Job
from devcluster.local_cluster import LOGIN_TEST_USER, LocalCluster
from devcluster.processes import scaled

TEST_USER = LOGIN_TEST_USER  # created by conftest (ensure_login_user)

pytestmark = pytest.mark.slurm

TINY_TRAIN = """import argparse
import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=16)
args = parser.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)
opt = torch.optim.Adam(model.parameters())
for step in range(3):
    loss = model(torch.randn(args.batch_size, 256, device=device)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
SHARDS_PROBE = "env | grep -E '^SLURM_SHARDS_ON_NODE=' || true\n"
# Launchers the test user does not have: the job itself only has to start and exit 0.
STUBS = "torchrun() { true; }\naccelerate() { true; }\npython() { true; }\n"


def write(work: Path, name: str, text: str, user: Any) -> Path:
    path = work / name
    path.write_text(text)
    os.chown(path, user.pw_uid, user.pw_gid)
    return path


def submit_as_user(cluster: LocalCluster, work: Path, body: str, *args: str) -> tuple[int, str]:
    proc = subprocess.run(cluster.user_argv(TEST_USER, ["sbatch", "--parsable", "--gres=gpu:1", "-D", str(work),
                                                      "-o", str(work / "job-%j.out"), *args]),
                          input="#!/bin/sh\n" + body,
                          capture_output=True, text=True, env=cluster.env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip().split(";")[0]), proc.stderr


def job(cluster: LocalCluster, job_id: int) -> Job:
    found = cluster.client.job(job_id)
    assert found is not None, f"job {job_id} gone"
    return found


def wait_released(cluster: LocalCluster, job_id: int, timeout_s: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = parse_record(job(cluster, job_id).admin_comment) or {}
        if record.get("decision") != "estimating":
            return record
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} still held after {timeout_s} s: {job(cluster, job_id)}")


def estimation_jobs(cluster: LocalCluster) -> list[Job]:
    return [j for j in cluster.client.jobs() if j.name.startswith(ESTIMATION_JOB_PREFIX)]


def wait_estimation_running(cluster: LocalCluster, job_id: int, running: bool, timeout_s: float, what: str) -> None:
    """Wait until the estimation job of ``job_id`` runs (``running``) or no longer runs; fail with ``what``."""
    deadline = time.monotonic() + timeout_s
    while any(j.name == f"{ESTIMATION_JOB_PREFIX}{job_id}" and j.state == "RUNNING"
              for j in estimation_jobs(cluster)) != running:
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


def watchdog_config(original: str, estimation_toml: str) -> str:
    """The test configuration with a 30 s estimation limit and a 35 s watchdog."""
    tight = original.replace(estimation_toml, estimation_toml.replace("time_limit_s = 120", "time_limit_s = 30")
                             + "watchdog_s = 35\n")
    assert tight != original
    return tight


def test_job_held_estimated_as_user_rewritten_released_and_run(est_cluster, work, user):
    write(work, "train.py", "# FAKE_PEAK_GIB=3\n", user)
    job_id, stderr = submit_as_user(est_cluster, work, "#SBATCH -J fake-train\npython3 -u train.py --epochs 1\n"
                                    + SHARDS_PROBE)
    assert "job held while gpu-estimate train.py --epochs 1" in stderr
    held = job(est_cluster, job_id)
    record = parse_record(held.admin_comment)
    if record["decision"] == "estimating":  # usually still held here; the estimate may already have landed
        assert held.state == "PENDING" and plain_gres(held.tres_per_node) == "shard:40"
        assert held.reason.startswith("JobHeld")
    final = wait_released(est_cluster, job_id)
    assert final["decision"] == "shared" and final["src"] == "async" and plain_gres(final["new"]) == "shard:4"
    assert plain_gres(final["old"]) == "gpu:1" and final["held_s"] >= 0 and "train.py --epochs 1" in final["script"]
    est = [j for j in estimation_jobs(est_cluster) if int(j.job_id) == final["est_job"]][0]
    assert est.name == f"{ESTIMATION_JOB_PREFIX}{job_id}" and est.partition == "cpu"
    assert est.user_id == user.pw_uid != 0
    assert est.std_out == "/dev/null"  # no guessable file in a shared /tmp: the result came in its Comment
    assert parse_record(est.admin_comment)["est_for"] == f"{job_id}-{int(held.submit_time)}"  # root's mark
    done = est_cluster.wait_job(job_id)
    assert done.state == "COMPLETED" and plain_gres(done.tres_per_node) == "shard:4"
    assert "SLURM_SHARDS_ON_NODE=4" in (work / f"job-{job_id}.out").read_text()


def test_real_gpu_estimate_runs_as_user(est_cluster, work, user, helpers):
    problem = helpers.user_can_run_estimator(est_cluster)
    if problem:
        pytest.skip(problem)
    write(work, "tiny_train.py", TINY_TRAIN, user)
    job_id, _ = submit_as_user(est_cluster, work, "srun() { true; }\nsrun python tiny_train.py --batch-size 32\n")
    final = wait_released(est_cluster, job_id, timeout_s=150)
    assert final["decision"] == "shared" and final["src"] == "async", final
    assert plain_gres(final["new"]) in ("shard:2", "shard:3") and 0 < final["est_gib"] < 2
    assert est_cluster.wait_job(job_id).state == "COMPLETED"


def test_failed_estimation_releases_with_fallback(est_cluster, work, user):
    write(work, "train.py", "# FAKE_FAIL\n", user)
    job_id, _ = submit_as_user(est_cluster, work, STUBS + "torchrun --standalone --nproc_per_node=1 train.py\n")
    final = wait_released(est_cluster, job_id)
    assert final["decision"] == "exclusive" and plain_gres(final["new"]) == "shard:40"
    assert "the training script failed" in final["why"]
    done = est_cluster.wait_job(job_id)
    assert done.state == "COMPLETED" and plain_gres(done.tres_per_node) == "shard:40"


def test_cancelled_estimation_releases_the_job(est_cluster, work, user):
    write(work, "train.py", "# FAKE_SLEEP\n", user)
    job_id, _ = submit_as_user(est_cluster, work, STUBS + "accelerate launch --num_processes 1 train.py --lr 3e-4\n")
    wait_estimation_running(est_cluster, job_id, True, 60, "estimation job never ran")
    est_cluster.client.run("scancel", "--name", f"{ESTIMATION_JOB_PREFIX}{job_id}")
    final = wait_released(est_cluster, job_id, timeout_s=30)
    assert final["decision"] == "exclusive" and "cancelled" in final["why"]
    assert est_cluster.wait_job(job_id).state == "COMPLETED"


def test_user_may_release_by_hand_and_the_record_says_so(est_cluster, work, user):
    write(work, "train.py", "# FAKE_SLEEP\n", user)
    job_id, _ = submit_as_user(est_cluster, work, STUBS + "python train.py\nsleep 4\n")
    subprocess.run(est_cluster.user_argv(TEST_USER, ["scontrol", "release", str(job_id)]), env=est_cluster.env,
                   check=True)
    final = wait_released(est_cluster, job_id, timeout_s=30)
    assert final["decision"] == "exclusive" and "released by its user" in final["why"]
    assert plain_gres(est_cluster.wait_job(job_id).tres_per_node) == "shard:40"
    deadline = time.monotonic() + scaled(20)
    while any(j.name == f"{ESTIMATION_JOB_PREFIX}{job_id}" and j.state in ("PENDING", "RUNNING")
              for j in estimation_jobs(est_cluster)):
        assert time.monotonic() < deadline, "orphaned estimation job not cancelled"
        time.sleep(0.3)


def test_no_training_script_found_is_reported_not_held(est_cluster, work, user):
    job_id, stderr = submit_as_user(est_cluster, work, "./run_experiment.sh\n")
    assert "#GPUSHARE script=" in stderr
    record = parse_record(job(est_cluster, job_id).admin_comment)
    assert record["decision"] == "exclusive" and "no 'python train.py'" in record["why"]
    assert plain_gres(est_cluster.wait_job(job_id).tres_per_node) == "gpu:1"


def test_fifty_jobs_at_once_all_released_within_caps(est_cluster, work, user):
    for variant in range(10):
        write(work, f"train{variant}.py", f"# FAKE_PEAK_GIB={2 + variant % 3}\n", user)
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda i: submit_as_user(est_cluster, work, STUBS + f"python train{i % 10}.py\n",
                                                     f"--job-name=burst{i}")[0], range(50)))
    most = 0
    deadline = time.monotonic() + scaled(150)
    pending = set(ids)
    while pending:
        assert time.monotonic() < deadline, f"still held: {sorted(pending)}"
        jobs = {int(j.job_id): j for j in est_cluster.client.jobs()}
        active = [j for j in jobs.values() if j.name.startswith(ESTIMATION_JOB_PREFIX)
                  and (j.pending or j.active)]
        most = max(most, len(active))
        pending = {i for i in pending
                   if (parse_record(jobs[i].admin_comment) or {}).get("decision") == "estimating"}
        time.sleep(0.5)
    assert most <= 3  # [estimation] max_per_user = 3 (max_total = 4)
    records = [parse_record(est_cluster.client.require_job(i).admin_comment) for i in ids]
    assert all(r["decision"] == "shared" and r["src"] == "async" for r in records)
    assert len({r["est_job"] for r in records}) == 10  # one estimation per distinct script
    for i, record in zip(range(50), records):
        assert plain_gres(record["new"]) == f"shard:{3 + (i % 10) % 3}"
    listing = subprocess.run([os.path.join(os.path.dirname(sys.executable), "gpushare"), "estimates", "--json",
                              "--user", TEST_USER], env=est_cluster.env, capture_output=True, text=True, check=True)
    rows = {row["job"]: row for row in json.loads(listing.stdout)}
    assert all(rows[i]["phase"] == "released" and plain_gres(rows[i]["result"]).startswith("shard:") for i in ids)


def test_annotate_estimates_then_submits_with_the_estimate_attached(est_cluster, tmp_path):
    estimator = os.path.join(os.path.dirname(sys.executable), "gpu-estimate")
    if "--annotate" not in subprocess.run([estimator, "--help"], capture_output=True, text=True).stdout:
        pytest.skip("this gpu-estimate has no --annotate option")
    (tmp_path / "tiny_train.py").write_text(TINY_TRAIN)
    (tmp_path / "train.sbatch").write_text("#!/bin/sh\n#SBATCH -J annotated\n#SBATCH --gres=gpu:1\n"
                                           "true python tiny_train.py --batch-size 32\n" + SHARDS_PROBE)
    env = dict(est_cluster.env, XDG_CACHE_HOME=str(tmp_path / "cache"))
    argv = [estimator, "--annotate", "--gpu", "a100-40gb", "tiny_train.py", "--batch-size", "32", "--",
            "-o", str(tmp_path / "job-%j.out"), "train.sbatch"]
    runs = []
    for _ in range(2):  # the second run hits gpu-estimate's cache
        started = time.monotonic()
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        runs.append(time.monotonic() - started)
        assert proc.returncode == 0, proc.stderr
        job_id = int(proc.stdout.split()[-1])
        assert "shard:2" in proc.stderr  # the hook's one-line message, through sbatch
        done = est_cluster.wait_job(job_id)
        record = parse_record(done.admin_comment)
        assert record["src"] == "directive:est" and plain_gres(done.tres_per_node) == "shard:2"  # in the script itself
        assert done.name == "annotated" and done.state == "COMPLETED"
    assert "(cached)" in proc.stderr and runs[1] < runs[0]
    assert (tmp_path / ".gpushare" / "train.sbatch.estimate.json").is_file()


def test_watchdog_releases_a_job_held_too_long(est_cluster, work, user, helpers):
    """Last in the module: it tightens the limits through a configuration reload (SIGHUP)."""
    conf = est_cluster.gpushare_conf
    original = conf.read_text()
    spool, fake = Path(est_cluster.config().estimation.spool_dir), Path(est_cluster.config().estimation.command)
    toml = helpers.estimation_toml(spool, fake)
    conf.write_text(watchdog_config(original, toml))
    os.kill(est_cluster.pids["submitd"], signal.SIGHUP)
    try:
        write(work, "train.py", "# FAKE_SLEEP\n", user)
        job_id, _ = submit_as_user(est_cluster, work, STUBS + "python train.py\n")
        final = wait_released(est_cluster, job_id, timeout_s=70)
        assert final["decision"] == "exclusive" and final["why"].startswith("estimation: watchdog: held")
        assert final["held_s"] >= 35
        wait_estimation_running(est_cluster, job_id, False, 20, "estimation job not cancelled")
    finally:
        conf.write_text(original)
        os.kill(est_cluster.pids["submitd"], signal.SIGHUP)


def test_release_overdue_frees_held_jobs_while_the_service_is_down(est_cluster, work, user, helpers):
    """The watchdog lives in gpushare-submitd; with the service down, the timer's `gpushare estimates
    --release-overdue` releases what it would have (and cancels the estimation job). Restarts the service."""
    conf = est_cluster.gpushare_conf
    original = conf.read_text()
    spool, fake = Path(est_cluster.config().estimation.spool_dir), Path(est_cluster.config().estimation.command)
    toml = helpers.estimation_toml(spool, fake)
    write(work, "train.py", "# FAKE_SLEEP\n", user)
    job_id, _ = submit_as_user(est_cluster, work, STUBS + "python train.py\n")
    wait_estimation_running(est_cluster, job_id, True, 30, "estimation job did not start")
    est_cluster.stop_process("submitd")  # its estimation process (and watchdog) goes with it
    submitted = job(est_cluster, job_id).submit_time
    conf.write_text(watchdog_config(original, toml))
    try:
        gpushare = os.path.join(os.path.dirname(sys.executable), "gpushare")
        argv = [gpushare, "estimates", "--release-overdue", "--config", str(conf)]
        early = subprocess.run(argv, env=est_cluster.env, capture_output=True, text=True, timeout=60)
        assert early.returncode == 0 and "released 0 overdue" in early.stdout, early
        assert parse_record(job(est_cluster, job_id).admin_comment)["decision"] == "estimating"
        time.sleep(max(0.0, submitted + 36 - time.time()))
        late = subprocess.run(argv, env=est_cluster.env, capture_output=True, text=True, timeout=60)
        assert late.returncode == 0 and f"released 1 overdue job(s): {job_id}" in late.stdout, late
        final = parse_record(job(est_cluster, job_id).admin_comment)
        assert final["decision"] == "exclusive" and final["why"].startswith("estimation: watchdog: held")
        assert est_cluster.wait_job(job_id, timeout_s=60).state == "COMPLETED"
        wait_estimation_running(est_cluster, job_id, False, 20, "estimation job not cancelled")
    finally:
        conf.write_text(original)
        est_cluster.start_submitd()
