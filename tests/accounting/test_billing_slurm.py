"""The billing lines `gpushare slurm-config` prints, on a real slurmctld with slurmdbd: a GPU bills its GiB and a
shard one GiB, so a shared job is charged the part of a GPU it holds (and not nothing, nor a whole GPU).

On the same cluster (``AccountingStorageEnforce=limits,qos`` added with the weights): GPU QOS limits written as
docs/deployment.md says ("Billing and limits") bound shared jobs too, and ``sacct`` shows a shared job's billing."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from devcluster.local_cluster import LocalCluster
from devcluster.processes import scaled
from gpushare.slurm_plugins.slurm_config import render_billing_lines

pytestmark = pytest.mark.slurm


def test_a_shard_bills_its_part_of_a_gpu(make_cluster, tmp_path: Path) -> None:
    cluster: LocalCluster = make_cluster(accounting=True, accounting_users=("root",), with_hook=False)
    printed = render_billing_lines(cluster.config(), with_slurmdbd=True)
    assert "\nAccountingStorageTRES=gres/gpu,gres/shard\n" in printed  # the cluster's own line says the same
    weights = re.search(r'PartitionName=gpu: add TRESBillingWeights="([^"]+)"', printed)
    assert weights, printed
    weights_text = weights.group(1).replace("CPU=<c>", "CPU=1").replace("Mem=<m>", "Mem=0")
    conf = "\n".join(f'{line} TRESBillingWeights="{weights_text}"' if line.startswith("PartitionName=gpu ") else line
                     for line in cluster.conf.read_text().splitlines()) + "\n"
    conf += "AccountingStorageEnforce=limits,qos\n"  # QOS limits apply (the site's setting; off by default)
    cluster.conf.write_text(conf)
    cluster.restart_slurm()
    os.chmod(tmp_path, 0o755)
    billed = {}
    for gres in ("gpu:1", "shard:4", "shard:20"):
        job_id, _ = cluster.client.sbatch("-D", str(tmp_path), f"--gres={gres}", "--hold", script="#!/bin/bash\ntrue\n")
        tres = cluster.client.show_job_text(job_id).get("TRES") or cluster.client.show_job_text(job_id)["ReqTRES"]
        billed[gres] = int(dict(item.split("=", 1) for item in tres.split(","))["billing"])
        cluster.client.run("scancel", str(job_id))
    gib = cluster.config().gpu(cluster.config().nodes[0].gpu).shards
    # one CPU (weight 1) plus the GPU's GiB, or the shard's GiB: a shard:20 job is charged 20/GiB of a GPU
    assert billed == {"gpu:1": 1 + gib, "shard:4": 1 + 4, "shard:20": 1 + 20}, billed

    _qos_limits_bound_shared_jobs(cluster, tmp_path, gib)


def _pending_reason(cluster: LocalCluster, job_id: int, timeout_s: float = 20.0) -> str:
    """The job's pending reason once the scheduler has looked at it (not the initial None)."""
    deadline = time.monotonic() + timeout_s
    job = cluster.client.require_job(job_id)
    while job.reason in ("", "None") and time.monotonic() < deadline:
        time.sleep(0.3)
        job = cluster.client.require_job(job_id)
    return f"{job.state} {job.reason}"


def _running(cluster: LocalCluster, job_id: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while cluster.client.require_job(job_id).state != "RUNNING":
        assert time.monotonic() < deadline, cluster.client.require_job(job_id).states
        time.sleep(0.2)


def _qos_limits_bound_shared_jobs(cluster: LocalCluster, tmp_path: Path, gib: int) -> None:
    """One GPU per user, written both ways docs/deployment.md gives: gres/gpu paired with gres/shard, and billing.
    A user holding a GPU's worth of shards gets a further shared job PENDING with the QOS's reason, while the
    node has room for it; that job's shards alone fit, and a finished shared job's billing is in sacct."""
    started = time.monotonic()
    run = cluster.client.run
    run("sacctmgr", "-i", "add", "qos", "onegpu", f"MaxTRESPerUser=gres/gpu=1,gres/shard={gib}")
    run("sacctmgr", "-i", "modify", "user", "where", "name=root", "set", "qos+=onegpu")

    def submit(gres: str, seconds: int) -> int:
        job_id, _ = cluster.client.sbatch("-D", str(tmp_path), "--qos=onegpu", f"--gres={gres}", "-o", "/dev/null",
                                          script=f"#!/bin/bash\nsleep {seconds}\n")
        return job_id

    holder = submit(f"shard:{gib}", 60)  # a whole GPU's worth of shards, as OOM recovery asks on 22.05
    _running(cluster, holder)
    extra = submit("shard:4", 1)
    assert _pending_reason(cluster, extra) == "PENDING QOSMaxGRESPerUser"
    reasons = {"gres": "QOSMaxGRESPerUser"}
    # the same GPU written as billing: one CPU plus a GPU's GiB; the held shard:{gib} job bills exactly that
    run("sacctmgr", "-i", "modify", "qos", "where", "name=onegpu", "set",
        "MaxTRESPerUser=gres/gpu=-1,gres/shard=-1,billing=" + str(1 + gib))
    run("scontrol", "update", f"jobid={extra}", "nice=1")  # a change makes the scheduler look again
    deadline = time.monotonic() + scaled(20)
    while (reason := _pending_reason(cluster, extra)) == "PENDING QOSMaxGRESPerUser" and time.monotonic() < deadline:
        time.sleep(0.3)
    assert reason == "PENDING QOSMaxBillingPerUser", reason
    reasons["billing"] = "QOSMaxBillingPerUser"
    run("scancel", str(holder))
    _running_or_done(cluster, extra)  # the holder gone, the shared job starts: the limit was the only bar
    # sacct: the shared job's billing (one CPU + 4 shards), stored by slurmdbd
    deadline = time.monotonic() + scaled(30)
    alloc = ""
    while "billing=" not in alloc and time.monotonic() < deadline:
        alloc = run("sacct", "-j", str(extra), "-X", "-n", "-P", "-o", "AllocTRES").strip()
        time.sleep(0.3)
    tres = dict(item.split("=", 1) for item in alloc.split(",") if "=" in item)
    assert (tres.get("billing"), tres.get("gres/shard")) == (str(1 + 4), "4"), alloc
    print(f"\nQOS limits {reasons}; sacct AllocTRES {alloc}; {time.monotonic() - started:.1f} s")


def _running_or_done(cluster: LocalCluster, job_id: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while cluster.client.require_job(job_id).state == "PENDING":
        assert time.monotonic() < deadline, cluster.client.require_job(job_id).states
        time.sleep(0.2)
