"""Lanes end to end on a real local Slurm: two ``#GPUSHARE lanes`` jobs training a tiny model on the CPU
land on one simulated GPU, share a lane and take turns through the agent's lanes socket; both complete."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from lane_log import completed_turns

from gpushare.gpus import GiB
from gpushare.slurm.record import parse as parse_record

pytestmark = [pytest.mark.slurm, pytest.mark.torch]  # the lane processes run torch
WORKER = Path(__file__).with_name("lane_worker.py")


@pytest.fixture
def out_dir():
    """Job output directory every user can write (pytest's own base directory is root-only)."""
    path = Path(tempfile.mkdtemp(prefix="gpushare-lanes-"))
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def submit(cluster, out: Path, text: str, *args: str) -> int:
    export = f"--export=ALL,GPUSHARE_TEST_OUT={out},GPUSHARE_CONFIG={cluster.gpushare_conf}"
    job_id, _ = cluster.client.sbatch("-D", str(out), "-o", str(out / "job-%j.out"), export, *args, script=text)
    return job_id


def job_env(out: Path, job_id: int) -> dict[str, str]:
    lines = (out / f"env.{job_id}").read_text().split("\n")
    return dict(line.split("=", 1) for line in lines if "=" in line)


def turns(out: Path, jobs: list[int]) -> list[tuple[float, float, int]]:
    """(start, end, job) of every completed turn (lane_worker.py's log), in time order."""
    return completed_turns({job: (out / f"{job}.log").read_text().splitlines() for job in jobs})


def started(out: Path, job: int) -> bool:
    """lane_worker.py is running for ``job`` (it logs its pid before it waits for the go file)."""
    log = out / f"{job}.log"
    return log.exists() and log.read_text().startswith("pid ")


def test_two_lane_jobs_take_turns_and_complete(agent_cluster, out_dir):
    pytest.importorskip("torch")
    cluster = agent_cluster(withhold="none", extra='collocation = "fraction"\nlane_turn_limit_s = 30.0')
    estimate = out_dir / "est.json"
    estimate.write_text(json.dumps({"targets": [{"gpu": "a100-40gb", "peak_total_bytes": 3 * GiB,
                                                 "persistent_bytes": 1 * GiB, "ephemeral_bytes": 2 * GiB}]}))
    go = out_dir / "go"
    text = ("#!/bin/sh\n#GPUSHARE lanes\n#GPUSHARE estimate=est.json\n"
            "env | grep -E '^(GPUSHARE_|SLURM_JOB_GPUS|PYTHONPATH)' | sort > \"$GPUSHARE_TEST_OUT/env.$SLURM_JOB_ID\"\n"
            f"exec '{sys.executable}' '{WORKER}' \"$GPUSHARE_TEST_OUT/$SLURM_JOB_ID.log\" 30 0.1 '{go}'\n")
    jobs = [submit(cluster, out_dir, text, "--gres=gpu:1") for _ in range(2)]
    # both running (torch imported) before either takes a turn: on a loaded machine the second one's start
    # took longer than most of the first one's 30 iterations, and they had too little time side by side
    cluster.wait_for(lambda: all(started(out_dir, job) for job in jobs), 90, "both lane jobs to start",
                     seen=lambda: cluster.client.require_job(jobs[-1]).states)
    go.touch()
    for job in jobs:
        log = out_dir / f"job-{job}.out"
        assert cluster.wait_job(job, 90).state == "COMPLETED", log.read_text() if log.exists() else "no log"
    record = parse_record(cluster.client.require_job(jobs[0]).admin_comment) or {}
    assert record.get("decision") == "shared" and record.get("lanes") == {"p_gib": 1.0, "e_gib": 2.0}
    envs = [job_env(out_dir, job) for job in jobs]
    assert envs[0]["SLURM_JOB_GPUS"] == envs[1]["SLURM_JOB_GPUS"]  # one GPU, one lane
    for env in envs:
        assert env["GPUSHARE_LANES"] == "1" and env["PYTHONPATH"].endswith("lane_site")
    for job in jobs:
        errors = (out_dir / f"job-{job}.out").read_text()
        assert "gpushare lanes" not in errors, errors  # lanes stayed on
    order = turns(out_dir, jobs)
    assert len(order) == 60
    for (_, end, _), (start, _, _) in zip(order, order[1:]):
        assert end <= start, "the two jobs ran iterations at the same time"
    seq = [job for _, _, job in order]
    switches = sum(1 for a, b in zip(seq, seq[1:]) if a != b)
    assert switches >= 10, seq  # they alternated while both ran
