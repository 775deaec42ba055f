"""Helpers shared by the real-Slurm OOM tests (test_oom_slurm*.py): the job, the [oom] settings a test
cluster needs, and waiting for a job that may be requeued."""

from __future__ import annotations

import time
from pathlib import Path

from gpushare.epilog.ledger import Ledger
from devcluster.local_cluster import LocalCluster
from gpushare.slurm.jobs import Job

JOB = """#!/bin/bash
{python} - <<'EOF'
import os, torch
need_gib = {need}
# GiB this run may use: its shards, or the whole 40 GiB GPU when it got one (gpu:1, no shards)
have = int(os.environ.get("SLURM_SHARDS_ON_NODE") or (40 if os.environ.get("SLURM_JOB_GPUS") else 0))
print(f"restart={{os.environ.get('SLURM_RESTART_COUNT', '0')}} shards={{have}}", flush=True)
if {fail_other}:
    raise ValueError("labels and logits have different shapes")
if need_gib > have:  # the caching allocator's message (c10/cuda/CUDACachingAllocator.cpp)
    raise torch.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {{need_gib - have:.2f}} GiB. GPU 0 has a total capacity of "
        f"40.00 GiB of which {{have:.2f}} GiB is free. Of the allocated memory 0.50 GiB is allocated by "
        "PyTorch, and 0.10 GiB is reserved by PyTorch but unallocated.")
print("training finished", flush=True)
EOF
"""


def exclusive_gres(cluster: LocalCluster) -> str:
    """What OOM recovery asks for on this release: gpu:1 where a held job may change shard → gpu (24.11+),
    all 40 shards of the A100-40GB on 22.05."""
    return "gpu:1" if cluster.client.version.held_gres_across_names else "shard:40"


def oom_settings(directory: Path) -> str:
    """The ``[oom]`` table for a test cluster: its ledger and log in ``directory`` (another cluster's job
    ids must never meet this one's in a shared ledger). slurm.conf is found beside the cluster's
    gpushare.toml. Empty when the cluster's generated config already has an ``[oom]`` table."""
    if "[oom]" in LocalCluster(base=directory)._toml_text():
        return ""
    return f'[oom]\nledger_dir = "{directory}/oom-ledger"\nlog_file = "{directory}/oom.log"\n'


def trust_log_messages(cluster: LocalCluster) -> LocalCluster:
    """``[oom] corroborate = "no"`` in the running cluster's gpushare.toml (the hook reads it per run).

    These tests drive the requeue mechanics with jobs that print a real OOM and no node agent measuring
    them; corroboration itself is tested in test_hostile_oom.py and the hostile tier."""
    text = cluster.gpushare_conf.read_text()
    if 'corroborate = "no"' not in text:
        cluster.gpushare_conf.write_text(text.replace("\n[oom]\n", '\n[oom]\ncorroborate = "no"\n', 1))
    return cluster


def ledger_of(cluster: LocalCluster) -> Ledger:
    return Ledger(cluster.config().oom.ledger_dir)


def wait_final(cluster: LocalCluster, job_id: int, restarts: int, timeout_s: float = 90) -> Job:
    """Until the job has run ``restarts`` times more and is in a final state again."""
    deadline = time.monotonic() + timeout_s
    job: Job | None = None
    while time.monotonic() < deadline:
        job = cluster.client.require_job(job_id)
        if job.state in ("COMPLETED", "FAILED") and not job.completing and job.restarts >= restarts:
            time.sleep(0.5)  # let a pending EpilogSlurmctld decide (it would requeue from FAILED)
            again = cluster.client.require_job(job_id)
            if (again.states, again.restarts) == (job.states, job.restarts):
                return again
        time.sleep(0.25)
    raise AssertionError(f"job {job_id}: {job.states if job else None} restarts {job.restarts if job else None}; "
                         f"log: {oom_log(cluster)}")


def oom_log(cluster: LocalCluster) -> str:
    path = Path(cluster.config().oom.log_file or cluster.base / "log" / "oom.log")
    return path.read_text()[-3000:] if path.exists() else "(no oom.log)"
