"""A local Slurm with a CPU partition and asynchronous estimation on, and a non-root user to submit as.

The estimator command is a small shell stand-in (``fake-estimate``) so most tests take seconds: it reads
``# FAKE_PEAK_GIB=N`` / ``# FAKE_FAIL`` / ``# FAKE_SLEEP`` / ``# FAKE_SLEEP_S=N`` from the training script,
records who ran it (and each run in ``fake-estimate-runs.log`` of the job's working directory), and
otherwise hands over to the real ``gpu-estimate``. Everything a non-root user must reach (munge socket,
slurm.conf, work and spool directories) lives under one traversable directory outside pytest's own.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from types import SimpleNamespace

from devcluster.local_cluster import LOGIN_TEST_USER, LocalCluster, ensure_login_user, missing_requirements

BIN_DIR = os.path.dirname(sys.executable)
TEST_USER = LOGIN_TEST_USER
# The real estimator the test user runs: ours, unless its Python sits under a private home (pyenv in /root);
# then GPUSHARE_TEST_ESTIMATOR names a gpu-estimate from a virtual environment other users can execute.
REAL_ESTIMATOR = os.environ.get("GPUSHARE_TEST_ESTIMATOR") or f"{BIN_DIR}/gpu-estimate"
# Researchers' venvs with other PyTorch releases (`make python-envs`), seen by the jobs inside the chroots too.
PYTHON_ENVS = os.environ.get("GPUSHARE_PYTHON_ENVS", "/var/cache/gpushare/python-envs")

FAKE_ESTIMATE = """#!/bin/sh
# Test stand-in for gpu-estimate: the last argument before the script's own is the training script.
for arg in "$@"; do case "$arg" in *.py) script="$arg"; break;; esac; done
echo "ran-as-uid=$(id -u)" >&2
if grep -q '^# FAKE_FAIL' "$script"; then echo 'gpu-estimate: the script failed: boom' >&2; exit 3; fi
echo "$script" >> fake-estimate-runs.log  # in the job's working directory: what ran, once per run
if grep -q '^# FAKE_SLEEP$' "$script"; then sleep 600; fi
pause=$(sed -n 's/^# FAKE_SLEEP_S=\\([0-9]*\\).*/\\1/p' "$script")
if [ -n "$pause" ]; then sleep "$pause"; fi
peak=$(sed -n 's/^# FAKE_PEAK_GIB=\\([0-9]*\\).*/\\1/p' "$script")
if [ -n "$peak" ]; then
  echo "{\\"targets\\": [{\\"gpu\\": \\"a100-40gb\\", \\"peak_total_bytes\\": $((peak * 1073741824))}]}"
  exit 0
fi
exec @REAL@ "$@"
"""


def user_can_run_estimator(cluster: LocalCluster) -> str | None:
    """Why the test user cannot run the real gpu-estimate where the cluster's jobs run (its Python under a
    0700 home), or None."""
    proc = subprocess.run(cluster.user_argv(TEST_USER, [REAL_ESTIMATOR, "--help"]), capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    return (f"{REAL_ESTIMATOR} not usable by {TEST_USER} ({proc.stderr.strip()[-120:]}); "
            "set GPUSHARE_TEST_ESTIMATOR to a gpu-estimate other users can run")


@pytest.fixture(scope="module")
def user() -> pwd.struct_passwd:
    if missing_requirements():
        pytest.skip(f"real Slurm unavailable: {missing_requirements()}")
    if not shutil.which("runuser") or not shutil.which("useradd"):
        pytest.skip("needs runuser and useradd to submit as a non-root user")
    return ensure_login_user(TEST_USER)


def estimation_toml(spool: Path, fake: Path, extra: str = "") -> str:
    return (f'[estimation]\npartition = "cpu"\ncpus = 1\nmemory = "300M"\ntime_limit_s = 120\n'
            f'max_per_user = 3\nmax_total = 4\npoll_s = 0.5\nspool_dir = "{spool}"\ncommand = "{fake}"\n{extra}')


@pytest.fixture(scope="module")
def est_root(user: pwd.struct_passwd) -> Iterator[Path]:
    """A directory outside pytest's own: pytest resets /tmp/pytest-of-<user> to 0700 whenever any pytest
    session starts, which would lock the test user out of a cluster in the middle of a run."""
    root = Path(tempfile.mkdtemp(prefix="gpushare-estimation-"))
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def est_cluster(user: pwd.struct_passwd, est_root: Path, request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    base = est_root
    spool = base / "spool"
    fake = base / "fake-estimate"
    fake.write_text(FAKE_ESTIMATE.replace("@REAL@", REAL_ESTIMATOR))
    os.chmod(fake, 0o755)
    cluster = LocalCluster(base / "c", bin_dir=BIN_DIR, cpu_nodes=("c1",), toml_extra=estimation_toml(spool, fake),
                           extra_binds=tuple(p for p in (PYTHON_ENVS,) if os.path.isdir(p)))
    failed_before = request.session.testsfailed
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        if request.session.testsfailed > failed_before:
            _dump_logs(cluster)
            kept = Path(tempfile.gettempdir()) / f"kept-{base.name}"
            shutil.copytree(base / "c" / "log", kept, dirs_exist_ok=True)
            sys.stderr.write(f"logs copied to {kept}\n")


@pytest.fixture
def work(est_root: Path, user: pwd.struct_passwd, request: pytest.FixtureRequest) -> Path:
    """A working directory the test user owns (jobs write their output there), one per test."""
    path = est_root / f"work-{request.node.name}"
    path.mkdir(mode=0o755)
    os.chown(path, user.pw_uid, user.pw_gid)
    return path


def _dump_logs(cluster: LocalCluster) -> None:
    sys.stderr.write(f"\n--- logs kept in {cluster.base / 'log'} ---\n")
    for log in sorted((cluster.base / "log").glob("*")):
        tail = log.read_text(errors="replace").splitlines()[-25:]
        sys.stderr.write(f"== {log.name}\n" + "\n".join(tail) + "\n")


@pytest.fixture(scope="session")
def helpers() -> SimpleNamespace:
    """The helpers above, for test modules (importlib mode gives them no import path to this file)."""
    return SimpleNamespace(user_name=TEST_USER, estimation_toml=estimation_toml,
                           user_can_run_estimator=user_can_run_estimator)
