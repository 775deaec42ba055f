"""Faults around the submit service and asynchronous estimation on a real Slurm (docs/reliability.md).

gpushare-submitd is killed with SIGKILL (under a submit burst; while it holds jobs for estimation; at the
two points where a crash leaves work half done) and restarted as its unit restarts it (``Restart=always``,
``RestartSec=1``); slurmctld is restarted while jobs are held. Each test asserts that every job is still
there, that none waited past the documented limit, that a held job is released only with its decision
and that no job is estimated twice (the stand-in estimator logs every run it makes).

The single-host cluster of tests/estimation (one GPU node, one CPU node for the estimation jobs): both faults
are the controller's, the one host they touch, and this cluster starts in seconds.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from gpushare.slurm import record as record_format
from gpushare.slurm.admin_comment import merge_fields, merge_write
from gpushare.slurm.gres_request import plain_gres
from gpushare.slurm_plugins.decision import parse_record
from gpushare.slurm_plugins.estimation_plan import ESTIMATION_JOB_PREFIX
from devcluster.local_cluster import LOGIN_TEST_USER, LocalCluster
from devcluster.processes import scaled

pytestmark = [pytest.mark.slurm, pytest.mark.faults]

STUBS = "python() { true; }\n"  # the job itself only has to start and exit 0
SHIM_LIMIT_S = 5.0  # one sbatch, shim deadline ([submit] timeout_ms = 250) and a loaded 2-core host included


def write(work: Path, name: str, text: str, user: Any) -> None:
    path = work / name
    path.write_text(text)
    os.chown(path, user.pw_uid, user.pw_gid)


def submit(cluster: LocalCluster, work: Path, body: str, *args: str) -> tuple[int, float]:
    """Submit as the test user; returns the job id and how long sbatch took."""
    started = time.monotonic()
    proc = subprocess.run(cluster.user_argv(LOGIN_TEST_USER, ["sbatch", "--parsable", "--gres=gpu:1", "-D", str(work),
                                                             "-o", "/dev/null", *args]),
                          input="#!/bin/sh\n" + body, capture_output=True, text=True, env=cluster.env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip().split(";")[0]), time.monotonic() - started


def record(cluster: LocalCluster, job_id: int) -> dict[str, Any]:
    return parse_record(cluster.client.require_job(job_id).admin_comment) or {}


def runs(work: Path) -> list[str]:
    """The training scripts the stand-in estimator ran, one line per run."""
    path = work / "fake-estimate-runs.log"
    return path.read_text().split() if path.exists() else []


def estimation_jobs_for(cluster: LocalCluster, job_id: int) -> list[Any]:
    return [j for j in cluster.client.jobs() if j.name == f"{ESTIMATION_JOB_PREFIX}{job_id}"]


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


def estimation_loop(submitd: int) -> int | None:
    """The pid of the estimation process ``submitd`` supervises."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"gpushare.slurm_plugins.estimation_process" in argv and str(submitd).encode() in argv:
            return int(entry)
    return None


def kill_submitd(cluster: LocalCluster) -> None:
    """SIGKILL the service (its main process only, as a crash would); the kernel ends its estimation loop."""
    pid = cluster.pids.pop("submitd")
    loop = estimation_loop(pid)
    os.kill(pid, signal.SIGKILL)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # reaped already: subprocess reaps the harness's discarded Popen children
        pass                   # whenever another thread (the submitting ones) starts a process
    if loop is not None:
        wait_for(lambda: not Path(f"/proc/{loop}").exists() or b"zombie" in _status(loop), 15,
                 f"estimation loop {loop} outlived its killed service")


def _status(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/status").read_bytes().lower()
    except OSError:
        return b"zombie"


def restart_submitd(cluster: LocalCluster) -> None:
    """What systemd does after the crash (``RestartSec=1``); returns once the new service answers."""
    time.sleep(1.0)
    cluster.start_submitd()

    def answers() -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(cluster.submitd_socket))
            except OSError:
                return False
        return True
    wait_for(answers, 15, "gpushare-submitd did not answer after its restart")


def test_submitd_killed_in_a_submit_burst_fails_open_and_loses_no_job(est_cluster, work, user):
    """24 GPU jobs from 8 threads; the service is killed after the first few answers, jobs keep coming while
    it is down, then it is restarted. Every sbatch returns within the shim's bound, every job exists once:
    decided (a record) or accepted unchanged (none), and the service decides again after its restart."""
    body = "#GPUSHARE mem=3G\ntrue\n"
    results: dict[str, list[tuple[int, float]]] = {"burst": [], "down": [], "after": []}
    lock = threading.Lock()

    def one(phase: str) -> None:
        got = submit(est_cluster, work, body, "--hold")
        with lock:
            results[phase].append(got)

    try:
        with ThreadPoolExecutor(8) as pool:
            burst = [pool.submit(one, "burst") for _ in range(12)]
            wait_for(lambda: len(results["burst"]) >= 3, 60, "no answer in the burst")
            kill_submitd(est_cluster)
            for future in burst:
                future.result()
            list(pool.map(lambda _: one("down"), range(4)))
            restart_submitd(est_cluster)
            list(pool.map(lambda _: one("after"), range(8)))
        every = [job for phase in results.values() for job, _ in phase]
        assert len(every) == len(set(every)) == 24
        slowest = max(took for phase in results.values() for _, took in phase)
        print(f"submitd SIGKILL in a burst: 24 jobs, slowest sbatch {slowest:.2f} s")
        assert slowest < SHIM_LIMIT_S
        queued = {int(j.job_id): j for j in est_cluster.client.jobs()}
        assert set(every) <= set(queued)
        for job_id, _ in results["down"]:  # the shim failed open: accepted unchanged, not held by us
            assert not parse_record(queued[job_id].admin_comment) and plain_gres(queued[job_id].tres_per_node) == "gpu:1"
        for job_id, _ in results["after"]:  # the restarted service decides again
            assert (parse_record(queued[job_id].admin_comment) or {}).get("decision"), queued[job_id]
        for job_id, _ in [*results["burst"], *results["after"]]:  # decided and applied, or untouched: never half
            decided = parse_record(queued[job_id].admin_comment) or {}
            expected = plain_gres(decided["new"]) if decided.get("new") else "gpu:1"
            assert plain_gres(queued[job_id].tres_per_node) == expected, (queued[job_id], decided)
    finally:
        if "submitd" not in est_cluster.pids:
            restart_submitd(est_cluster)
        ids = [str(job) for phase in results.values() for job, _ in phase]
        if ids:
            est_cluster.client.run("scancel", *ids, check=False)


def test_submitd_killed_while_holding_jobs_estimates_each_once(est_cluster, work, user):
    """Three held jobs with their estimation jobs running; the service is killed and restarted. The new
    service adopts the running estimation jobs (no second one), releases each job with the estimate its own
    estimation job produced, and nothing is released while it is down."""
    for n in range(3):
        write(work, f"train{n}.py", f"# FAKE_PEAK_GIB={2 + n}\n# FAKE_SLEEP_S=8\n", user)
    ids = [submit(est_cluster, work, STUBS + f"python train{n}.py\n")[0] for n in range(3)]
    wait_for(lambda: all(isinstance(record(est_cluster, j).get("est_job"), int) for j in ids), 60,
             "estimation jobs not attached")
    attached = {j: record(est_cluster, j)["est_job"] for j in ids}
    kill_submitd(est_cluster)
    try:
        time.sleep(2.0)
        assert all(record(est_cluster, j)["decision"] == "estimating" for j in ids)  # nobody released them
    finally:
        restart_submitd(est_cluster)
    wait_for(lambda: all(record(est_cluster, j)["decision"] != "estimating" for j in ids), 90, "still held")
    for n, job_id in enumerate(ids):
        final = record(est_cluster, job_id)
        assert final["decision"] == "shared" and final["src"] == "async" and final["est_job"] == attached[job_id]
        assert plain_gres(final["new"]) == f"shard:{3 + n}" and "releasing" not in final
        assert [int(j.job_id) for j in estimation_jobs_for(est_cluster, job_id)] == [attached[job_id]]
        assert est_cluster.wait_job(job_id, timeout_s=60).state == "COMPLETED"
    assert sorted(runs(work)) == ["train0.py", "train1.py", "train2.py"]  # each estimated once


def test_submitd_killed_as_it_submits_an_estimation_job_never_estimates_twice(est_cluster, work, user):
    """Killed the moment the estimation job appears in the queue (before or after its mark and est_job
    are written, as the timing falls): the restarted service adopts it or cancels it unrun, and the
    job is estimated once."""
    write(work, "train.py", "# FAKE_PEAK_GIB=2\n# FAKE_SLEEP_S=3\n", user)
    job_id, _ = submit(est_cluster, work, STUBS + "python train.py\n")
    try:
        deadline = time.monotonic() + scaled(60)
        while not estimation_jobs_for(est_cluster, job_id):
            assert time.monotonic() < deadline, "no estimation job submitted"
            time.sleep(0.02)
        kill_submitd(est_cluster)
    finally:
        restart_submitd(est_cluster)
    wait_for(lambda: record(est_cluster, job_id)["decision"] != "estimating", 90, "still held")
    final = record(est_cluster, job_id)
    assert final["decision"] == "shared" and final["src"] == "async" and plain_gres(final["new"]) == "shard:3"
    assert est_cluster.wait_job(job_id, timeout_s=60).state == "COMPLETED"
    assert runs(work) == ["train.py"]
    others = [j for j in estimation_jobs_for(est_cluster, job_id) if int(j.job_id) != final["est_job"]]
    assert all(j.state == "CANCELLED" for j in others), others


def _stopped_loop(cluster: LocalCluster) -> int:
    """SIGSTOP the running service's estimation loop (submit answers go on); returns its pid."""
    loop = estimation_loop(cluster.pids["submitd"])
    assert loop is not None
    os.kill(loop, signal.SIGSTOP)
    return loop


def _crash_with_stopped_loop(cluster: LocalCluster, loop: int) -> None:
    """The service dies with its loop: the stopped loop first (it would finish its round on SIGTERM)."""
    os.kill(loop, signal.SIGKILL)
    kill_submitd(cluster)


def test_a_crash_between_an_estimation_jobs_submission_and_its_mark_runs_it_never(est_cluster, work, user):
    """The state a crash right after ``sbatch`` leaves: an estimation job for the held job, submitted held by
    root and not yet marked. The restarted service cancels it unrun and submits one of its own."""
    write(work, "train.py", "# FAKE_PEAK_GIB=2\n# FAKE_SLEEP_S=1\n", user)
    loop = _stopped_loop(est_cluster)
    try:
        job_id, _ = submit(est_cluster, work, STUBS + "python train.py\n")
        assert record(est_cluster, job_id)["decision"] == "estimating"
        orphan, _ = est_cluster.client.sbatch(
            f"--uid={user.pw_uid}", f"--gid={user.pw_gid}", "--partition=cpu", f"--job-name={ESTIMATION_JOB_PREFIX}{job_id}",
            "--hold", "--output=/dev/null", f"--chdir={work}", "--export=NONE",
            script=f"#!/bin/sh\necho orphan >> {work}/fake-estimate-runs.log\n")
        assert est_cluster.client.require_job(orphan).reason == "JobHeldUser"  # as root's sbatch --uid --hold
    finally:
        _crash_with_stopped_loop(est_cluster, loop)
        restart_submitd(est_cluster)
    wait_for(lambda: record(est_cluster, job_id)["decision"] != "estimating", 90, "still held")
    final = record(est_cluster, job_id)
    assert final["decision"] == "shared" and final["src"] == "async" and final["est_job"] != orphan
    assert est_cluster.client.require_job(orphan).state == "CANCELLED"
    assert runs(work) == ["train.py"]  # the new estimation job's run; the orphan never ran
    assert est_cluster.wait_job(job_id, timeout_s=60).state == "COMPLETED"


def test_a_crash_between_a_jobs_decision_and_its_release_is_finished_on_restart(est_cluster, work, user):
    """The state a crash inside a release leaves: the job's request resized and its final record written
    (with ``releasing``), ``scontrol release`` not yet run. Before, nothing ever released such a job (its
    record no longer said "estimating", so neither the loop nor the watchdog looked at it)."""
    write(work, "train.py", "# FAKE_PEAK_GIB=2\n# FAKE_SLEEP_S=1\n", user)
    loop = _stopped_loop(est_cluster)
    try:
        job_id, _ = submit(est_cluster, work, STUBS + "python train.py\n")
        held = record(est_cluster, job_id)
        assert held["decision"] == "estimating"
        final = dict(held, decision="shared", new="gres:shard:3", src="async", held_s=1.0)
        est_cluster.client.update_job(job_id, gres="shard:3")
        assert merge_write(est_cluster.client, job_id, merge_fields(**final, releasing=1))
    finally:
        _crash_with_stopped_loop(est_cluster, loop)
        restart_submitd(est_cluster)
    done = est_cluster.wait_job(job_id, timeout_s=60)
    assert done.state == "COMPLETED" and plain_gres(done.tres_per_node) == "shard:3"
    kept = parse_record(done.admin_comment) or {}
    assert kept["decision"] == "shared" and kept["held_s"] == 1.0 and "releasing" not in kept
    assert runs(work) == []  # decided once: never estimated again
    assert record_format.parse(done.admin_comment) is not None


def test_slurmctld_restarted_while_jobs_are_held_each_converges_once(est_cluster, work, user):
    """slurmctld restarted (state recovered from StateSaveLocation) while three jobs wait: one with its
    estimation job running, two just submitted. Each is estimated once and released with its estimate."""
    for n in range(3):
        write(work, f"train{n}.py", f"# FAKE_PEAK_GIB={2 + n}\n# FAKE_SLEEP_S=5\n", user)
    first, _ = submit(est_cluster, work, STUBS + "python train0.py\n")
    wait_for(lambda: isinstance(record(est_cluster, first).get("est_job"), int), 60, "no estimation job")
    ids = [first] + [submit(est_cluster, work, STUBS + f"python train{n}.py\n")[0] for n in (1, 2)]
    started = time.monotonic()
    est_cluster.restart_controller()
    wait_for(lambda: all(record(est_cluster, j)["decision"] != "estimating" for j in ids), 120, "still held")
    print(f"slurmctld restart with 3 held jobs: converged {time.monotonic() - started:.1f} s after it")
    for n, job_id in enumerate(ids):
        final = record(est_cluster, job_id)
        assert final["decision"] == "shared" and final["src"] == "async" and plain_gres(final["new"]) == f"shard:{3 + n}"
        assert [int(j.job_id) for j in estimation_jobs_for(est_cluster, job_id)] == [final["est_job"]]
        assert est_cluster.wait_job(job_id, timeout_s=60).state == "COMPLETED"
    assert sorted(runs(work)) == ["train0.py", "train1.py", "train2.py"]


def test_an_estimation_that_ends_while_slurmctld_is_down_still_sizes_its_job(est_cluster, work, user):
    """slurmctld stopped while an estimation job runs and started again after its estimate is done: the
    result still reaches the controller (the job's last step, ``scontrol update comment=``, is Slurm's client,
    which waits for the controller), so the job is released with its estimate, not with the fallback."""
    write(work, "train.py", "# FAKE_PEAK_GIB=3\n# FAKE_SLEEP_S=3\n", user)
    job_id, _ = submit(est_cluster, work, STUBS + "python train.py\n")
    wait_for(lambda: any(j.state == "RUNNING" for j in estimation_jobs_for(est_cluster, job_id)), 60,
             "estimation job not running")
    est_cluster.stop_process("slurmctld")
    try:
        wait_for(lambda: runs(work) == ["train.py"], 30, "the estimator did not run")
        time.sleep(6.0)  # the estimate is done; its result waits for the controller
    finally:
        est_cluster.restart_controller()
    wait_for(lambda: record(est_cluster, job_id)["decision"] != "estimating", 90, "still held")
    final = record(est_cluster, job_id)
    assert final["decision"] == "shared" and final["src"] == "async" and plain_gres(final["new"]) == "shard:4", final
    assert runs(work) == ["train.py"]
