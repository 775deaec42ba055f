"""Hostile users against asynchronous estimation, replayed on a real local Slurm.

- A forged estimate: another user submits a held decoy that writes a tiny ``result.json``, renames it
  ``gpushare-estimate-<victim id>`` with ``scontrol update name=`` while the victim's job waits for its
  estimation, and releases it. The victim must be sized by its own estimation job only.
- A poisoned row: a held job of the attacker's own named ``gpushare-estimate-²`` (a Unicode digit that
  ``str.isdigit`` accepts and ``int`` rejects) must not stop estimation for everyone, nor the watchdog.
- A squatted output: FIFOs made first at the estimation job's once-predictable output names in /tmp must
  not hang or fail the victim's estimation.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import time
from pathlib import Path

import pytest

from devcluster.local_cluster import LOGIN_TEST_USER, LocalCluster, ensure_login_user, missing_requirements
from devcluster.processes import scaled
from gpushare.slurm.gres_request import plain_gres
from gpushare.slurm_plugins.decision import parse_record
from gpushare.slurm_plugins.estimationd import EstimationService

pytestmark = [pytest.mark.slurm, pytest.mark.hostile]
ATTACKER = "gpushare-attacker"
SLEEPER = "# FAKE_SLEEP\n"


@pytest.fixture(scope="module", autouse=True)
def attacker() -> pwd.struct_passwd:
    """A second ordinary user, made before the cluster starts (26.05's chroot copies the accounts then)."""
    if missing_requirements():
        pytest.skip(f"real Slurm unavailable: {missing_requirements()}")
    return ensure_login_user(ATTACKER)


def as_user(cluster: LocalCluster, user: str, *argv: str, script: str | None = None) -> str:
    proc = subprocess.run(cluster.user_argv(user, list(argv)), input=script, capture_output=True, text=True,
                          env=cluster.env, timeout=30)
    assert proc.returncode == 0, f"{argv}: {proc.stderr}"
    return proc.stdout.strip()


def owned_dir(path: Path, user: pwd.struct_passwd, mode: int = 0o755) -> Path:
    path.mkdir(mode=mode)
    os.chown(path, user.pw_uid, user.pw_gid)
    return path


def record_of(cluster: LocalCluster, job_id: int) -> dict:
    job = cluster.client.job(job_id)
    assert job is not None, f"job {job_id} gone"
    return parse_record(job.admin_comment) or {}


def test_a_decoy_renamed_as_the_victims_estimation_does_not_size_it(est_cluster, est_root, user, attacker):
    victim_dir = owned_dir(est_root / "victim-work", user)
    for index in range(3):  # the victim's own estimations fill its cap: its next job waits without one
        (victim_dir / f"slow{index}.py").write_text(SLEEPER)
    (victim_dir / "train.py").write_text("# FAKE_PEAK_GIB=20\n")
    for name in os.listdir(victim_dir):
        os.chown(victim_dir / name, user.pw_uid, user.pw_gid)
    sbatch = ["sbatch", "--parsable", "--gres=gpu:1", "-D", str(victim_dir), "-o", "/dev/null"]
    sleepers = [as_user(est_cluster, LOGIN_TEST_USER, *sbatch, script=f"#!/bin/sh\npython slow{i}.py\n")
                for i in range(3)]
    victim = int(as_user(est_cluster, LOGIN_TEST_USER, *sbatch, script="#!/bin/sh\npython train.py\n"))
    time.sleep(2)  # a few estimation rounds: the victim stays held, with no estimation job of its own yet
    assert record_of(est_cluster, victim).get("est_job") is None, "the victim's cap did not hold it back"

    # A job of the attacker's own that looks like an estimation job: our output name, our job name, and a
    # result in its Comment as an estimation job leaves it (users may set their own jobs' comments).
    tiny = 'gpushare-estimate:{"v":1,"exit":0,"bytes":1073741824,"gpu":"a100-40gb"}'
    decoy = int(as_user(est_cluster, ATTACKER, "sbatch", "--parsable", "--hold", "-p", "cpu", "--mem=10",
                        "-D", "/tmp", "-o", f"/tmp/gpushare-estimate-999-{int(time.time())}.out",
                        script=f"#!/bin/sh\nscontrol update jobid=$SLURM_JOB_ID comment='{tiny}'\n").split(";")[0])
    as_user(est_cluster, ATTACKER, "scontrol", "update", f"jobid={decoy}", f"name=gpushare-estimate-{victim}")
    release = subprocess.run(est_cluster.user_argv(ATTACKER, ["scontrol", "release", str(decoy)]), capture_output=True,
                             text=True, env=est_cluster.env, timeout=30)
    # root may already have cancelled the renamed decoy (it carries our output name): the defence, not a failure
    assert release.returncode == 0 or "already finished" in release.stderr, release.stderr

    deadline = time.monotonic() + scaled(20)
    while time.monotonic() < deadline:  # the service cancels the decoy; the old one attached it
        assert record_of(est_cluster, victim).get("est_job") != decoy, "the decoy was attached to the victim"
        found = est_cluster.client.job(decoy)
        if found is None or found.state not in ("PENDING", "RUNNING", "CONFIGURING"):
            break
        time.sleep(0.3)

    subprocess.run(["scancel", *sleepers], env=est_cluster.env, check=False)  # the victim's turn comes
    deadline = time.monotonic() + scaled(90)
    while (final := record_of(est_cluster, victim)).get("decision") == "estimating":
        assert time.monotonic() < deadline, f"victim {victim} still held"
        time.sleep(0.3)
    own = est_cluster.client.job(final["est_job"])
    assert final["est_job"] != decoy and (own is None or own.user_id == user.pw_uid), final
    assert final["src"] == "async" and int(plain_gres(final["new"]).split(":")[1]) >= 20, final
    subprocess.run(["scancel", str(victim)], env=est_cluster.env, check=False)


def victim_job(cluster: LocalCluster, work: Path, user: pwd.struct_passwd, peak_gib: int) -> int:
    (work / "train.py").write_text(f"# FAKE_PEAK_GIB={peak_gib}\n")
    os.chown(work / "train.py", user.pw_uid, user.pw_gid)
    return int(as_user(cluster, LOGIN_TEST_USER, "sbatch", "--parsable", "--gres=gpu:1", "-D", str(work),
                       "-o", "/dev/null", script="#!/bin/sh\npython train.py\n"))


def wait_estimated(cluster: LocalCluster, job_id: int, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while (final := record_of(cluster, job_id)).get("decision") == "estimating":
        assert time.monotonic() < deadline, f"job {job_id} still held: {final}"
        time.sleep(0.3)
    return final


def test_a_job_named_with_a_unicode_digit_does_not_stop_estimation(est_cluster, est_root, user, attacker):
    poison = int(as_user(est_cluster, ATTACKER, "sbatch", "--parsable", "--hold", "-p", "cpu", "--mem=10",
                         "-D", "/tmp", "-o", "/dev/null", script="#!/bin/sh\ntrue\n").split(";")[0])
    try:
        as_user(est_cluster, ATTACKER, "scontrol", "update", f"jobid={poison}", "name=gpushare-estimate-\u00b2")
        service = EstimationService(est_cluster.config(), est_cluster.client)
        service.snapshot(discover=False)  # what the watchdog (--release-overdue) reads: the row is skipped
        assert service.skipped_rows >= 1
        victim = victim_job(est_cluster, owned_dir(est_root / "poison-victim", user), user, 7)
        final = wait_estimated(est_cluster, victim)
        assert final["src"] == "async" and int(plain_gres(final["new"]).split(":")[1]) >= 7, final
        subprocess.run(["scancel", str(victim)], env=est_cluster.env, check=False)
    finally:
        subprocess.run(["scancel", str(poison)], env=est_cluster.env, check=False)


def test_fifos_at_the_old_predictable_output_names_do_not_hang_the_estimation(est_cluster, est_root, user,
                                                                               attacker):
    work = owned_dir(est_root / "fifo-victim", user)
    started = int(time.time())
    victim = victim_job(est_cluster, work, user, 9)
    # the attacker's job on the CPU node gets there first: the service polls, sbatch and the start take longer
    fifos = [Path(f"/tmp/gpushare-estimate-{victim}-{started + d}.out") for d in (-1, 0, 1, 2)]
    for fifo in fifos:
        os.mkfifo(fifo, 0o666)
        os.chown(fifo, attacker.pw_uid, attacker.pw_gid)
    try:
        final = wait_estimated(est_cluster, victim)
        assert final["src"] == "async" and int(plain_gres(final["new"]).split(":")[1]) >= 9, final
        subprocess.run(["scancel", str(victim)], env=est_cluster.env, check=False)
    finally:
        for fifo in fifos:
            fifo.unlink(missing_ok=True)
