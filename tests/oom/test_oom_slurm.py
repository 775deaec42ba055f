"""OOM recovery on a real local Slurm 22.05 (slurmctld + slurmd + munge, simulated GPUs).

The jobs run real Python with PyTorch: a job that needs more GPU memory than its shards raises PyTorch's
own ``torch.OutOfMemoryError`` with the caching allocator's message format (there is no GPU here, so the
failure is simulated on the CPU side, as issue 6 allows); our EpilogSlurmctld must requeue it once on
all the shards of its GPU, and the re-run must see them (SLURM_SHARDS_ON_NODE) and complete.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from epilog.ledger import Ledger
from gpushare.atomic import write_json_atomic
from slurm_plugins.estimate_source import cache_lookup
from slurm_plugins.local_cluster import LocalCluster, missing_requirements

pytestmark = [pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements()))]

JOB = """#!/bin/bash
{python} - <<'EOF'
import os, torch
need_gib = {need}
have = int(os.environ.get("SLURM_SHARDS_ON_NODE", "0"))
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


def oom_settings(base: Path) -> str:
    """The ``[oom]`` table a test cluster needs (the hook gets no SLURM_CONF from slurmctld), unless the
    cluster's generated gpushare.toml already has one."""
    if "[oom]" in LocalCluster(base=base)._toml_text():
        return ""
    return (f'[oom]\nledger_dir = "{base}/oom-ledger"\nslurm_conf = "{base}/etc/slurm.conf"\n'
            f'log_file = "{base}/log/oom.log"\n')


def ledger_of(cluster: LocalCluster) -> Ledger:
    return Ledger(cluster.config().oom.ledger_dir)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    base = tmp_path_factory.mktemp("oom-slurm")
    os.chmod(base, 0o755)
    extra = oom_settings(base)
    local = LocalCluster(base=base, gpu="a100-40gb", toml_extra=extra, with_hook=False, with_submitd=False)
    local.start()
    yield local
    local.stop()


def submit(cluster: LocalCluster, need: int, fail_other: bool = False, gres: str = "shard:4",
           *options: str) -> int:
    script = JOB.format(python=sys.executable, need=need, fail_other=fail_other)
    job_id, _ = cluster.client.sbatch(*options, f"--gres={gres}", "-o", str(cluster.base / "job-%j.out"),
                                      "-e", str(cluster.base / "job-%j.err"), script=script)
    return job_id


def wait_final(cluster: LocalCluster, job_id: int, restarts: int, timeout_s: float = 90) -> dict[str, str]:
    """Until the job has run ``restarts`` times more and is in a final state again."""
    deadline = time.monotonic() + timeout_s
    fields: dict[str, str] = {}
    while time.monotonic() < deadline:
        fields = cluster.client.show_job(job_id)
        if fields.get("JobState") in ("COMPLETED", "FAILED") and int(fields.get("Restarts", 0)) >= restarts:
            time.sleep(0.5)  # let a pending EpilogSlurmctld decide (it would requeue from FAILED)
            again = cluster.client.show_job(job_id)
            if again.get("JobState") == fields.get("JobState") and again.get("Restarts") == fields.get("Restarts"):
                return again
        time.sleep(0.25)
    raise AssertionError(f"job {job_id}: {fields.get('JobState')} restarts {fields.get('Restarts')}; "
                         f"log: {_oom_log(cluster)}")


def _oom_log(cluster: LocalCluster) -> str:
    path = Path(cluster.config().oom.log_file or cluster.base / "log" / "oom.log")
    return path.read_text()[-3000:] if path.exists() else "(no oom.log)"


def test_oom_on_a_shard_is_requeued_once_on_the_whole_gpu_and_completes(cluster: LocalCluster) -> None:
    job_id = submit(cluster, need=20)
    fields = wait_final(cluster, job_id, restarts=1)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", _oom_log(cluster)
    assert fields["TresPerNode"] == "gres:shard:40"  # all 40 shards of the 40 GiB GPU
    assert fields["Nice"] == "-10000"
    record = json.loads(fields["AdminComment"].removeprefix("gpushare:"))
    assert record["oom"] == {"n": 1, "max": 1, "fam": "pytorch", "from": "gres:shard:4", "to": "gres:shard:40"}
    out = (cluster.base / f"job-{job_id}.out").read_text()
    assert "restart=1 shards=40" in out and "training finished" in out
    entry = ledger_of(cluster).get(str(job_id), 0)
    assert entry["state"] == "done" and entry["message"].startswith("torch.OutOfMemoryError: CUDA out of memory.")
    history = [h for h in ledger_of(cluster).history() if h["job"] == str(job_id)]
    assert [h["event"] for h in history] == ["requeue", "requeued"]
    # the submit path's cache now knows this batch script needs more than the 4 GiB it failed in
    script = JOB.format(python=sys.executable, need=20, fail_other=False)
    estimate = cache_lookup(cluster.config(), script, ["a100-40gb"])
    assert estimate is not None and estimate.total_bytes == 6 << 30


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
    assert (fields["JobState"], fields["Restarts"], fields["TresPerNode"]) == ("COMPLETED", "1", "gres:shard:40")
    events = [h["event"] for h in ledger_of(cluster).history() if h["job"] == str(job_id)]
    assert events == ["requeue", "requeued"]


def test_non_oom_failure_is_not_requeued(cluster: LocalCluster) -> None:
    job_id = submit(cluster, need=1, fail_other=True)
    fields = wait_final(cluster, job_id, restarts=0)
    assert (fields["JobState"], fields["Restarts"], fields["TresPerNode"]) == ("FAILED", "0", "gres:shard:4")
    assert ledger_of(cluster).get(str(job_id), 0) is None


def test_no_requeue_job_stays_failed_with_the_reason(cluster: LocalCluster) -> None:
    job_id = submit(cluster, 20, False, "shard:4", "--no-requeue")
    fields = wait_final(cluster, job_id, restarts=0)
    assert (fields["JobState"], fields["Restarts"]) == ("FAILED", "0")
    entry = ledger_of(cluster).get(str(job_id), 0)
    assert entry["state"] == "stay_failed" and "--no-requeue" in entry["reason"]


def test_oom_again_after_recovery_stays_failed_with_the_reason(cluster: LocalCluster) -> None:
    job_id = submit(cluster, need=100)  # more than any GPU here
    fields = wait_final(cluster, job_id, restarts=1)
    assert (fields["JobState"], fields["Restarts"], fields["TresPerNode"]) == ("FAILED", "1", "gres:shard:40")
    entry = ledger_of(cluster).get(str(job_id), 1)
    assert entry["state"] == "stay_failed"
    assert entry["reason"].startswith("GPU out of memory again after 1 recovery retry")
    err = (cluster.base / f"job-{job_id}.err").read_text()
    assert "the job stays failed" in err


def test_recovery_interrupted_by_a_controller_restart_is_finished(cluster: LocalCluster) -> None:
    """The hook died right after requeuehold and slurmctld restarted: the job must not stay held."""
    job_id = submit(cluster, need=1, fail_other=True)  # fails without OOM: the hook leaves it alone
    wait_final(cluster, job_id, restarts=0)
    cluster.client.requeue_hold(job_id)  # ...what an interrupted recovery leaves behind
    ledger = ledger_of(cluster)
    write_json_atomic(ledger.dir / f"{job_id}.0.json", {
        "v": 1, "job": str(job_id), "restarts": 0, "action": "requeue", "state": "decided",
        "reason": "GPU out of memory (pytorch); requeue with shard:4 -> shard:40", "new_gres": "gres:shard:40",
        "nice": -10000, "oom": None, "steps": ["requeuehold"], "created": 0, "updated": 0})
    (ledger.dir / f"{job_id}.0.open").touch()  # as Ledger.put marks an unfinished entry
    cluster.stop_process("slurmctld")
    cluster._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(cluster.conf)])  # -i: keep state
    cluster._wait(cluster._controller_up, 60, "slurmctld did not come back")
    held = cluster.client.show_job(job_id)
    assert held["JobState"] == "PENDING" and held["Priority"] == "0"  # held across the restart
    trigger = submit(cluster, need=1)  # any job's end runs the hook, which resumes the recovery
    wait_final(cluster, trigger, restarts=0)
    deadline = time.monotonic() + 60
    while ledger.get(str(job_id), 0)["state"] != "done" and time.monotonic() < deadline:
        time.sleep(0.25)
    assert ledger.get(str(job_id), 0)["state"] == "done", _oom_log(cluster)
    fields = cluster.client.show_job(job_id)
    assert fields["TresPerNode"] == "gres:shard:40" and fields["Priority"] != "0"


class MigCluster(LocalCluster):
    """The same local cluster with two MIG-typed GPUs (SLURM-FACTS: typed ``gpu`` GRES on character
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
    base = tmp_path_factory.mktemp("oom-mig")
    os.chmod(base, 0o755)
    extra = oom_settings(base)
    mig = MigCluster(base=base, gpu="a100-80gb", toml_extra=extra, with_hook=False, with_submitd=False)
    mig.start()
    try:
        script = ("#!/bin/bash\necho \"restart=${SLURM_RESTART_COUNT:-0} gpu=$CUDA_VISIBLE_DEVICES\"\n"
                  "if [ \"${SLURM_RESTART_COUNT:-0}\" = 0 ]; then\n"
                  "  echo 'torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 12.00 GiB. GPU 0 has a "
                  "total capacity of 9.50 GiB of which 0.20 GiB is free.' >&2\n  exit 1\nfi\n")
        job_id, _ = mig.client.sbatch("--gres=gpu:1g.10gb:1", "-o", str(base / "mig-%j.out"),
                                      "-e", str(base / "mig-%j.err"), script=script)
        fields = wait_final(mig, job_id, restarts=1)
        assert (fields["JobState"], fields["Restarts"], fields["TresPerNode"]) == \
            ("COMPLETED", "1", "gres:gpu:2g.20gb:1"), _oom_log(mig)
        assert "restart=1" in (base / f"mig-{job_id}.out").read_text()
    finally:
        mig.stop()


def test_end_to_end_from_submission_sized_share_to_exclusive_rerun(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The whole story with our job_submit hook: gpu:1 + '#GPUSHARE mem=2G' becomes shard:3 at submit,
    the job runs out of GPU memory, and it is re-run once on all 40 shards with the record extended."""
    base = tmp_path_factory.mktemp("oom-e2e")
    os.chmod(base, 0o755)
    extra = oom_settings(base)
    full = LocalCluster(base=base, gpu="a100-40gb", toml_extra=extra)
    full.start()
    try:
        script = "#!/bin/bash\n#GPUSHARE mem=2G\n" + JOB.format(python=sys.executable, need=20,
                                                                 fail_other=False).partition("\n")[2]
        job_id, said = full.client.sbatch("--gres=gpu:1", "-o", str(base / "e2e-%j.out"),
                                          "-e", str(base / "e2e-%j.err"), script=script)
        assert "shard:3" in said
        fields = wait_final(full, job_id, restarts=1)
        assert (fields["JobState"], fields["Restarts"], fields["TresPerNode"]) == \
            ("COMPLETED", "1", "gres:shard:40"), _oom_log(full)
        record = json.loads(fields["AdminComment"].removeprefix("gpushare:"))
        assert record["decision"] == "shared" and record["oom"]["from"] == "gres:shard:3"
        assert "restart=1 shards=40" in (base / f"e2e-{job_id}.out").read_text()
    finally:
        full.stop()
