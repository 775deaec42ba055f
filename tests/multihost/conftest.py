"""The multi-host test cluster (devcluster/multihost.py) for the tests of this folder.

Each test gets a cluster of its own (starting one takes about a second): controller, login, a CPU node, a GPU
node with files of its own and a configless MIG node, on the Slurm release ``GPUSHARE_TEST_SLURM`` names. The
configuration is the shipped one plus what a site must say: its CPU partition for estimation jobs, and the
simulated GPUs' backend. Nothing is shared between hosts but /home.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devcluster.multihost import Host, MultiHostCluster, read_description
from devcluster.slurm_runtime import missing_requirements

SITE_SETTINGS = '[estimation]\npartition = "cpu"\n'


@pytest.fixture
def multihost(request: pytest.FixtureRequest) -> Iterator[Callable[..., MultiHostCluster]]:
    problem = missing_requirements()
    if problem:
        pytest.skip(f"real Slurm unavailable: {problem}")
    made: list[MultiHostCluster] = []

    def _make(extra: str = "", agents: bool = False, accounting: bool = False,
              hosts: tuple[Host, ...] | None = None) -> MultiHostCluster:
        base = Path(tempfile.mkdtemp(prefix="gpushare-mh-"))  # outside pytest's root-only directory
        cluster = MultiHostCluster(base, hosts=hosts or read_description(), toml_extra=SITE_SETTINGS + extra,
                                   accounting=accounting)
        made.append(cluster)
        cluster.start()
        if agents:
            for host in cluster.with_role("gpu"):
                cluster.start_agent(host.name)
        return cluster

    failed_before = request.session.testsfailed
    yield _make
    for cluster in made:
        cluster.stop()
        if request.session.testsfailed > failed_before:
            sys.stderr.write(cluster.logs())
        else:
            import shutil

            shutil.rmtree(cluster.base, ignore_errors=True)

