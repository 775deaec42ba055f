"""A neighbour against a victim's kept log, on a real Slurm: the copy of the failed run's log cannot be denied.

The victim's logs are in a shared sticky folder (as /tmp is) under fixed names a neighbour reads with
``scontrol show job``. The neighbour creates every name the copy used to get (``<log>.oom-run<N>``) before the
victim's job fails of a GPU OOM. EpilogSlurmctld runs as SlurmUser and has gpushare-submitd copy the logs as
the victim: the copy is made under a name nobody could know, and the job's record says which.
"""

from __future__ import annotations

import json
import os
import pwd
from pathlib import Path
from typing import Callable

import pytest

from oom_slurm_util import oom_log, oom_settings, trust_log_messages, wait_final
from devcluster.local_cluster import LocalCluster, ensure_login_user, missing_requirements

pytestmark = [pytest.mark.slurm, pytest.mark.hostile,
              pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements()))]

OOM_LINE = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 40.00 GiB"
# The first run prints its progress and PyTorch's OOM message and fails; the rerun prints one line and succeeds.
JOB = f"""#!/bin/sh
if [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ]; then echo "rerun ok"; exit 0; fi
echo "step 1 of the first run"
echo "{OOM_LINE}" >&2
exit 1
"""


def test_a_squatted_copy_name_does_not_cost_the_victim_its_log(make_cluster: Callable[..., LocalCluster],
                                                                 tmp_path: Path) -> None:
    victim = ensure_login_user()  # before the cluster starts: its chroot copies the accounts
    neighbour = pwd.getpwnam("nobody")
    os.chmod(tmp_path, 0o755)
    cluster = trust_log_messages(make_cluster(gpu="a100-40gb", toml_extra=oom_settings(tmp_path), with_hook=False))
    shared = cluster.base / "scratch"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    out, err = shared / "victim.out", shared / "victim.err"
    for log in (out, err):
        for run in range(3):
            squat = Path(f"{log}.oom-run{run}")
            squat.write_text("nothing to see here\n")
            os.chown(squat, neighbour.pw_uid, neighbour.pw_gid)
    job_id, _ = cluster.client.sbatch("--gres=shard:4", f"--uid={victim.pw_uid}", f"--gid={victim.pw_gid}",
                                      "-D", str(shared), "-o", str(out), "-e", str(err), script=JOB)
    job = wait_final(cluster, job_id, restarts=1)
    assert job.state == "COMPLETED" and job.restarts == 1, oom_log(cluster)
    assert "step 1" not in out.read_text()  # the rerun truncated the log, as Slurm does
    copies = [p for p in shared.iterdir() if p.stat().st_uid == victim.pw_uid and ".oom-run" in p.name]
    assert len(copies) == 2, (copies, oom_log(cluster))  # the failed run's output survived the rerun
    kept = json.loads(job.admin_comment.removeprefix("gpushare:"))["oom"]["kept"]  # and the record says where
    kept_err, kept_out = Path(f"{err}.{kept}"), Path(f"{out}.{kept}")
    assert sorted(copies) == sorted([kept_err, kept_out])
    assert OOM_LINE in kept_err.read_text() and "step 1 of the first run" in kept_out.read_text()
    assert str(kept_err) in kept_err.read_text()  # the note in the copy names it
    assert all(Path(f"{log}.oom-run{run}").read_text() == "nothing to see here\n"
               for log in (out, err) for run in range(3))
