"""``[policy] mode`` and the sharing scope: pure rules, then a real gpushare-submitd switched by SIGHUP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from gpushare.config import parse_config
from gpushare.slurm_plugins.decision import Estimate, SubmitRequest, decide, parse_record
from gpushare.estimate.directives import parse_directives
from gpushare.slurm_plugins.scope import observed, out_of_scope

NODES = [{"names": "g[1-2]", "gpu": "a100-40gb", "partition": "gpu"},
         {"names": "h1", "gpu": "h100-80gb", "partition": "big"}]
SCRIPT = "#!/bin/sh\n#GPUSHARE mem=12G\npython train.py\n"


def _request(**fields: object) -> SubmitRequest:
    return SubmitRequest(user_id=1000, tres_per_node="gres/gpu:1", script=SCRIPT, **fields)  # type: ignore[arg-type]


def test_only_partitions_with_shards_are_in_scope() -> None:
    cfg = parse_config({"nodes": NODES})
    assert out_of_scope(_request(partition="gpu"), cfg) is None
    assert out_of_scope(_request(partition="gpu,big"), cfg) is None
    assert out_of_scope(_request(), cfg) is None  # partition unknown and no list: as before
    assert out_of_scope(_request(default_partition="gpu"), cfg) is None
    why = out_of_scope(_request(partition="cpu"), cfg)
    assert why == "partition cpu has no GPU shards ([[nodes]] groups); request left as is"
    assert out_of_scope(_request(partition="gpu,cpu"), cfg)  # could run in cpu: a shard request could not
    assert out_of_scope(_request(default_partition="cpu"), cfg)


def test_configured_partitions_accounts_and_qos() -> None:
    cfg = parse_config({"nodes": NODES, "policy": {"partitions": ["gpu", "cpu"], "accounts": ["ml"],
                                                   "qos": ["normal"]}})
    inside = {"partition": "gpu", "account": "ml", "qos": "normal"}
    assert out_of_scope(_request(**inside), cfg) is None
    assert "not in [policy] partitions" in (out_of_scope(_request(**{**inside, "partition": "big"}), cfg) or "")
    assert "has no GPU shards" in (out_of_scope(_request(**{**inside, "partition": "cpu"}), cfg) or "")
    assert "partition is unknown" in (out_of_scope(_request(account="ml", qos="normal"), cfg) or "")
    assert "account physics" in (out_of_scope(_request(**{**inside, "account": "physics"}), cfg) or "")
    assert "account (default)" in (out_of_scope(_request(**{**inside, "account": None}), cfg) or "")
    assert "QOS long" in (out_of_scope(_request(**{**inside, "qos": "long"}), cfg) or "")


def test_observe_records_what_enforce_would_do_and_changes_nothing() -> None:
    cfg = parse_config({"nodes": NODES})
    enforced = decide(_request(partition="gpu"), parse_directives(SCRIPT, 65536),
                      Estimate(12 << 30, "directive:mem"), cfg)
    assert enforced.action == "modify"
    seen = observed(enforced)
    assert (seen.action, seen.tres_per_node, seen.hold, seen.user_message) == ("accept", None, False, "")
    record = parse_record(seen.admin_comment)
    assert record and record["decision"] == "observe" and record["would"] == "shared"
    assert record["new"] == enforced.tres_per_node and record["old"] == "gres/gpu:1"
    rejected = observed(decide(_request(), parse_directives("#!/bin/sh\n#GPUSHARE mem=lots\n", 65536), None,
                               parse_config({"nodes": NODES, "submit": {"on_bad_directive": "reject"}})))
    assert rejected.action == "accept" and parse_record(rejected.admin_comment)["would"] == "reject"  # type: ignore[index]
    cpu = observed(decide(SubmitRequest(script="#!/bin/sh\n"), parse_directives("", 65536), None, cfg))
    assert cpu.action == "accept" and not cpu.record  # not a GPU job: no record in any mode


def _ask(sock: Path, partition: str) -> dict[str, str]:
    request = {"op": "submit", "user_id": 1000, "name": "t", "tres_per_node": "gres/gpu:1", "partition": partition,
               "script": SCRIPT, "work_dir": "/tmp"}
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(10)
        conn.connect(str(sock))
        conn.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"end\n"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
    return dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)


def _wait_for(log: Path, text: str, count: int = 1) -> None:
    deadline = time.monotonic() + 15
    while log.read_text().count(text) < count:
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.05)


def test_mode_switches_on_reload_and_a_bad_mode_keeps_the_last_good(tmp_path: Path) -> None:
    config, log, sock = tmp_path / "gpushare.toml", tmp_path / "submitd.log", tmp_path / "submitd.sock"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    body = (f'version = 1\n[submit]\ncache_dir = "{tmp_path}/cache"\nmetrics_port = {port}\n'
            f'[oom]\nledger_dir = "{tmp_path}/ledger"\n'
            '[[nodes]]\nnames = "g[1-2]"\ngpu = "a100-40gb"\npartition = "gpu"\n')

    def write(mode: str) -> None:
        config.write_text(body.replace("version = 1\n", f'version = 1\n[policy]\nmode = "{mode}"\n'))

    write("enforce")
    (tmp_path / "slurm.conf").write_text("ClusterName=t\nSlurmUser=root\n")
    with open(log, "wb") as handle:
        proc = subprocess.Popen([sys.executable, "-m", "gpushare.slurm_plugins.submitd", "--config", str(config),
                                 "--socket", str(sock)], stdout=handle, stderr=subprocess.STDOUT,
                                env={**os.environ, "SLURM_CONF": str(tmp_path / "slurm.conf")})
    try:
        _wait_for(log, "listening on")
        reply = _ask(sock, "gpu")
        assert reply["action"] == "modify" and reply["tres_per_node"].startswith("gres/shard:")
        assert "other users" in reply["user_msg"] and "requeues it once" in reply["user_msg"] and "mode=exclusive" in reply["user_msg"]
        reply = _ask(sock, "cpu")  # a partition without shards: unchanged, and the record says why
        assert reply["action"] == "accept" and "tres_per_node" not in reply
        assert parse_record(reply["admin_comment"])["decision"] == "out-of-scope"  # type: ignore[index]

        write("observe")
        os.kill(proc.pid, signal.SIGHUP)
        _wait_for(log, "configuration reloaded")
        routine = [line for line in log.read_text().splitlines()
                   if "listening on" in line or "configuration reloaded" in line or "(sha256" in line]
        assert len(routine) == 3 and all(" INFO " in line for line in routine), routine  # routine, not warnings
        assert "[policy] mode = enforce" in routine[0] and routine[-1].endswith("[policy] mode = observe")
        reply = _ask(sock, "gpu")
        record = parse_record(reply["admin_comment"])
        assert reply["action"] == "accept" and "tres_per_node" not in reply and "user_msg" not in reply
        assert record and record["decision"] == "observe" and record["would"] == "shared"

        write("pilot")  # malformed: one line, and observe stays in force
        os.kill(proc.pid, signal.SIGHUP)
        _wait_for(log, "configuration not reloaded")
        assert "[policy].mode: must be one of enforce, observe, off, got 'pilot'" in log.read_text()
        assert parse_record(_ask(sock, "gpu")["admin_comment"])["decision"] == "observe"  # type: ignore[index]

        write("off")
        os.kill(proc.pid, signal.SIGHUP)
        _wait_for(log, "configuration reloaded", 2)
        assert _ask(sock, "gpu") == {"action": "accept"}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert 'gpushare_submit_decisions_total{decision="shared",mode="enforce"} 1.0' in metrics
        assert 'gpushare_submit_decisions_total{decision="out-of-scope",mode="enforce"} 1.0' in metrics
        assert 'gpushare_submit_decisions_total{decision="shared",mode="observe"} 2.0' in metrics
    finally:
        proc.terminate()
        proc.wait(10)
