"""The README's demo command works: estimate on the CPU, submit with plain sbatch, job on a shard."""

from __future__ import annotations

import subprocess
import sys

import pytest

from devcluster.local_cluster import missing_requirements
from devcluster.slurm_runtime import requested_version, tres

pytestmark = pytest.mark.slurm


@pytest.mark.version_sensitive("TresPerNode is spelled gres:shard (22.05) or gres/shard (23.02+)")
def test_demo_runs_end_to_end():
    problem = missing_requirements()
    if problem:
        pytest.skip(problem)
    result = subprocess.run([sys.executable, "-m", "devcluster.demo"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    version = requested_version()  # the demo runs on the same Slurm as the tests
    assert f"TresPerNode={tres(version, 'shard:')}" in out and "decision=shared" in out
    assert "SLURM_SHARDS_ON_NODE=" in out and f"TresPerNode={tres(version, 'gpu:1')}" in out
