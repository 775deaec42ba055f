"""An OOM requeue half done when slurmctld restarts converges to one outcome (docs/reliability.md).

The OOM ledger (epilog/ledger.py) records each step of a requeue as Slurm carries it out (epilog/executor.py:
requeuehold, gres, comment, release, then boost and ``done``). A hook killed with slurmctld may stop after
any of them. For each point a real Slurm is put in the state such a crash leaves (the steps done in Slurm,
the ledger saying which), slurmctld is restarted, and the resume timer's command runs as SlurmUser
(etc/systemd/gpushare-oom-resume.service). Each job must then be requeued exactly once (one more run, on the
new GRES, to COMPLETED), recorded once in the ledger's history, and a second resume must change nothing.

One module-scoped single-host cluster: the fault is the controller's alone. The same cluster also serves the
observe-mode test (an OOM requeue recorded as "would have", none made), which needs only a real EpilogSlurmctld.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster.local_cluster import LocalCluster, missing_requirements
from devcluster.slurm_runtime import SLURM_USER, slurm_account
from devcluster.processes import scaled
from gpushare.atomic import write_json_atomic
from gpushare.epilog.ledger import Ledger
from gpushare.slurm.gres_request import plain_gres
from gpushare.slurm_plugins.decision import parse_record
from oom_slurm_util import exclusive_gres, oom_settings, trust_log_messages

pytestmark = [pytest.mark.slurm, pytest.mark.faults,
              pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements())),
              pytest.mark.version_sensitive("OOM recovery reruns a shard job as gpu:1 on 24.11+, shard:40 on 22.05; "
                                            "24.11 keeps a requeued job COMPLETING across a slurmctld restart "
                                            "(docs/reliability.md)")]

# Fails its first run (not an OOM: the real hook leaves it alone), succeeds when run again.
JOB = '#!/bin/sh\n[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] || exit 3\necho "rerun shards=$SLURM_SHARDS_ON_NODE"\n'
OOM = {"n": 1, "family": "pytorch", "old": "gres:shard:4"}
# slurmctld re-kills a job still COMPLETING KillWait (5 s here) + 2 x MessageTimeout (10 s) after it was last
# active, looking once a minute (purge_old_job): the longest a stale completion lasts on this cluster.
STALE_COMPLETION_S = 5 + 2 * 10 + 60


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    base = Path(tempfile.mkdtemp(prefix="gpushare-oom-faults-", dir="/tmp"))
    os.chmod(base, 0o755)
    made = LocalCluster(base / "c", gpu="a100-40gb", toml_extra=oom_settings(base), with_hook=False)
    try:
        trust_log_messages(made.start())
        yield made
    finally:
        made.stop()
        shutil.rmtree(base, ignore_errors=True)


def _resume(cluster: LocalCluster) -> None:
    """What gpushare-oom-resume.timer runs, as its unit does: as SlurmUser."""
    hook = os.path.join(os.path.dirname(sys.executable), "gpushare-epilog-slurmctld")
    subprocess.run(cluster.user_argv(SLURM_USER, [hook, "--resume"]), env=cluster.env, check=True, timeout=120)


def _half_done(cluster: LocalCluster, steps: list[str], released: bool, state: str) -> tuple[int, Ledger]:
    """A failed job, the Slurm side of ``steps`` (plus a release not yet recorded when ``released``) carried
    out, and the ledger entry a hook killed right after the last of them leaves (old enough to resume)."""
    out = cluster.base / "oom-faults"
    out.mkdir(exist_ok=True)
    job_id, _ = cluster.client.sbatch("--gres=shard:4", "-o", str(out / "job-%j.out"), script=JOB)
    deadline = time.monotonic() + scaled(60)
    while True:
        job = cluster.client.require_job(job_id)
        if job.state == "FAILED" and not job.completing:
            break
        assert time.monotonic() < deadline, f"job {job_id} did not fail: {job.states}"
        time.sleep(0.25)
    time.sleep(0.5)  # the real EpilogSlurmctld of that end has looked and left it alone
    new_gres = exclusive_gres(cluster)
    if "requeuehold" in steps:
        cluster.client.requeue_hold(job_id)
    if "gres" in steps:
        cluster.client.update_job(job_id, gres=new_gres)
    if "comment" in steps:
        cluster.client.update_job(job_id, admincomment='gpushare:{"oom":{"n":1,"family":"pytorch","old":"gres:shard:4"},"v":1}')
    if released or "release" in steps:
        cluster.client.release(job_id)
    ledger = Ledger(cluster.config().oom.ledger_dir)
    write_json_atomic(ledger.dir / f"{job_id}.0.json", {
        "v": 1, "job": str(job_id), "restarts": 0, "action": "requeue", "state": state,
        "reason": f"GPU out of memory (pytorch); requeue with shard:4 -> {new_gres}", "old_gres": "gres:shard:4",
        "new_gres": new_gres, "nice": 0, "oom": OOM, "retry": 1, "max_retries": 1, "steps": steps,
        "created": 0, "updated": 0}, mode=0o600)
    (ledger.dir / f"{job_id}.0.open").touch()
    account = slurm_account()
    for path in (ledger.dir / f"{job_id}.0.json", ledger.dir / f"{job_id}.0.open"):
        os.chown(path, account.pw_uid, account.pw_gid)  # as EpilogSlurmctld (SlurmUser) leaves them
    return job_id, ledger


@pytest.mark.parametrize("steps, released, state", [
    ([], False, "decided"),  # decided, nothing done in Slurm yet
    (["requeuehold"], False, "decided"),
    (["requeuehold", "gres", "comment"], True, "decided"),  # released in Slurm, not yet in the ledger
    (["requeuehold", "gres", "comment", "release"], False, "requeued"),  # only boost and done left
], ids=["decided", "requeuehold", "released-unrecorded", "requeued"])
def test_a_requeue_half_done_across_a_controller_restart_happens_once(cluster, steps, released, state):
    """On 24.11 a job requeued after the restart may come back PENDING+COMPLETING (the recovered job still
    counts its node) until slurmctld's own re-kill clears it, KillWait + 2 x MessageTimeout after the
    requeue and looked at once a minute: up to 85 s here, hence the longer deadline. What must not follow
    is Slurm's requeue delay: once completion ends the job must start within seconds, not 121 s later."""
    job_id, ledger = _half_done(cluster, steps, released, state)
    started = time.monotonic()
    cluster.restart_controller()
    _resume(cluster)
    deadline = time.monotonic() + scaled(60 + STALE_COMPLETION_S)
    eligible_since: float | None = None
    while True:
        job = cluster.client.require_job(job_id)
        if job.state == "COMPLETED" and not job.completing:
            break
        if job.pending and not job.completing:
            eligible_since = eligible_since or time.monotonic()
            assert time.monotonic() - eligible_since < 10, \
                f"job {job_id}: pending ({job.reason}) 10 s after its completion ended, restarts {job.restarts}"
        assert time.monotonic() < deadline, f"job {job_id}: {job.states} ({job.reason}) restarts {job.restarts}"
        time.sleep(0.25)
    print(f"requeue half done at {'/'.join(steps) or 'decided'}: converged {time.monotonic() - started:.1f} s "
          "after the restart")
    assert job.restarts == 1  # requeued exactly once
    assert plain_gres(job.tres_per_node) == plain_gres(exclusive_gres(cluster))
    assert (parse_record(job.admin_comment) or {}).get("oom", {}).get("n") == 1
    entry = ledger.get(str(job_id), 0)
    assert entry is not None and entry["state"] == "done" and entry["steps"].count("boost") == 1
    events = [e for e in ledger.history() if str(e.get("job")) == str(job_id) and e.get("event") == "requeued"]
    assert len(events) == 1, events
    assert (cluster.base / "oom-faults" / f"job-{job_id}.out").read_text().count("rerun") == 1
    _resume(cluster)  # again: nothing left to do, nothing done twice
    again = cluster.client.require_job(job_id)
    assert (again.state, again.restarts) == ("COMPLETED", 1)
    assert len([e for e in ledger.history() if str(e.get("job")) == str(job_id) and e.get("event") == "requeued"]) == 1


def _as_controller(cluster: LocalCluster, command: str) -> str:
    """Run ``command`` (sh) in slurmctld's view of the files: a chroot release's slurmctld (and its
    EpilogSlurmctld) has a mount namespace of its own."""
    argv = ["sh", "-c", command]
    if cluster.in_chroot:
        argv = ["nsenter", "-t", str(cluster.pids["slurmctld"]), "-m", "-r", *argv]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (command, done.stderr)
    return done.stdout


def _oom_job(cluster: LocalCluster, out: Path) -> int:
    """A job that ends with PyTorch's OOM message on its first run only (then completes)."""
    script = ('#!/bin/sh\n[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && { echo "rerun shards=$SLURM_SHARDS_ON_NODE"; '
              'exit 0; }\necho "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a '
              'total capacity of 40.00 GiB of which 0.00 GiB is free. Of the allocated memory 3.50 GiB is allocated '
              'by PyTorch, and 0.10 GiB is reserved by PyTorch but unallocated." >&2\nexit 1\n')
    job_id, _ = cluster.client.sbatch("--gres=shard:4", "-o", str(out / "job-%j.out"), "-e", str(out / "job-%j.err"),
                                      script=script)
    return job_id


def _settled(cluster: LocalCluster, job_id: int, restarts: int, state: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        job = cluster.client.require_job(job_id)
        if (job.state, job.restarts) == (state, restarts) and not job.completing:
            time.sleep(2.0)  # a recovery would show as a requeue within a moment
            again = cluster.client.require_job(job_id)
            if (again.state, again.restarts) == (state, restarts):
                return
        assert time.monotonic() < deadline, f"job {job_id}: {job.states} ({job.reason}) restarts {job.restarts}"
        time.sleep(0.25)


def test_a_full_ledger_disk_fails_open_and_recovers(cluster):
    """The controller's OOM ledger on a full filesystem (a 64 KiB tmpfs, filled): an OOM job stays as Slurm
    left it (FAILED, not held, not requeued) and the hook says why once; no torn entry is left; once space
    returns the next OOM job is recovered (once)."""
    ledger = Ledger(cluster.config().oom.ledger_dir)
    account = slurm_account()
    out = cluster.base / "oom-faults"
    out.mkdir(exist_ok=True)
    os.chmod(out, 0o777)
    _as_controller(cluster, f"mount -t tmpfs -o size=64k,mode=0700,uid={account.pw_uid},gid={account.pw_gid} "
                            f"tmpfs '{ledger.dir}' && (dd if=/dev/zero of='{ledger.dir}/filler' bs=4k 2>/dev/null; true)")
    try:
        full = _oom_job(cluster, out)
        _settled(cluster, full, 0, "FAILED")
        job = cluster.client.require_job(full)
        assert job.priority != 0 and plain_gres(job.tres_per_node) == "shard:4"  # not held, not changed
        log = Path(cluster.config().oom.log_file).read_text(errors="replace")
        assert log.count(f"gpushare-epilog-slurmctld failed (job {full})") == 1, log[-2000:]
        assert "No space left on device" in log
        files = _as_controller(cluster, f"find '{ledger.dir}' -type f -size +0").split()
        assert files == [f"{ledger.dir}/filler"], files  # nothing torn left behind
        _as_controller(cluster, f"rm '{ledger.dir}/filler'")  # space returns
        later = _oom_job(cluster, out)
        _settled(cluster, later, 1, "COMPLETED")
        assert plain_gres(cluster.client.require_job(later).tres_per_node) == plain_gres(exclusive_gres(cluster))
        entry = json.loads(_as_controller(cluster, f"cat '{ledger.dir}/{later}.0.json'"))  # in slurmctld's view
        assert entry["state"] == "done" and entry["steps"].count("boost") == 1
    finally:
        _as_controller(cluster, f"umount -l '{ledger.dir}' || true")


def test_observe_records_the_requeue_it_would_make_and_requeues_nothing(cluster):
    """``[policy] mode = "observe"`` (on this module's cluster for this test only; the hook reads the
    file per run): the OOM is decided as enforce would, recorded as "would have requeued with …" in the
    job's record, the ledger and its history, the oom log and the counter submitd exports, and the job
    stays as Slurm ended it: FAILED, not requeued, on its shards, its logs without a note or kept copy."""
    from prometheus_client import generate_latest

    from gpushare.oom_counts import read_counts
    from gpushare.slurm_plugins.submit_metrics import SubmitMetrics

    conf = cluster.gpushare_conf
    original = conf.read_text()
    conf.write_text(original.replace("[policy]\n", '[policy]\nmode = "observe"\n', 1) if "[policy]\n" in original
                    else original + '\n[policy]\nmode = "observe"\n')
    try:
        out = cluster.base / "oom-observe"
        out.mkdir(exist_ok=True)
        os.chmod(out, 0o777)
        message = (_tests_dir() / "messages" / "pos_pytorch_allocator_2x.txt").read_text()
        started = time.monotonic()
        job_id, _ = cluster.client.sbatch("--gres=shard:4", "-o", str(out / "job-%j.out"), "-e",
                                          str(out / "job-%j.err"),
                                          script=f"#!/bin/sh\ncat >&2 <<'EOF'\n{message}EOF\nexit 1\n")
        ledger = Ledger(cluster.config().oom.ledger_dir)
        deadline = time.monotonic() + scaled(60)
        while ledger.get(str(job_id), 0) is None:
            assert time.monotonic() < deadline, f"no decision for {job_id}: {_log(cluster)}"
            time.sleep(0.2)
        decided_s = time.monotonic() - started
        entry = ledger.get(str(job_id), 0)
        assert (entry["action"], entry["state"], plain_gres(entry["new_gres"])) == (
            "would_requeue", "observed", exclusive_gres(cluster)), entry
        time.sleep(1.0)  # were anything requeued, it would be held or pending by now
        job = cluster.client.require_job(job_id)
        assert (job.state, job.restarts, job.priority != 0) == ("FAILED", 0, True), job.states
        assert plain_gres(job.tres_per_node) == "shard:4"
        # the job's record: slurmctld refuses an AdminComment update once the job ended, and this cluster
        # has no slurmdbd, so the record says where it went (the database path: tests/accounting)
        record = parse_record(job.admin_comment) or {}
        if "oom_would" in record:
            would = record["oom_would"]
            assert (would["do"], plain_gres(would["to"]), plain_gres(would["from"])) == (
                "requeue", exclusive_gres(cluster), "shard:4"), job.admin_comment
        else:
            assert "recorded: nowhere in the job: no accounting database" in _log(cluster), _log(cluster)
        assert "oom" not in record  # no recovery recorded as made
        assert [h["event"] for h in ledger.history() if h["job"] == str(job_id)] == ["would_requeue"]
        assert "would have requeued with" in _log(cluster) and f"job {job_id}" in _log(cluster)
        assert read_counts(ledger.dir) == {"would_requeue": 1}
        assert 'gpushare_oom_recoveries_total{outcome="would_requeue"} 1.0' in \
            generate_latest(SubmitMetrics(str(ledger.dir)).registry).decode()
        assert "requeued" not in (out / f"job-{job_id}.err").read_text()  # no note to the user
        assert not list(out.glob("*.oom-run*"))  # no kept copy: nothing will truncate the log
        print(f"\nobserve: OOM decided and recorded {decided_s:.1f} s after submission")
    finally:
        conf.write_text(original)


def _tests_dir() -> Path:
    return Path(__file__).resolve().parent


def _log(cluster: LocalCluster) -> str:
    path = Path(cluster.config().oom.log_file)
    return path.read_text()[-3000:] if path.exists() else "(no oom.log)"
