"""The live socket (gpushare.agent.live_api): a running job's owner reads its summary so far from the agent;
another user learns nothing. A real agent object on the simulated backend, a real socket, and clients that
are real processes of other uids (SO_PEERCRED is the kernel's word, not the request's)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from gpushare.node.api import call
from gpushare.agent.daemon import Agent
from gpushare.agent.live_api import LiveServer
from gpushare.node.api import live_socket_path
from gpushare.config import parse_config
from gpushare.gpus import GiB
from gpushare.gres.sim_backend import SimBackend

NOBODY = 65534
SCENARIO = {"version": 1, "name": "live", "processes": [],
            "gpus": [{"model": "a100-40gb", "idle_power_w": 50, "max_power_w": 350}]}
CLIENT = """
import json, socket, sys
with socket.socket(socket.AF_UNIX) as s:
    s.connect(sys.argv[1])
    s.sendall((json.dumps({"op": "live", "job": sys.argv[2]}) + "\\n").encode())
    print(s.makefile().readline().strip())
"""


def as_uid(uid: int, path: Path, job: str) -> dict:
    done = subprocess.run([sys.executable, "-S", "-c", CLIENT, str(path), job], capture_output=True, text=True,
                          timeout=10, preexec_fn=lambda: os.setuid(uid), check=True)
    return json.loads(done.stdout)


def test_the_owner_reads_its_running_jobs_summary_and_nobody_else_does(clock) -> None:
    base = Path(tempfile.mkdtemp(prefix="gpushare-live-", dir="/tmp"))
    os.chmod(base, 0o755)
    backend = SimBackend.from_scenario(SCENARIO, clock=clock)
    cfg = parse_config({"agent": {"state_dir": str(base / "state"), "run_dir": str(base / "run"),
                                  "window_samples": 5, "collocation": "fraction"}}).agent
    agent = Agent(cfg, backend, clock=clock, pid_job={501: "7"}.get, pid_uid={501: NOBODY}.get)
    server = LiveServer(live_socket_path(cfg.run_dir), agent.live).start()
    try:
        os.chmod(base / "run", 0o755)
        agent.register({"job": "7", "uid": NOBODY, "user": "nobody", "gpus": [0], "shared": True, "est_gib": 4.0,
                        "margin_gib": 1.0, "shards": 5})
        agent.register({"job": "8", "uid": 1000, "user": "u1000", "gpus": [0], "shared": True, "est_gib": 4.0,
                        "margin_gib": 1.0, "shards": 5})
        backend.start_process(0, 501, 3 * GiB)
        backend.update_process(501, smact=0.5)
        for _ in range(3):
            agent.tick()
            clock.advance(1.0)
        path = live_socket_path(cfg.run_dir)
        assert oct(path.stat().st_mode & 0o777) == "0o666"

        mine = as_uid(NOBODY, path, "7")
        assert mine["ok"] and mine["run"]["peak_gib"] == 3.0 and mine["run"]["cap_gib"] == 5.0
        assert mine["run"]["ttfk_s"] is not None and "exit" not in mine["run"]
        theirs, absent = as_uid(NOBODY, path, "8"), as_uid(NOBODY, path, "9")
        assert not theirs["ok"] and theirs["error"] == absent["error"].replace("9", "8")  # no hint who runs what
        assert call(path, {"op": "live", "job": "8"})["ok"]  # root, the admin, reads any
        assert not as_uid(NOBODY, path, "7;id")["ok"] and not call(path, {"op": "close", "job": "7"})["ok"]
        agent.close("7")
        assert not as_uid(NOBODY, path, "7")["ok"]  # ended: jobstats reads the stored summary instead
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
