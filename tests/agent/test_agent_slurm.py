"""The agent, Prolog, TaskProlog and Epilog on a real local Slurm with simulated GPUs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpushare.epilog.records import RecordLedger
from gpushare.node.api import call
from gpushare.node.store import JobStore
from gpushare.slurm_plugins.decision import parse_record

pytestmark = pytest.mark.slurm
SIMJOB = Path(__file__).with_name("simjob.py")


def submit(cluster, out: Path, script: str, *args: str) -> int:
    os.chmod(out, 0o755)
    export = f"--export=ALL,GPUSHARE_TEST_OUT={out},GPUSHARE_CONFIG={cluster.gpushare_conf}"
    job_id, _ = cluster.client.sbatch("-D", str(out), "-o", str(out / "job-%j.out"), export, *args, script=script)
    return job_id


def job_env(out: Path, job_id: int) -> dict[str, str]:
    lines = (out / f"env.{job_id}").read_text().split()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def records(cluster) -> RecordLedger:
    return RecordLedger(cluster.agent_cfg().records_dir)


def script(mem: str, args: str) -> str:
    """A shared job (estimate by directive) that records its environment and runs a simulated process."""
    return (f"#!/bin/sh\n#GPUSHARE mem={mem}\n"
            "env | grep -E '^(CUDA_|GPUSHARE_|SLURM_JOB_GPUS)' | sort > \"$GPUSHARE_TEST_OUT/env.$SLURM_JOB_ID\"\n"
            f"'{sys.executable}' '{SIMJOB}' {args}\n")


def test_two_shared_jobs_on_one_gpu_get_their_caps(agent_cluster, tmp_path):
    cluster = agent_cluster()
    # same user (root): MPS for both, each capped at its own estimate + margin
    a = submit(cluster, tmp_path, script("4.5G", "--mem-mib 3000 --seconds 3"), "--gres=gpu:1")
    b = submit(cluster, tmp_path, script("10G", "--mem-mib 9000 --seconds 3"), "--gres=gpu:1")
    for job in (a, b):
        assert cluster.wait_job(job, 60).state == "COMPLETED"
    env_a, env_b = job_env(tmp_path, a), job_env(tmp_path, b)
    assert env_a["SLURM_JOB_GPUS"] == env_b["SLURM_JOB_GPUS"]  # Slurm's first fit packs them on one GPU
    gpu = env_a["SLURM_JOB_GPUS"]
    # 4.5 GiB + 1 GiB minimum margin, from the submit record (its 6 shards would have said 6144M)
    assert env_a["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=5632M"
    assert env_b["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=11264M"  # 10 GiB + 1 GiB
    for env in (env_a, env_b):
        assert env["CUDA_MPS_PIPE_DIRECTORY"].endswith(f"mps-{gpu}/pipe")
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100" and env["CUDA_VISIBLE_DEVICES"] == "0"
        assert env["GPUSHARE_CAPS_MODE"] == "mps"
    mps = cluster.backend().store.read()["mps"]
    assert gpu in mps  # the agent started that GPU's MPS control daemon (recorded by the sim backend)
    from gpushare.cli import main as gpushare_main

    assert gpushare_main(["status", "--config", str(cluster.gpushare_conf)]) == 0  # the real agent answers


def test_gimbal_thread_shares_reach_the_jobs_through_the_taskprolog(agent_cluster, tmp_path):
    cluster = agent_cluster(extra='thread_policy = "gimbal-makespan"')
    long = submit(cluster, tmp_path, script("4G", "--mem-mib 3000 --seconds 8"), "--gres=gpu:1", "--time=100")
    cluster.wait_for(lambda: (tmp_path / f"env.{long}").exists(), 60, "the long job never started")
    short = submit(cluster, tmp_path, script("4G", "--mem-mib 3000 --seconds 2"), "--gres=gpu:1", "--time=5")
    for job in (long, short):
        assert cluster.wait_job(job, 60).state == "COMPLETED"
    env_long, env_short = job_env(tmp_path, long), job_env(tmp_path, short)
    assert env_long["SLURM_JOB_GPUS"] == env_short["SLURM_JOB_GPUS"]  # packed on one GPU, both under MPS
    assert env_long["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"  # alone when it started
    # makespan: the job with less work left is squeezed (Gimbal's coordination, docs/agent.md)
    share = int(env_short["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"])
    assert share < 100 and share % 10 == 0


def test_job_beside_another_users_job_is_time_sliced_with_the_guard(agent_cluster, tmp_path):
    cluster = agent_cluster(withhold="none")  # the fake tenants below never start a process
    for gpu in (0, 1):  # another user's shared jobs, as their Prologs registered them
        facts = {"job": str(910000 + gpu), "uid": 4321, "user": "bob", "gpus": [gpu], "shared": True,
                 "est_gib": 2.0, "margin_gib": 1.0, "shards": 3}
        assert call(cluster.agent_socket, {"op": "register", "job": facts})["ok"]
    job = submit(cluster, tmp_path, script("4.5G", "--seconds 0.5"), "--gres=gpu:1")
    assert cluster.wait_job(job, 60).state == "COMPLETED"
    env = job_env(tmp_path, job)
    # need 5632 MiB (4.5 GiB + 1 GiB margin) less the A100's 612 MiB outside the allocator, over 40960 MiB
    assert env["GPUSHARE_CAPS_MODE"] == "fraction" and env["GPUSHARE_MEMORY_FRACTION"] == "0.122558"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in env and env["CUDA_VISIBLE_DEVICES"] == env["SLURM_JOB_GPUS"]


def test_records_have_plausible_ttfk_and_energy(agent_cluster, tmp_path):
    cluster = agent_cluster()
    job = submit(cluster, tmp_path, script("6G", "--mem-mib 5000 --smact 0.5 --delay 1.5 --seconds 2.5"),
                 "--gres=gpu:1")
    assert cluster.wait_job(job, 60).state == "COMPLETED"
    cluster.wait_for(lambda: bool(records(cluster).get(str(job))), 20, "no record")
    record = records(cluster).get(str(job))[0]
    gpu = job_env(tmp_path, job)["SLURM_JOB_GPUS"]
    assert 1.2 <= record["ttfk_s"] <= 6.0  # the 1.5 s "data loading" before the first kernel
    assert record["closed_by"] == "agent" and record["exit_code"] == 0
    energy = record["gpus"][gpu]
    # scenario power: 60 W idle, 400 W max; with SMACT 0.5 -> 230 W while the process runs (2.5 s)
    assert 60 * record["duration_s"] * 0.8 <= energy["energy_j"] <= 400 * record["duration_s"]
    assert 0.5 * 230 * 2.5 <= energy["share_j"] <= energy["energy_j"]
    assert energy["peak_bytes"] == 5000 * 2**20
    assert record["series"][gpu], "a timeline for the report's plots"
    comment = parse_record(cluster.client.require_job(job).admin_comment)
    assert comment["decision"] == "shared" and comment["run"]["ttfk_s"] == record["ttfk_s"]


def test_risky_gpu_withheld_then_released(agent_cluster, tmp_path):
    cluster = agent_cluster()
    cluster.wait_for(lambda: cluster.node_features() == ["gpushare_open"], 10, "node never opened")
    sim = cluster.backend()
    for gpu in (0, 1):  # a noisy tenant outside Slurm makes both GPUs risky (CARMA: SMACT≥.8, SMOCC≥.45)
        sim.start_process(gpu, 900000 + gpu, 2 << 30, smact=0.95, smocc=0.6, drama=0.5)
    cluster.wait_for(lambda: cluster.node_features() == [], 10, "risky node still open")
    job = submit(cluster, tmp_path, script("4G", "--seconds 0.5"), "--gres=gpu:1")
    time.sleep(3)
    pending = cluster.client.require_job(job)
    assert pending.state == "PENDING" and "gpushare_open" in pending.features
    for gpu in (0, 1):
        sim.end_process(900000 + gpu)
    assert cluster.wait_job(job, 60).state == "COMPLETED"  # calm again: the node reopened


def test_agent_restart_mid_job_loses_nothing(agent_cluster, tmp_path):
    cluster = agent_cluster()
    job = submit(cluster, tmp_path, script("4G", "--mem-mib 3000 --delay 0.5 --seconds 6"), "--gres=gpu:1")
    sock = cluster.agent_socket
    store = JobStore(Path(cluster.agent_cfg().state_dir) / "jobs")
    cluster.wait_for(lambda: (store.get(str(job)) or {}).get("kernel_at") is not None, 30, "kernel not flushed")
    cluster.stop_agent(signal.SIGKILL)  # no goodbye: whatever was flushed is all there is
    time.sleep(1)
    cluster.start_agent()
    status = call(sock, {"op": "status"})
    assert [j for j in status["jobs"] if j["job"] == str(job)][0]["ttfk_s"] is not None
    assert cluster.wait_job(job, 60).state == "COMPLETED"
    cluster.wait_for(lambda: bool(records(cluster).get(str(job))), 20, "no record")
    record = records(cluster).get(str(job))[0]
    gpu = job_env(tmp_path, job)["SLURM_JOB_GPUS"]
    assert record["ttfk_s"] is not None and record["gpus"][gpu]["peak_bytes"] == 3000 * 2**20
    assert record["gpus"][gpu]["energy_j"] > 0 and record["gpus"][gpu]["share_j"] > 0


def test_hundred_concurrent_epilogs_lose_no_record(agent_cluster):
    cluster = agent_cluster()
    ids = [str(700000 + i) for i in range(100)]
    for i, job in enumerate(ids):  # 100 jobs registered as their Prologs would, 50 per GPU
        facts = {"job": job, "uid": 0, "user": "root", "gpus": [i % 2], "shared": True, "est_gib": 0.2,
                 "margin_gib": 0.2, "shards": 1}
        assert call(cluster.agent_socket, {"op": "register", "job": facts})["ok"]
    wrapper = cluster.base / "bin" / "gpushare-epilog"  # exactly what slurmd runs
    procs = [subprocess.Popen([str(wrapper)], env={**cluster.env, "SLURM_JOB_ID": job, "SLURM_JOB_GPUS": str(i % 2),
                                                   "SLURM_JOB_UID": "0", "SLURM_JOB_USER": "root"})
             for i, job in enumerate(ids)]
    assert [p.wait(150) for p in procs] == [0] * 100
    ledger = records(cluster)
    assert sorted(r["job"] for r in ledger.all()) == ids
    assert sorted(h["job"] for h in ledger.history() if h["event"] == "record") == ids
    assert all(r["closed_by"] == "agent" and r["gpus"] for r in ledger.all())
    assert JobStore(Path(cluster.agent_cfg().state_dir) / "jobs").all() == []
    assert call(cluster.agent_socket, {"op": "status"})["jobs"] == []
    assert "gpushare-epilog exit" not in (cluster.base / "log" / "hooks.log").read_text()
