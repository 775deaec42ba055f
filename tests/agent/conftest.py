"""Fixtures for the node-agent tests (the fake ``clock`` is in tests/conftest.py): simulated GPUs, and
a real local Slurm whose Prolog/TaskProlog/Epilog and node agent all use one simulated GPU state file.

``agent_cluster(**kw)`` starts a LocalCluster (n1, 2 × a100-40gb) configured for the agent: nodes carry the
withholding feature plus the hidden FUTURE standby node that ``gpushare slurm-config`` generates, the
agent section points every hook at ``sim:<base>/sim.json``, and ``cluster.start_agent()`` /
``stop_agent()`` run ``gpushare-agent`` as a real daemon.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpushare.gres.sim_backend import SimBackend
from gpushare.node.api import AgentUnavailable, call
from gpushare.node.withhold import STANDBY_PREFIX, NodeFeature, standby_node_line
from devcluster.local_cluster import LocalCluster, missing_requirements

sys.path.insert(0, str(Path(__file__).parent))  # the tests' shared helpers (lane_log) under --import-mode=importlib
BIN_DIR = os.path.dirname(sys.executable)
FEATURE = "gpushare_open"


def two_gpus(**gpu: Any) -> dict[str, Any]:
    return {"version": 1, "name": "agent-test", "processes": [],
            "gpus": [{"model": "a100-40gb", **gpu}, {"model": "a100-40gb", **gpu}]}


class AgentCluster(LocalCluster):
    """LocalCluster plus what the agent needs; everything else as the shared fixtures have it."""

    agent_proc: subprocess.Popen | None = None

    @property
    def sim_state(self) -> Path:
        return self.base / "sim.json"

    def agent_cfg(self) -> Any:
        return self.config().agent

    def _slurm_conf(self, cfg: Any) -> str:
        text = super()._slurm_conf(cfg)
        text = text.replace(" State=UNKNOWN", f" Features={FEATURE} State=UNKNOWN")
        standby = standby_node_line("gpu", FEATURE, "gpu:a100-40gb:2,shard:80", cpus=max(2, os.cpu_count() or 2),
                                    real_memory_mb=4000)
        nodes = ",".join(self.node_names)
        return text.replace(f"PartitionName=gpu Nodes={nodes}",
                            f"{standby}\nPartitionName=gpu Nodes={nodes},{STANDBY_PREFIX}gpu")

    def backend(self) -> SimBackend:
        return SimBackend.open(self.sim_state)

    def start_agent(self) -> None:
        log = open(self.base / "log" / "agent.out", "ab")
        # Beside slurmd (in its chroot for newer Slurm): the agent calls scontrol like a node daemon does.
        argv = self.argv([f"{BIN_DIR}/gpushare-agent", "--node", "n1", "--log-level", "DEBUG"])
        self.agent_proc = subprocess.Popen(argv,
                                           env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self._wait(self.agent_answers, 15, "gpushare-agent did not answer")

    @property
    def agent_socket(self) -> Path:
        return Path(self.agent_cfg().run_dir) / "agent" / "agent.sock"

    def agent_answers(self) -> bool:
        try:
            return bool(call(self.agent_socket, {"op": "ping"}, timeout_s=1.0).get("ok"))
        except AgentUnavailable:
            return False

    def stop_agent(self, sig: int = signal.SIGTERM) -> None:
        if self.agent_proc is None:
            return
        self.agent_proc.send_signal(sig)
        try:
            self.agent_proc.wait(10)
        except subprocess.TimeoutExpired:
            self.agent_proc.kill()
            self.agent_proc.wait(5)
        self.agent_proc = None

    def stop(self) -> None:
        self.stop_agent()
        super().stop()

    def node_features(self) -> list[str]:
        return NodeFeature(self.client, "n1", FEATURE).read()[1]

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float, what: str,
                 seen: Callable[[], object] | None = None) -> None:
        """Wait for ``predicate`` (deadline scaled to the machine's load); a time-out says ``what`` was awaited
        and what ``seen()`` shows then."""
        self._wait(predicate, timeout_s, what, seen)


@pytest.fixture
def agent_cluster(tmp_path_factory: pytest.TempPathFactory,
                  request: pytest.FixtureRequest) -> Iterator[Callable[..., AgentCluster]]:
    problem = missing_requirements()
    if problem:
        pytest.skip(f"real Slurm unavailable: {problem}")
    made: list[AgentCluster] = []
    outside: list[Path] = []

    def _make(window_samples: int = 4, period_s: float = 0.25, extra: str = "", start_agent: bool = True,
              scenario: dict[str, Any] | None = None, withhold: str = "feature") -> AgentCluster:
        # outside pytest's base directory, which pytest keeps (and resets to) root-only: ordinary users and
        # slurmctld, which runs as slurm, must reach the cluster's files
        base = Path(tempfile.mkdtemp(prefix="gpushare-agent-", dir="/tmp"))
        outside.append(base)
        os.chmod(base, 0o755)
        toml = (f'[agent]\nstate_dir = "{base}/agent-state"\nrecords_dir = "{base}/records"\n'
                f'run_dir = "{base}/run-agent"\ndevice_backend = "sim:{base}/sim.json"\nwithhold = "{withhold}"\n'
                f"metrics_port = 0\nwindow_samples = {window_samples}\nsample_period_s = {period_s}\n"
                f'flush_every_s = 1.0\nlog_file = "{base}/log/agent.log"\n{extra}\n')
        SimBackend.from_scenario(scenario or two_gpus(), base / "sim.json")
        cluster = AgentCluster(base, bin_dir=BIN_DIR, toml_extra=toml)
        made.append(cluster)
        cluster.start()
        if start_agent:
            cluster.start_agent()
        return cluster

    failed_before = request.session.testsfailed
    yield _make
    for cluster in made:
        cluster.stop()
        if request.session.testsfailed > failed_before:
            for log in sorted((cluster.base / "log").glob("*")):
                tail = log.read_text(errors="replace").splitlines()[-25:]
                sys.stderr.write(f"== {log.name}\n" + "\n".join(tail) + "\n")
    for base in outside:
        shutil.rmtree(base, ignore_errors=True)
