"""Shared fixtures: real local Slurm clusters (Debian's munged/slurmctld/slurmd) with simulated GPUs.

``slurm_cluster``: one single-node cluster (n1, 2 × a100-40gb, our job_submit.lua and submitd, our
Prolog/Epilog/TaskProlog/EpilogSlurmctld) shared by the session, for tests that do not disturb it.
``make_cluster(...)``: a fresh cluster of any shape (two nodes, other policy) owned by one test.
Both skip with the reason when this machine cannot run Slurm (not root, packages missing). The Slurm version
is ``$GPUSHARE_TEST_SLURM`` (22.05 = the host's packages; 24.11 and 26.05 run from cached chroots, see
devcluster/chroot.py); every test using a cluster fixture is marked ``slurm`` so ``-m slurm`` reruns exactly
those on another version. Clusters
live in /tmp/gpushare-slurm-* (readable by the ordinary users some tests submit as); daemons are always
stopped; a cluster's directory is removed after passing tests and kept, with log tails printed, on failure.
"""

from __future__ import annotations

import os
import pwd
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devcluster.local_cluster import REPO, LocalCluster, missing_requirements
from devcluster.slurm_runtime import (ENV_VAR, OPEN_VIEW_VAR, SLURM_USER, checkout_out_of_reach, closed_folders,
                                     open_view_argv, requested_version)

BIN_DIR = os.path.dirname(sys.executable)
# Fixtures that start a real Slurm (here and in the sub-directories' conftests).
SLURM_FIXTURES = frozenset({"slurm_cluster", "make_cluster", "job_dir", "agent_cluster", "est_cluster"})


def pytest_report_header(config: pytest.Config) -> str:
    return f"Slurm for integration tests: {requested_version()} (${ENV_VAR})"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that starts a cluster through a fixture ``slurm``, however it got the fixture:
    ``make check`` leaves it out. A module whose tests start gpu-estimate captures (torch) says so itself
    (``pytestmark = pytest.mark.torch``), so renaming it keeps its tests out of the fast tier."""
    for item in items:
        if SLURM_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slurm)
        for mark in item.iter_markers("version_sensitive"):  # 24.11 runs only these: each says why
            reason = mark.args[0] if mark.args else mark.kwargs.get("reason", "")
            if not isinstance(reason, str) or not reason.strip():
                raise pytest.UsageError(f"{item.nodeid}: version_sensitive needs a reason (what differs by release)")


def pytest_configure(config: pytest.Config) -> None:
    """Where, as root, the Slurm account or an ordinary user cannot run this checkout's virtualenv (a clone in
    root's 0700 home): every hook, service and job of a test cluster runs it, and so do the tests that run a
    program as ``nobody`` (the agent writing a job's log as its user, the live socket's owner check), and each
    of those tests would fail as if the product were broken. Run the session again, before any test is
    collected or any worker started, in a private mount namespace in which the closed folders are searchable
    (on disk they stay as they are); where that cannot be done, stop at once with one line naming the folder
    and the way out (docs/testing.md). Not as another user: nothing then runs as anyone else."""
    if os.geteuid() != 0 or hasattr(config, "workerinput"):
        return
    users = ("nobody", *((SLURM_USER,) if _has_user(SLURM_USER) else ()))
    paths = (sys.executable, REPO)
    problem = checkout_out_of_reach(paths, users)
    if not problem:
        return
    if not os.environ.get(OPEN_VIEW_VAR) and shutil.which("unshare"):
        closed = sorted({c for p in paths for u in users for c in closed_folders(p, u)}, key=lambda c: len(c.parts))
        params = config.invocation_params
        argv = open_view_argv(closed, [REPO, Path(sys.prefix)], [sys.executable, "-m", "pytest", *params.args])
        if argv:
            capture = config.pluginmanager.getplugin("capturemanager")
            if capture is not None:
                capture.suspend_global_capture(in_=True)
            said = problem.split("from here: ", 1)[-1].split(" (hooks")[0]
            sys.stderr.write(f"{said}: the session runs again in a private mount namespace where "
                             f"{' '.join(map(str, closed))} are searchable (on disk they stay as they are)\n")
            sys.stderr.flush()
            os.chdir(params.dir)
            os.execvpe(argv[0], argv, {**os.environ, OPEN_VIEW_VAR: "1"})
    pytest.exit(problem, returncode=pytest.ExitCode.USAGE_ERROR)


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _require_slurm() -> None:
    problem = missing_requirements()
    if problem:
        pytest.skip(f"real Slurm unavailable: {problem}")


def _cluster_dir() -> Path:
    """Outside pytest's 0700 tmp tree: ordinary users must read slurm.conf and reach munged's socket."""
    return Path(tempfile.mkdtemp(prefix="gpushare-slurm-", dir="/tmp"))


def _finish(cluster: LocalCluster, failed: bool) -> None:
    cluster.stop()
    if failed:
        _dump_logs(cluster)
    else:
        shutil.rmtree(cluster.base, ignore_errors=True)


def _dump_logs(cluster: LocalCluster) -> None:
    sys.stderr.write(f"\n--- Slurm logs kept in {cluster.base / 'log'} ---\n")
    for log in sorted((cluster.base / "log").glob("*")):
        try:
            tail = log.read_text(errors="replace").splitlines()[-15:]
        except OSError:
            continue
        sys.stderr.write(f"== {log.name}\n" + "\n".join(tail) + "\n")


class FakeClock:
    """An injectable clock (docs/style.md #11): tests advance it instead of sleeping."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="session", autouse=True)
def private_warm_workers() -> Iterator[Path]:
    """gpu-estimate's warm workers (estimator_cli/warm_worker.py) of this session live in a runtime dir of
    its own and are stopped at its end, so none outlives the tests or meets a developer's own."""
    from gpushare.estimator_cli.warm_worker import private_runtime

    with private_runtime("gpushare-test-runtime-") as directory:
        yield directory


@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    _require_slurm()
    cluster = LocalCluster(_cluster_dir(), bin_dir=BIN_DIR)
    failed_before = request.session.testsfailed
    try:
        cluster.start()
        yield cluster
    finally:
        _finish(cluster, request.session.testsfailed > failed_before)


@pytest.fixture
def make_cluster(request: pytest.FixtureRequest) -> Iterator[Callable[..., LocalCluster]]:
    _require_slurm()
    made: list[LocalCluster] = []

    def _make(**kwargs: object) -> LocalCluster:
        cluster = LocalCluster(_cluster_dir(), bin_dir=BIN_DIR, **kwargs)  # type: ignore[arg-type]
        made.append(cluster)
        return cluster.start()

    failed_before = request.session.testsfailed
    yield _make
    for cluster in made:
        _finish(cluster, request.session.testsfailed > failed_before)


@pytest.fixture
def job_dir(slurm_cluster: LocalCluster, tmp_path: Path) -> Path:
    """A per-test directory for batch scripts and job output."""
    os.chmod(tmp_path, 0o755)
    return tmp_path
