"""Shared fixtures: real local Slurm clusters (Debian's munged/slurmctld/slurmd) with simulated GPUs.

``slurm_cluster``: one single-node cluster (n1, 2 × a100-40gb, our job_submit.lua and submitd, our
Prolog/Epilog/TaskProlog/EpilogSlurmctld) shared by the session, for tests that do not disturb it.
``make_cluster(...)``: a fresh cluster of any shape (two nodes, other policy) owned by one test.
Both skip with the reason when this machine cannot run Slurm (not root, packages missing). Daemons
are always stopped; logs stay under pytest's tmp directory and their tails are printed on failure.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from slurm_plugins.local_cluster import LocalCluster, missing_requirements

BIN_DIR = os.path.dirname(sys.executable)


def _require_slurm() -> None:
    problem = missing_requirements()
    if problem:
        pytest.skip(f"real Slurm unavailable: {problem}")


def _dump_logs(cluster: LocalCluster) -> None:
    sys.stderr.write(f"\n--- Slurm logs kept in {cluster.base / 'log'} ---\n")
    for log in sorted((cluster.base / "log").glob("*")):
        try:
            tail = log.read_text(errors="replace").splitlines()[-15:]
        except OSError:
            continue
        sys.stderr.write(f"== {log.name}\n" + "\n".join(tail) + "\n")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    _require_slurm()
    cluster = LocalCluster(tmp_path_factory.mktemp("slurm"), bin_dir=BIN_DIR)
    failed_before = request.session.testsfailed
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        if request.session.testsfailed > failed_before:
            _dump_logs(cluster)


@pytest.fixture
def make_cluster(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Callable[..., LocalCluster]]:
    _require_slurm()
    made: list[LocalCluster] = []

    def _make(**kwargs: object) -> LocalCluster:
        cluster = LocalCluster(tmp_path_factory.mktemp("slurm"), bin_dir=BIN_DIR, **kwargs)  # type: ignore[arg-type]
        made.append(cluster)
        return cluster.start()

    failed_before = request.session.testsfailed
    yield _make
    for cluster in made:
        cluster.stop()
        if request.session.testsfailed > failed_before:
            _dump_logs(cluster)


@pytest.fixture
def job_dir(slurm_cluster: LocalCluster, tmp_path: Path) -> Path:
    """A per-test directory for batch scripts and job output."""
    os.chmod(tmp_path, 0o755)
    return tmp_path
