"""OOM recovery on a real local Slurm 22.05 (slurmctld + slurmd + munge, simulated GPUs).

The jobs run real Python with PyTorch: a job that needs more GPU memory than its shards raises PyTorch's
own ``torch.OutOfMemoryError`` with the caching allocator's message format (there is no GPU here, so the
failure is simulated on the CPU side); our EpilogSlurmctld must requeue it once on
all the shards of its GPU, and the re-run must see them (SLURM_SHARDS_ON_NODE) and complete.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from gpushare.atomic import write_json_atomic
from gpushare.slurm.gres_request import plain_gres
from oom_slurm_util import JOB, exclusive_gres, ledger_of, oom_log, oom_settings, trust_log_messages, wait_final
from gpushare.estimate.source import cache_lookup
from devcluster.local_cluster import LocalCluster, missing_requirements
from devcluster.processes import scaled

pytestmark = [pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements()))]

@pytest.fixture
def cluster(make_cluster: Callable[..., LocalCluster], tmp_path: Path) -> LocalCluster:
    """A fresh cluster from the shared harness (tests/conftest.py) with our [oom] settings; no submit
    hook, so the jobs keep exactly the shard requests they ask for. gpushare-submitd runs, as it does on
    every controller: EpilogSlurmctld (SlurmUser) asks it to write the user's note into the job's log."""
    os.chmod(tmp_path, 0o755)
    return trust_log_messages(make_cluster(gpu="a100-40gb", toml_extra=oom_settings(tmp_path), with_hook=False))


def submit(cluster: LocalCluster, need: int, fail_other: bool = False, gres: str = "shard:4",
           *options: str) -> int:
    script = JOB.format(python=sys.executable, need=need, fail_other=fail_other)
    job_id, _ = cluster.client.sbatch(*options, f"--gres={gres}", "-o", str(cluster.base / "job-%j.out"),
                                      "-e", str(cluster.base / "job-%j.err"), script=script)
    return job_id


@pytest.mark.version_sensitive("the OOM rerun is gpu:1 where a held job may change GRES name (24.11+), shard:40 on 22.05")
def test_oom_on_a_shard_is_requeued_once_on_the_whole_gpu_and_completes(cluster: LocalCluster) -> None:
    job_id = submit(cluster, need=20)
    fields = wait_final(cluster, job_id, restarts=1)
    assert fields.state == "COMPLETED" and fields.restarts == 1, oom_log(cluster)
    assert plain_gres(fields.tres_per_node) == exclusive_gres(cluster)  # a whole GPU
    assert not fields.nice  # its own nice (0) back: its place in the queue, no fixed boost
    record = json.loads(fields.admin_comment.removeprefix("gpushare:"))
    oom = {**record["oom"], "from": plain_gres(record["oom"]["from"]), "to": plain_gres(record["oom"]["to"])}
    kept = oom.pop("kept")  # where the failed run's logs were copied: oom-run0.<12 random hex digits>
    assert oom == {"n": 1, "max": 1, "fam": "pytorch", "from": "shard:4", "to": exclusive_gres(cluster)}
    out = (cluster.base / f"job-{job_id}.out").read_text()
    assert "restart=1 shards=40" in out and "training finished" in out
    # the failed run's logs were moved aside before the rerun could truncate them, the note in its stderr
    first = (cluster.base / f"job-{job_id}.err.{kept}").read_text()
    assert "CUDA out of memory" in first and "requeued with" in first and f"job-{job_id}.err.{kept}" in first, first
    assert "restart=0" in (cluster.base / f"job-{job_id}.out.{kept}").read_text()
    entry = ledger_of(cluster).get(str(job_id), 0)
    assert entry["state"] == "done" and entry["message"].startswith("torch.OutOfMemoryError: CUDA out of memory.")
    history = [h for h in ledger_of(cluster).history() if h["job"] == str(job_id)]
    assert [h["event"] for h in history] == ["requeue", "requeued"]
    # the submit path's cache now knows this batch script needs more than the 4 GiB it failed in
    script = JOB.format(python=sys.executable, need=20, fail_other=False)
    estimate = cache_lookup(cluster.config(), script, ["a100-40gb"], os.geteuid())
    assert estimate is not None and estimate.total_bytes == 6 << 30


@pytest.mark.version_sensitive("the OOM rerun is gpu:1 where a held job may change GRES name (24.11+), shard:40 on 22.05")
def test_epilog_run_twice_at_once_requeues_once(cluster: LocalCluster) -> None:
    wrapper = cluster.base / "bin" / "gpushare-epilog-slurmctld"
    original = wrapper.read_text()
    entry = f"{cluster.bin_dir}/gpushare-epilog-slurmctld"
    wrapper.write_text(f"#!/bin/sh\nexport GPUSHARE_CONFIG='{cluster.gpushare_conf}'\n"
                       f"'{entry}' 2>>'{cluster.base}/log/hooks.log' &\n'{entry}' 2>>'{cluster.base}/log/hooks.log'\n"
                       "wait\nexit 0\n")
    try:
        job_id = submit(cluster, need=20)
        fields = wait_final(cluster, job_id, restarts=1)
    finally:
        wrapper.write_text(original)
    assert (fields.state, fields.restarts, plain_gres(fields.tres_per_node)) == ("COMPLETED", 1, exclusive_gres(cluster))
    events = [h["event"] for h in ledger_of(cluster).history() if h["job"] == str(job_id)]
    assert events == ["requeue", "requeued"]


def test_non_oom_failure_is_not_requeued(cluster: LocalCluster) -> None:
    job_id = submit(cluster, need=1, fail_other=True)
    fields = wait_final(cluster, job_id, restarts=0)
    assert (fields.state, fields.restarts, plain_gres(fields.tres_per_node)) == ("FAILED", 0, "shard:4")
    assert ledger_of(cluster).get(str(job_id), 0) is None


def test_no_requeue_job_stays_failed_with_the_reason(cluster: LocalCluster) -> None:
    job_id = submit(cluster, 20, False, "shard:4", "--no-requeue")
    fields = wait_final(cluster, job_id, restarts=0)
    assert (fields.state, fields.restarts) == ("FAILED", 0)
    entry = ledger_of(cluster).get(str(job_id), 0)
    assert entry["state"] == "stay_failed" and "--no-requeue" in entry["reason"]


@pytest.mark.version_sensitive("the OOM rerun is gpu:1 where a held job may change GRES name (24.11+), shard:40 on 22.05")
def test_oom_again_after_recovery_stays_failed_with_the_reason(cluster: LocalCluster) -> None:
    job_id = submit(cluster, need=100)  # more than any GPU here
    fields = wait_final(cluster, job_id, restarts=1)
    assert (fields.state, fields.restarts, plain_gres(fields.tres_per_node)) == ("FAILED", 1, exclusive_gres(cluster))
    entry = ledger_of(cluster).get(str(job_id), 1)
    assert entry["state"] == "stay_failed"
    assert entry["reason"].startswith("GPU out of memory again after 1 recovery retry")
    err = (cluster.base / f"job-{job_id}.err").read_text()
    assert "the job stays failed" in err


@pytest.mark.version_sensitive("24.11 keeps a requeued job COMPLETING across a slurmctld restart (docs/reliability.md)")
def test_recovery_interrupted_by_a_controller_restart_is_finished(cluster: LocalCluster) -> None:
    """The hook died right after requeuehold and slurmctld restarted: the job must not stay held."""
    job_id = submit(cluster, need=1, fail_other=True)  # fails without OOM: the hook leaves it alone
    wait_final(cluster, job_id, restarts=0)
    cluster.client.requeue_hold(job_id)  # ...what an interrupted recovery leaves behind
    ledger = ledger_of(cluster)
    write_json_atomic(ledger.dir / f"{job_id}.0.json", {
        "v": 1, "job": str(job_id), "restarts": 0, "action": "requeue", "state": "decided",
        "reason": "GPU out of memory (pytorch); requeue with shard:4 -> shard:40", "new_gres": "shard:40",
        "nice": -10000, "oom": None, "steps": ["requeuehold"], "created": 0, "updated": 0})
    (ledger.dir / f"{job_id}.0.open").touch()  # as Ledger.put marks an unfinished entry
    cluster.stop_process("slurmctld")
    cluster._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(cluster.conf)])  # -i: keep state
    cluster._wait(cluster._controller_up, 60, "slurmctld did not come back")
    held = cluster.client.require_job(job_id)
    assert held.state == "PENDING" and held.priority == 0  # held across the restart
    trigger = submit(cluster, need=1)  # any job's end runs the hook, which resumes the recovery
    wait_final(cluster, trigger, restarts=0)
    deadline = time.monotonic() + scaled(60)
    while ledger.get(str(job_id), 0)["state"] != "done" and time.monotonic() < deadline:
        time.sleep(0.25)
    assert ledger.get(str(job_id), 0)["state"] == "done", oom_log(cluster)
    fields = cluster.client.require_job(job_id)
    assert plain_gres(fields.tres_per_node) == "shard:40" and fields.priority != 0  # the ledger's own entry


def test_a_directive_an_oom_proved_too_small_is_raised_on_the_next_submission(
        make_cluster: Callable[..., LocalCluster], tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)
    cluster = trust_log_messages(make_cluster(gpu="a100-40gb", toml_extra=oom_settings(tmp_path)))
    script = JOB.format(python=sys.executable, need=20, fail_other=False).replace(
        "#!/bin/bash\n", "#!/bin/bash\n#GPUSHARE mem=3G\n", 1)

    def submit_script() -> int:
        job_id, _ = cluster.client.sbatch("--gres=gpu:1", "-o", str(cluster.base / "job-%j.out"), script=script)
        return job_id

    first = submit_script()  # 3 GiB + 1 GiB margin: shard:4, where it runs out of memory
    assert plain_gres(cluster.client.require_job(first).tres_per_node) == "shard:4"
    assert wait_final(cluster, first, restarts=1).state == "COMPLETED", oom_log(cluster)
    second = submit_script()  # the same script, its directive unchanged: the lesson is the floor
    job = cluster.client.require_job(second)
    record = json.loads(job.admin_comment.removeprefix("gpushare:"))
    assert plain_gres(job.tres_per_node) == "shard:7" and record["src"] == "learned", record  # 1.5 × 4 + 1
    assert f"job {first}" in record["detail"] and "directive:mem said 3.0 GiB" in record["detail"]
    cluster.client.run("scancel", str(second), check=False)
