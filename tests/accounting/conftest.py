"""Setup shared by the accounting modules that run the node agent beside slurmdbd (test_jobstats_slurm.py,
test_site_summary_slurm.py): the agent's test cluster of tests/agent/conftest.py, the ``[agent]`` settings
both give it, and one start and stop that leaves the cluster open to the job's user and shows the logs when a
test failed. Reached through the ``acct`` fixture: under ``--import-mode=importlib`` a test module has no
import path to this file.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest


@cache
def agent_helpers() -> Any:
    """tests/agent/conftest.py (AgentCluster, two_gpus), loaded once under its own name."""
    path = Path(__file__).parents[1] / "agent" / "conftest.py"
    spec = importlib.util.spec_from_file_location("gpushare_agent_test_helpers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def agent_toml(base: Path, extra: str = "") -> str:
    """The ``[agent]`` section: everything under ``base``, the simulated GPUs, quick sampling, no withholding."""
    return (f'[agent]\nstate_dir = "{base}/agent-state"\nrecords_dir = "{base}/records"\n'
            f'run_dir = "{base}/run-agent"\ndevice_backend = "sim:{base}/sim.json"\nwithhold = "none"\n'
            f"metrics_port = 0\nwindow_samples = 4\nsample_period_s = 0.25\nflush_every_s = 1.0\n"
            f'log_file = "{base}/log/agent.log"\n{extra}')


@contextmanager
def running(made: Any, request: pytest.FixtureRequest, more_logs: Sequence[Path] = ()) -> Iterator[Any]:
    """Start ``made`` (an AgentCluster) and its agent; stop it at the end. The cluster's folder is opened to
    the job's user, whose simulated processes register in sim.json (replaced atomically). After a failed
    test the logs' tails go to stderr and the folder is kept, else it is removed."""
    base: Path = made.base
    failed_before = request.session.testsfailed
    try:
        made.start()
        made.start_agent()
        os.chmod(base, 0o777)
        for name in ("sim.json", "sim.json.lock", "log/hooks.log"):
            (base / name).touch()
            os.chmod(base / name, 0o666)
        yield made
    finally:
        made.stop()
        if request.session.testsfailed > failed_before:
            for log in [*sorted((base / "log").glob("*")), *more_logs]:
                tail = log.read_text(errors="replace").splitlines()[-20:]
                sys.stderr.write(f"== {log.name}\n" + "\n".join(tail) + "\n")
        else:
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def acct() -> SimpleNamespace:
    """The helpers above, for the test modules' own cluster fixtures."""
    return SimpleNamespace(agent=agent_helpers(), agent_toml=agent_toml, running=running)
