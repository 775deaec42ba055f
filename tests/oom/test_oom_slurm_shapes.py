"""OOM recovery on real Slurm clusters of other shapes: MIG-typed GPUs, and the whole submit path.

Each test starts and stops its own cluster, after the shared one of test_oom_slurm.py is gone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

import pytest

from oom_slurm_util import JOB, exclusive_gres, oom_log, oom_settings, trust_log_messages, wait_final
from gpushare.slurm.gres_request import plain_gres
from devcluster.local_cluster import LocalCluster, missing_requirements

pytestmark = [pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements()))]


class MigCluster(LocalCluster):
    """The same local cluster with two MIG-typed GPUs (docs/compatibility.md: typed ``gpu`` GRES on character
    devices) instead of shards: ``gpu:1g.10gb:1`` and ``gpu:2g.20gb:1`` of an A100-80GB."""

    def write_files(self) -> None:
        super().write_files()
        devices = self.device_dir(self.node_names[0])
        text = self.conf.read_text().replace("GresTypes=gpu,shard", "GresTypes=gpu")
        self.conf.write_text(re.sub(r" Gres=\S+", " Gres=gpu:1g.10gb:1,gpu:2g.20gb:1", text))
        (self.base / "etc" / "gres.conf").write_text(
            f"NodeName=n1 Name=gpu Type=1g.10gb File={devices}/nvidia0\n"
            f"NodeName=n1 Name=gpu Type=2g.20gb File={devices}/nvidia1\n")


def test_mig_job_moves_to_the_next_larger_slice(tmp_path_factory: pytest.TempPathFactory) -> None:
    base = Path(tempfile.mkdtemp(prefix="gpushare-oom-mig-", dir="/tmp"))  # slurmctld (as slurm) must reach it
    os.chmod(base, 0o755)
    # gpushare-submitd runs: EpilogSlurmctld (as SlurmUser) copies the failed run's log aside as the job's user
    # through it before the requeue, and requeues nothing it could not copy
    mig = MigCluster(base=base, gpu="a100-80gb", toml_extra=oom_settings(base), with_hook=False)
    mig.start()
    trust_log_messages(mig)
    try:
        script = ("#!/bin/bash\necho \"restart=${SLURM_RESTART_COUNT:-0} gpu=$CUDA_VISIBLE_DEVICES\"\n"
                  "if [ \"${SLURM_RESTART_COUNT:-0}\" = 0 ]; then\n"
                  "  echo 'torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 12.00 GiB. GPU 0 has a "
                  "total capacity of 9.50 GiB of which 0.20 GiB is free.' >&2\n  exit 1\nfi\n")
        job_id, _ = mig.client.sbatch("--gres=gpu:1g.10gb:1", "-o", str(base / "mig-%j.out"),
                                      "-e", str(base / "mig-%j.err"), script=script)
        fields = wait_final(mig, job_id, restarts=1)
        assert (fields.state, fields.restarts, plain_gres(fields.tres_per_node)) == \
            ("COMPLETED", 1, "gpu:2g.20gb:1"), oom_log(mig)
        assert "restart=1" in (base / f"mig-{job_id}.out").read_text()
    finally:
        mig.stop()
    shutil.rmtree(base, ignore_errors=True)  # kept, with its logs, when the test failed


@pytest.mark.version_sensitive("the OOM rerun is gpu:1 where a held job may change GRES name (24.11+), shard:40 on 22.05")
def test_end_to_end_from_submission_sized_share_to_exclusive_rerun(
        make_cluster: Callable[..., LocalCluster], tmp_path: Path) -> None:
    """The whole story with our job_submit hook: gpu:1 + '#GPUSHARE mem=2G' becomes shard:3 at submit,
    the job runs out of GPU memory, and it is re-run once on all 40 shards with the record extended."""
    os.chmod(tmp_path, 0o755)
    full = trust_log_messages(make_cluster(gpu="a100-40gb", toml_extra=oom_settings(tmp_path)))
    base = full.base
    script = "#!/bin/bash\n#GPUSHARE mem=2G\n" + JOB.format(python=sys.executable, need=20,
                                                             fail_other=False).partition("\n")[2]
    job_id, said = full.client.sbatch("--gres=gpu:1", "-o", str(base / "e2e-%j.out"),
                                      "-e", str(base / "e2e-%j.err"), script=script)
    assert "shard:3" in said
    fields = wait_final(full, job_id, restarts=1)
    assert (fields.state, fields.restarts, plain_gres(fields.tres_per_node)) == \
        ("COMPLETED", 1, exclusive_gres(full)), oom_log(full)
    record = json.loads(fields.admin_comment.removeprefix("gpushare:"))
    assert record["decision"] == "shared" and plain_gres(record["oom"]["from"]) == "shard:3"
    assert "restart=1 shards=40" in (base / f"e2e-{job_id}.out").read_text()
