"""``gpushare doctor`` against real ``gpushare-agent`` daemons, one per loopback address (all of 127/8 is this
host, so each address stands for a GPU node of its own): one holds the same gpushare.toml as the doctor's host,
one another file, one none (started with ``--defaults``), and one address has no agent at all.

The agents run on the simulated GPU backend with their directories under the test's own; everything else is
the shipped default except the metrics address and port (the default, 127.0.0.1:9402, is one address only).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gpushare.cli import main as gpushare_main
from gpushare.config import DEFAULT_PATH
from gpushare.gres.sim_backend import SimBackend

BIN_DIR = os.path.dirname(sys.executable)
SITE = "version = 1\n[policy]\nmargin_fraction = 0.15\n[agent]\nmetrics_port = {port}\n"


def free_port(addresses: list[str]) -> int:
    for _ in range(20):
        with socket.socket() as probe:
            probe.bind((addresses[0], 0))
            port = probe.getsockname()[1]
        try:
            for address in addresses[1:]:
                with socket.socket() as other:
                    other.bind((address, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every address")


def start_agent(base: Path, name: str, address: str, port: int, config: Path | None) -> subprocess.Popen:
    """A real agent whose node is ``name``; ``config`` None: no file anywhere, started with ``--defaults``."""
    home = base / name
    home.mkdir()
    SimBackend.from_scenario({"version": 1, "gpus": [{"model": "a100-40gb"}]}, home / "sim.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    env.update({"GPUSHARE_AGENT_STATE_DIR": str(home / "state"), "GPUSHARE_AGENT_RUN_DIR": str(home / "run"),
                "GPUSHARE_AGENT_RECORDS_DIR": str(home / "records"), "GPUSHARE_AGENT_LOG_FILE": str(home / "agent.log"),
                "GPUSHARE_AGENT_DEVICE_BACKEND": f"sim:{home / 'sim.json'}",
                "GPUSHARE_AGENT_METRICS_ADDRESS": address, "GPUSHARE_AGENT_METRICS_PORT": str(port),
                "SLURM_CONF": str(home / "slurm.conf")})  # nothing beside it: the lookup ends at /etc/slurm
    argv = [f"{BIN_DIR}/gpushare-agent", "--node", name]
    if config is None:
        argv.append("--defaults")
    else:
        env["GPUSHARE_CONFIG"] = str(config)
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=open(home / "agent.out", "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_metrics(address: str, port: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"agent on {address} exited {proc.returncode}: {log.read_text()}")
        try:
            urllib.request.urlopen(f"http://{address}:{port}/metrics", timeout=1).read()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"agent on {address} did not serve metrics: {log.read_text()}")


@pytest.fixture
def three_nodes(tmp_path):
    if DEFAULT_PATH.exists():
        pytest.skip(f"{DEFAULT_PATH} exists on this host: the agent without a file would read it")
    addresses = {"n1": "127.0.0.4", "n2": "127.0.0.2", "n3": "127.0.0.3"}
    port = free_port(list(addresses.values()) + ["127.0.0.5"])
    site = tmp_path / "gpushare.toml"
    site.write_text(SITE.format(port=port))
    other = tmp_path / "other.toml"
    other.write_text(SITE.format(port=port).replace("0.15", "0.25"))
    procs = {"n1": start_agent(tmp_path, "n1", addresses["n1"], port, site),
             "n2": start_agent(tmp_path, "n2", addresses["n2"], port, other),
             "n3": start_agent(tmp_path, "n3", addresses["n3"], port, None)}
    try:
        for name, proc in procs.items():
            wait_for_metrics(addresses[name], port, proc, tmp_path / name / "agent.out")
        yield site, other, addresses
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def test_doctor_names_the_node_that_differs_lacks_a_file_or_is_unreachable(three_nodes, capsys, monkeypatch):
    site, other, addresses = three_nodes
    for name in [n for n in os.environ if n.startswith("GPUSHARE_")]:
        monkeypatch.delenv(name)
    nodes = [f"--node={name}={address}" for name, address in addresses.items()] + ["--node=n4=127.0.0.5"]
    assert gpushare_main(["doctor", "--config", str(site), "--no-slurm", "--timeout", "2", *nodes]) == 1
    text = capsys.readouterr().out
    lines = {line.split()[0]: line for line in text.splitlines()}
    digest = __import__("hashlib").sha256(site.read_bytes()).hexdigest()
    other_digest = __import__("hashlib").sha256(other.read_bytes()).hexdigest()
    assert lines["config"].split()[1] == "ok" and digest[:12] in lines["config"]
    assert lines["n1"].split()[1] == "ok" and str(site) in lines["n1"]
    assert lines["n2"].split()[1] == "differs" and other_digest[:12] in lines["n2"] and str(other) in lines["n2"]
    assert " no config " in lines["n3"] and "built-in defaults" in lines["n3"]
    assert lines["n4"].split()[1] == "unreachable" and "127.0.0.5" in lines["n4"]

    assert gpushare_main(["doctor", "--config", str(site), "--no-slurm", "--json", "--timeout", "2", *nodes]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["config"]["sha256"] == digest
    hosts = {h["node"]: h for h in doc["hosts"]}
    assert {n: h["status"] for n, h in hosts.items()} == {"n1": "ok", "n2": "differs", "n3": "no config",
                                                         "n4": "unreachable"}
    assert hosts["n2"]["sha256"] == other_digest and hosts["n3"]["sha256"] == "none"

    # only the node that agrees: exit 0
    assert gpushare_main(["doctor", "--config", str(site), "--no-slurm", f"--node=n1={addresses['n1']}"]) == 0


def test_doctor_without_a_file_here_is_a_problem(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GPUSHARE_CONFIG", raising=False)
    monkeypatch.setattr("gpushare.config.DEFAULT_PATH", tmp_path / "absent.toml")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    assert gpushare_main(["doctor", "--no-slurm"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("config") and "no gpushare.toml (tried" in out and str(tmp_path / "absent.toml") in out


def test_doctor_flags_settings_that_need_a_shared_path(tmp_path, capsys):
    path = tmp_path / "gpushare.toml"
    path.write_text('[estimation]\npartition = "cpu"\n[agent]\nadmin_comment = "no"\nmetrics_port = 0\n'
                    '[[nodes]]\nnames = "g1"\nmig = true\ngpu = "a100-40gb"\n')
    # g1 cannot be compared, but metrics_port = 0 is a choice: a note, and the doctor passes
    assert gpushare_main(["doctor", "--config", str(path), "--no-slurm"]) == 0
    out = capsys.readouterr().out
    assert "[agent] records_dir" in out and "[mig] gres_conf" in out
    assert "spool_dir" not in out  # estimation results travel in the estimation job's Comment
    assert any(line.split()[:2] == ["nodes", "note"] and "metrics_port = 0" in line for line in out.splitlines())


@pytest.mark.slurm
def test_doctor_finds_the_gpu_nodes_through_slurm(agent_cluster, capsys, monkeypatch):
    """No --node: the GPU nodes and their addresses come from ``scontrol show node`` (n1, NodeAddr 127.0.0.1)
    and the FUTURE standby node is no host. The agent gets a metrics port from the environment (the test
    cluster's file turns metrics off), which the doctor then reports as an override."""
    port = free_port(["127.0.0.1"])
    monkeypatch.setenv("GPUSHARE_AGENT_METRICS_PORT", str(port))
    cluster = agent_cluster(start_agent=False)
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    cluster.start_agent()
    wait_for_metrics("127.0.0.1", port, cluster.agent_proc, cluster.base / "log" / "agent.out")
    assert gpushare_main(["doctor", "--config", str(cluster.gpushare_conf)]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["slurm"].split()[1] == "ok" and lines["n1"].split()[1] == "ok"
    assert "GPUSHARE_AGENT_METRICS_PORT" in lines["environment"]
    assert not any(name.startswith("gpushare-") for name in lines)  # the standby node is not a host
    cluster.stop_agent()
    assert gpushare_main(["doctor", "--config", str(cluster.gpushare_conf), "--timeout", "1"]) == 1
    assert " unreachable " in capsys.readouterr().out
