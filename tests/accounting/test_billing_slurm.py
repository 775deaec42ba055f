"""The billing lines `gpushare slurm-config` prints, on a real slurmctld with slurmdbd: a GPU bills its GiB and a
shard one GiB, so a shared job is charged the part of a GPU it holds (and not nothing, nor a whole GPU)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from devcluster.local_cluster import LocalCluster
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
