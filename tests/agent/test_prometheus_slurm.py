"""A real Prometheus scrapes the agents of two GPU nodes of a real local Slurm; every query of the shipped
Grafana dashboard (etc/grafana/gpushare-dashboard.json) returns series.

Two nodes on one host: each node's agent has its own run, state and records directories, simulated GPUs and
metrics address (127.0.0.2, 127.0.0.3: the whole of 127.0.0.0/8 is loopback on Linux), set through the
``GPUSHARE_AGENT_*`` environment overrides. The hook wrappers and the jobs pick their node's overrides by
``$SLURMD_NODENAME``, as the hooks on two real hosts would each read their own host's configuration.
The agents keep the shipped defaults except what two nodes on one host need (paths, addresses) and a faster
sampling period; withholding is off (``withhold = "none"``) because the feature it toggles belongs to a
single-node fixture (tests/agent/conftest.py) and plays no part in what the metrics are.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster.local_cluster import REPO, LocalCluster, missing_requirements
from devcluster.prometheus import Prometheus, free_port, nodes_of
from gpushare.node.api import AgentUnavailable, call
from gpushare.gres.sim_backend import SimBackend

pytestmark = pytest.mark.slurm
BIN_DIR = os.path.dirname(sys.executable)
SIMJOB = Path(__file__).with_name("simjob.py")
DASHBOARD = REPO / "etc" / "grafana" / "gpushare-dashboard.json"
ADDRESSES = {"n1": "127.0.0.2", "n2": "127.0.0.3"}


class TwoAgentCluster(LocalCluster):
    """Two GPU nodes, each with its own agent; hooks and jobs source ``etc/node-<name>.env``."""

    agents: dict[str, subprocess.Popen[bytes]]
    metrics: dict[str, str]

    def node_env_file(self, node: str) -> Path:
        return self.base / "etc" / f"node-{node}.env"

    def node_env(self, node: str) -> dict[str, str]:
        return {f"GPUSHARE_AGENT_{key.upper()}": value for key, value in (
            ("run_dir", f"{self.base}/run-agent-{node}"), ("state_dir", f"{self.base}/agent-state-{node}"),
            ("records_dir", f"{self.base}/records-{node}"), ("device_backend", f"sim:{self.base}/sim-{node}.json"),
            ("log_file", f"{self.base}/log/agent-{node}.log"), ("node_name", node),
            ("metrics_address", self.metrics[node].rsplit(":", 1)[0]),
            ("metrics_port", self.metrics[node].rsplit(":", 1)[1]))}

    def write_files(self) -> None:
        self.metrics = {node: f"{ADDRESSES[node]}:{free_port(ADDRESSES[node])}" for node in self.node_names}
        super().write_files()
        for node in self.node_names:
            self.node_env_file(node).write_text("".join(f"export {k}='{v}'\n" for k, v in self.node_env(node).items()))
            SimBackend.from_scenario({"version": 1, "name": node, "processes": [],
                                      "gpus": [{"model": self.gpu}] * self.gpus_per_node},
                                     self.base / f"sim-{node}.json")

    def _write_hook_wrappers(self) -> None:
        super()._write_hook_wrappers()
        source = (f"node_env='{self.base}/etc/node-'\"${{SLURMD_NODENAME:-}}\"'.env'\n"
                  '[ -n "${SLURMD_NODENAME:-}" ] && [ -f "$node_env" ] && . "$node_env"\n')
        for wrapper in (self.base / "bin").iterdir():
            lines = wrapper.read_text().splitlines(keepends=True)
            wrapper.write_text("".join(lines[:2]) + source + "".join(lines[2:]))  # after the GPUSHARE_CONFIG export

    def start_agents(self) -> None:
        self.agents = {}
        for node in self.node_names:
            log = open(self.base / "log" / f"agent-{node}.out", "ab")
            argv = self.argv([f"{BIN_DIR}/gpushare-agent", "--node", node, "--log-level", "INFO"])
            self.agents[node] = subprocess.Popen(argv, env={**self.env, **self.node_env(node)},
                                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                                 start_new_session=True)
            log.close()
        for node in self.node_names:
            sock = Path(self.node_env(node)["GPUSHARE_AGENT_RUN_DIR"]) / "agent" / "agent.sock"
            self._wait(lambda: _answers(sock), 15, f"gpushare-agent of {node} did not answer")

    def stop(self) -> None:
        for proc in getattr(self, "agents", {}).values():
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.agents = {}
        super().stop()


def _answers(sock: Path) -> bool:
    try:
        return bool(call(sock, {"op": "ping"}, timeout_s=1.0).get("ok"))
    except AgentUnavailable:
        return False


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[TwoAgentCluster]:
    problem = missing_requirements()
    if problem:
        pytest.skip(f"real Slurm unavailable: {problem}")
    if not shutil.which("prometheus"):
        pytest.skip("no prometheus binary (Debian package prometheus; make setup installs it)")
    base = Path(tempfile.mkdtemp(prefix="gpushare-prom-", dir="/tmp"))  # slurmctld (as slurm) must reach it
    os.chmod(base, 0o755)
    toml = (f'[agent]\nstate_dir = "{base}/agent-state"\nrecords_dir = "{base}/records"\nrun_dir = "{base}/run-agent"\n'
            f'withhold = "none"\nwindow_samples = 4\nsample_period_s = 0.25\nflush_every_s = 1.0\n')
    made = TwoAgentCluster(base, node_names=("n1", "n2"), bin_dir=BIN_DIR, toml_extra=toml)
    failed_before = request.session.testsfailed
    try:
        made.start()
        made.start_agents()
        yield made
    finally:
        made.stop()
        if request.session.testsfailed > failed_before:
            for log in sorted((base / "log").glob("*")):
                sys.stderr.write(f"== {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-25:]) + "\n")
        else:
            shutil.rmtree(base, ignore_errors=True)


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) of every query target, rows' nested panels included."""
    found = []
    stack = list(dashboard["panels"])
    while stack:
        panel = stack.pop(0)
        stack.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            found.append((panel["title"], target["expr"]))
    return found


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's template variables and interval macro, as Grafana would expand them for one node and job."""
    expr = expr.replace("$__rate_interval", "1m")
    return re.sub(r"\$(\w+)", lambda m: values[m.group(1)], expr)


def test_prometheus_holds_every_nodes_series_and_every_dashboard_query_returns_data(cluster, tmp_path):
    prom = Prometheus(tmp_path / "prometheus", dict(cluster.metrics)).start()
    jobs: dict[str, int] = {}
    try:
        os.chmod(tmp_path, 0o755)
        for node in cluster.node_names:  # one shared job per node, running while the queries run
            script = (f"#!/bin/sh\n#GPUSHARE mem=4G\n. '{cluster.base}/etc/node-'\"$SLURMD_NODENAME\"'.env'\n"
                      f"exec '{sys.executable}' '{SIMJOB}' --mem-mib 3000 --smact 0.5 --seconds 120\n")
            jobs[node], _ = cluster.client.sbatch("-D", str(tmp_path), "-o", str(tmp_path / "job-%j.out"),
                                                  f"--export=ALL,GPUSHARE_CONFIG={cluster.gpushare_conf}",
                                                  "-w", node, "--gres=gpu:1", script=script)
        assert prom.wait_for('up{job="gpushare"} == 1', lambda r: nodes_of(r) == {"n1", "n2"}, 30)
        # each job's series come from its own node's agent, which knows it from that node's Prolog
        info = prom.wait_for("gpushare_job_info", lambda r: len(r) == 2, 60)
        assert {(i["metric"]["node"], i["metric"]["jobid"]) for i in info} == {(n, str(j)) for n, j in jobs.items()}
        assert all(i["metric"]["user"] == "root" for i in info)
        prom.wait_for('gpushare_job_memory_used_bytes > 0', lambda r: nodes_of(r) == {"n1", "n2"}, 30)
        assert prom.target_health() == {"n1": "up", "n2": "up"}

        dashboard = json.loads(DASHBOARD.read_text())
        values = {"node": "n1", "job": str(jobs["n1"]), "datasource": ""}
        for variable in dashboard["templating"]["list"]:  # label_values(metric, label) lists the choices
            if variable["type"] != "query":
                continue
            metric, label = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["definition"]).groups()
            choices = {item["metric"].get(label) for item in prom.query(metric)}
            assert values[variable["name"]] in choices, (variable["name"], choices)
        queries = panel_queries(dashboard)
        assert len(queries) >= 20
        for title, expr in queries:
            query = substitute(expr, values)
            result = prom.wait_for(query, bool, 20)  # rate() needs two scrapes in its window
            assert all(item["value"][1] != "NaN" for item in result), (title, query, result)
        for metric in ("gpushare_gpu_memory_total_bytes", "gpushare_gpu_energy_joules_total",
                       "gpushare_job_energy_joules_total", "gpushare_guard_actions_total"):
            assert nodes_of(prom.query(metric)) == {"n1", "n2"}, metric  # series from both hosts
    finally:
        prom.stop()
        for job in jobs.values():
            cluster.client.run("scancel", str(job))
