"""Where a job lands on a real Slurm when sharing follows the queue and heavy jobs are sized by compute:
sbatch → job_submit.lua → gpushare-submitd with ``[policy] share_when = "queued"`` and ``compute_sizing``.

One cluster for the module (one node, two 40 GiB GPUs)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster.local_cluster import LocalCluster, missing_requirements
from devcluster.processes import scaled
from gpushare.slurm.gres_request import plain_gres
from gpushare.slurm_plugins.decision import parse_record
from gpushare.slurm_plugins.queue_view import QueueView

pytestmark = pytest.mark.slurm

PROBE = "env | grep -E '^(CUDA_VISIBLE_DEVICES|SLURM_SHARDS_ON_NODE)=' | sort\n"
# max_jobs_per_gpu at its shipped value (the test clusters otherwise turn the bound off): a shared job asks for
# at least a quarter of a 40 GiB GPU's 40 shards, whatever its memory
POLICY = '[policy]\nshare_when = "queued"\nqueue_view_s = 30\ncompute_sizing = true\nmax_jobs_per_gpu = 4\n'


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    problem = missing_requirements()
    if problem:
        pytest.skip(f"real Slurm unavailable: {problem}")
    base = Path(tempfile.mkdtemp(prefix="gpushare-slurm-", dir="/tmp"))
    made = LocalCluster(base, bin_dir=os.path.dirname(sys.executable), toml_extra=POLICY)
    failed_before = request.session.testsfailed
    try:
        made.start()
        log = base / "log" / "submitd.log"
        deadline = time.monotonic() + scaled(30)
        while "queue view taken" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, "gpushare-submitd took no view of the queue"
            time.sleep(0.2)
        yield made
    finally:
        made.stop()
        if request.session.testsfailed == failed_before:
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    os.chmod(tmp_path, 0o755)
    return tmp_path


def submit(cluster: LocalCluster, job_dir: Path, body: str) -> int:
    job_id, _ = cluster.client.sbatch("--gres=gpu:1", "-D", str(job_dir), "-o", str(job_dir / "job-%j.out"),
                                      script="#!/bin/bash\n" + body)
    return job_id


def env(job_dir: Path, job_id: int) -> dict[str, str]:
    words = (job_dir / f"job-{job_id}.out").read_text().split()
    return dict(word.split("=", 1) for word in words if "=" in word)


def test_jobs_keep_whole_gpus_while_idle_ones_are_left_then_share(cluster, job_dir):
    started = time.monotonic()
    body = "#GPUSHARE mem=4G\n" + PROBE + "sleep 2\n"
    first, second, third = (submit(cluster, job_dir, body) for _ in range(3))
    records = {job: parse_record(cluster.client.require_job(job).admin_comment) for job in (first, second, third)}
    # two idle GPUs, nothing pending: the first two keep gpu:1 (the second counts the first's claim)
    assert [records[j]["decision"] for j in (first, second, third)] == ["idle-gpus", "idle-gpus", "shared"]
    assert "2 idle GPUs" in records[first]["why"] and "2 pending" in records[third]["queue"]
    # the view read back from this Slurm: no idle GPU, the third pending (once the first two run)
    view = QueueView(cluster.client.run, 30.0)
    assert view.refresh()
    deadline = time.monotonic() + scaled(30)
    while cluster.client.require_job(second).state != "RUNNING":
        assert time.monotonic() < deadline
        time.sleep(0.2)
        view.refresh()
    assert view.refresh() and view.pressure("gpu")[0].idle_gpus == 0  # type: ignore[union-attr]
    done = [cluster.wait_job(job, timeout_s=60) for job in (first, second, third)]
    assert all(r.state == "COMPLETED" for r in done)
    assert [plain_gres(r.tres_per_node) for r in done] == ["gpu:1", "gpu:1", "shard:10"]
    whole = [env(job_dir, job) for job in (first, second)]
    assert sorted(e["CUDA_VISIBLE_DEVICES"] for e in whole) == ["0", "1"]  # a GPU each
    assert all("SLURM_SHARDS_ON_NODE" not in e for e in whole)
    assert env(job_dir, third)["SLURM_SHARDS_ON_NODE"] == "10"  # shared (5 by memory, 10 by the bound)
    print(f"queue gate on Slurm {cluster.slurm_release}: {time.monotonic() - started:.1f} s")


def test_two_heavy_jobs_never_pair_on_one_gpu(cluster, job_dir):
    # mode=shared: the scripts ask to share whatever the queue, so the gate lets them through
    heavy = "#GPUSHARE mem=4G compute=heavy mode=shared\n" + PROBE + "sleep 3\n"
    jobs = [submit(cluster, job_dir, heavy) for _ in range(2)]
    done = [cluster.wait_job(job, timeout_s=60) for job in jobs]
    assert [plain_gres(r.tres_per_node) for r in done] == ["shard:21", "shard:21"]  # over half of 40
    assert "compute heavy" in parse_record(done[0].admin_comment)["why"]
    # 22.05 first-fit would stack two 5-shard jobs on GPU 0; 21 + 21 > 40 sends the second to GPU 1
    assert sorted(env(job_dir, job)["CUDA_VISIBLE_DEVICES"] for job in jobs) == ["0", "1"]
