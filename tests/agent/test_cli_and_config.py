"""`gpushare status`, `gpushare report`, the [agent] config section and the generated Slurm lines."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from gpushare.epilog.records import RecordLedger
from gpushare.epilog.report_cli import gpu_rows, job_rows, parse_since
from gpushare.cli import main as gpushare_main
from gpushare.config import ConfigError, parse_config
from gpushare.agent.api_server import ApiServer
from gpushare.agent.status_cli import render
from gpushare.gpus import GiB


def record(job, end, gpu="0", energy=100.0, share=40.0, ttfk=2.0):
    return {"v": 1, "job": job, "restarts": 0, "node": "n1", "user": "alice", "caps": {"mode": "mps"},
            "est_gib": 4.0, "start": end - 10, "end": end, "duration_s": 10.0, "ttfk_s": ttfk, "exit_code": 0,
            "gpus": {gpu: {"energy_j": energy, "share_j": share, "active_s": 8.0, "peak_bytes": 3 * GiB}},
            "series": {gpu: [[end - 10 + t, 5 * GiB, 3 * GiB, 0.4] for t in range(10)]}}


def write_config(tmp_path, records_dir="", run_dir=""):
    path = tmp_path / "gpushare.toml"
    path.write_text(f'version = 1\n[agent]\nrecords_dir = "{records_dir or tmp_path / "rec"}"\n'
                    f'run_dir = "{run_dir or tmp_path / "run"}"\n')
    return path


def test_report_table_json_and_plots(tmp_path, capsys):
    ledger = RecordLedger(tmp_path / "rec")
    ledger.put(record("11", 1000.0))
    ledger.put(record("12", 2000.0, gpu="1", energy=50.0, share=50.0, ttfk=None))
    config = write_config(tmp_path)
    assert gpushare_main(["report", "--config", str(config), "--plot", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "11" in out and "12" in out and "mean TTFK" in out
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["energy.png", "job-11.0.png", "job-12.0.png"]
    assert (tmp_path / "plots" / "job-11.0.png").read_bytes()[:4] == b"\x89PNG"
    assert gpushare_main(["report", "--config", str(config), "--job", "11", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["jobs"][0]["peak_gib"] == 3.0 and data["records"][0]["job"] == "11"
    assert gpushare_main(["report", "--config", str(config), "--job", "99"]) == 1
    assert gpushare_main(["report", "--config", str(config), "--job", "../x"]) != 0


def test_report_rows_and_since():
    rows = job_rows([record("1", 100.0), record("2", 200.0, ttfk=4.0)])
    assert [r["share_j"] for r in rows] == [40.0, 40.0]
    assert gpu_rows([record("1", 100.0), record("2", 200.0, ttfk=4.0)]) == [
        {"node": "n1", "gpu": 0, "jobs": 2, "active_s": 16.0, "share_j": 80.0, "mean_ttfk_s": 3.0}]
    assert parse_since("2h", now=10_000.0) == 10_000.0 - 7200
    assert parse_since("1970-01-01T01:00:00") == 3600.0
    with pytest.raises(Exception):
        parse_since("yesterday")


def test_status_through_the_agent_socket(tmp_path, capsys):
    config = write_config(tmp_path)
    status = {"ok": True, "node_open": False, "now": 0.0, "jobs": [
        {"job": "5", "gpus": [0], "mode": "mps", "ttfk_s": 1.5, "share_mj": {"0": 2000.0}, "peak_bytes": {"0": GiB}}],
        "gpus": [{"index": 0, "memory_used": 2 * GiB, "memory_total": 40 * GiB, "jobs": ["5"], "risky": False,
                  "warming": True, "error": None, "risk": {"smact": 0.5, "smocc": 0.1, "drama": float("nan")}}]}
    assert "withheld" in render(status) and "warming" in render(status) and "N/A" in render(status)
    assert gpushare_main(["status", "--config", str(config)]) == 1  # no agent: a clear message, exit 1
    assert "gpushare-agent running" in capsys.readouterr().err
    server = ApiServer(tmp_path / "run" / "agent" / "agent.sock", lambda req: status).start()
    try:
        assert gpushare_main(["status", "--config", str(config)]) == 0
        assert "   0" in capsys.readouterr().out
    finally:
        server.stop()


def test_agent_config_is_strict():
    assert parse_config({}).agent.withhold == "none"
    with pytest.raises(ConfigError, match="collocation"):
        parse_config({"agent": {"collocation": "mps-any"}})
    with pytest.raises(ConfigError, match="withhold_feature"):
        parse_config({"agent": {"withhold_feature": "open;drain"}})
    with pytest.raises(ConfigError, match="unknown key 'windows'"):
        parse_config({"agent": {"windows": 3}})


def test_slurm_config_with_withholding(tmp_path, capsys):
    path = tmp_path / "gpushare.toml"
    path.write_text('version = 1\n[agent]\nwithhold = "feature"\n'
                    '[[nodes]]\nnames = "g[1-2]"\ngpu = "a100-40gb"\ncount = 2\n')
    assert gpushare_main(["slurm-config", "--config", str(path), "--install-lua", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "NodeName=g[1-2] Gres=gpu:a100-40gb:2,shard:80 Features=gpushare_open State=UNKNOWN" in out
    assert "NodeName=gpushare-standby-gpu State=FUTURE Features=gpushare_open Gres=gpu:a100-40gb:2,shard:80" in out
    assert "PartitionName=gpu Nodes=g[1-2],gpushare-standby-gpu State=UP" in out
    lua = (tmp_path / "gpushare_submit.lua").read_text()  # the module job_submit.lua loads
    assert 'local SHARED_FEATURE = "gpushare_open"' in lua
    luac = shutil.which("luac5.1")
    if luac:
        subprocess.run([luac, "-p", str(tmp_path / "job_submit.lua"), str(tmp_path / "gpushare_submit.lua")],
                       check=True)


def test_metrics_served_on_localhost(tmp_path, clock):
    import socket
    import urllib.request

    from prometheus_client import CollectorRegistry

    from gpushare.gres.sim_backend import SimBackend
    from gpushare.agent.daemon import Agent
    from gpushare.agent.metrics import serve

    sim = SimBackend.from_scenario({"version": 1, "gpus": [{"model": "a100-40gb"}]}, clock=clock)
    registry = CollectorRegistry()
    agent = Agent(parse_config({"agent": {"state_dir": str(tmp_path / "s"), "run_dir": str(tmp_path / "r")}}).agent,
                  sim, clock=clock, registry=registry)
    agent.tick()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = serve(registry, port)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, s.labels.get("gpu")): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("gpushare_gpu_memory_total_bytes", "0")] == 40 * GiB
    assert samples[("gpushare_gpu_risky", "0")] == 0.0


def test_metrics_listen_where_the_config_says(tmp_path):
    """[agent] metrics_address: a central Prometheus reaches a node only if the agent listens beyond loopback.
    127.0.0.2 stands for the node's own address (all of 127/8 is this host): served there, not on 127.0.0.1."""
    import socket
    import urllib.error
    import urllib.request

    from prometheus_client import CollectorRegistry

    from gpushare.agent.metrics import serve

    cfg = parse_config({"agent": {"metrics_address": "127.0.0.2"}}).agent
    assert parse_config({}).agent.metrics_address == "127.0.0.1"
    with pytest.raises(ConfigError, match="metrics_address"):
        parse_config({"agent": {"metrics_address": "node1.example"}})
    with socket.socket() as probe:
        probe.bind(("127.0.0.2", 0))
        port = probe.getsockname()[1]
    server = serve(CollectorRegistry(), port, cfg.metrics_address)
    try:
        assert urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=5).status == 200
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    finally:
        server.shutdown()


@pytest.mark.parametrize("current, expected", [
    (None, "gpushare_open"), ("", "gpushare_open"), ("intel", "intel&gpushare_open"),
    ("intel&gpushare_open", "intel&gpushare_open"), ("intel|amd", "intel|amd"), ("[a|b]", "[a|b]"),
    ("big*2", "big*2")])
def test_lua_adds_the_feature_only_to_simple_constraints(tmp_path, current, expected):
    lua = shutil.which("lua5.1")
    if not lua:
        pytest.skip("lua5.1 not installed")
    from gpushare.slurm_plugins.slurm_config import render_lua_module

    cfg = parse_config({"agent": {"withhold": "feature"}})
    script = tmp_path / "gpushare_submit.lua"  # the rendered module, plus a handle on its local function
    head, _, tail = render_lua_module(cfg).rpartition("\nreturn M")
    script.write_text(head + "\nM.test_add = add_shared_feature\nreturn M" + tail)
    value = "nil" if current is None else json.dumps(current)
    driver = ("slurm = {SUCCESS = 0, log_info = function() end, log_error = function() end}\n"
              f'local M = dofile("{script}")\nlocal job = {{features = {value}}}\nM.test_add(job)\n'
              'io.write(job.features or "")\n')
    out = subprocess.run([lua, "-"], input=driver, capture_output=True, text=True, check=True)
    assert out.stdout == expected


def test_record_files_carry_the_node_and_the_older_names_still_read(tmp_path):
    """Two nodes of one multi-node run write to one directory (shared, or gathered) without overwriting each
    other; records written before the node was part of the name are found beside them."""
    ledger = RecordLedger(tmp_path / "rec")
    first = ledger.put({**record("7", 100.0), "node": "gpu01"})
    second = ledger.put({**record("7", 101.0), "node": "gpu02"})
    assert (first.name, second.name) == ("gpu01.7.0.json", "gpu02.7.0.json")
    (tmp_path / "rec" / "8.0.json").write_text(first.read_text().replace('"7"', '"8"'))  # the older name
    assert [r["node"] for r in ledger.get("7")] == ["gpu01", "gpu02"]
    assert [r["job"] for r in ledger.get("8", 0)] == ["8"] and ledger.get("17") == [] and ledger.get("7", 1) == []
    assert sorted(r["job"] for r in ledger.all()) == ["7", "7", "8"]
    assert ledger.put({**record("9", 1.0), "node": "odd.name"}).name == "9.0.json"  # not a file-name part
    with pytest.raises(ValueError):
        ledger.get("../7")
