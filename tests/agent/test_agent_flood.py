"""A slow-client flood against a real ``gpushare-agent`` process held to a task limit like the shipped
unit's (``TasksMax=64``: a pids cgroup of 64 tasks; where none can be made, RLIMIT_NPROC for the agent
running as a user of its own). No Slurm: the agent's Slurm client points at a folder without ``scontrol``, so
every Slurm lookup fails, as it did on the node that ran out of tasks.

One ordinary user holds 80 connections to the live socket (mode 0666), each sending a byte a second and
reconnecting whenever the agent closes it. Meanwhile another user's job starts: root registers it through
the API as its Prolog does, its process (a real one, of that user, on the simulated GPU, inside its share)
runs to its end. What must hold: the registration answers, root's API answers within its usual time all
along, the victim completes (exit 0) registered by the agent, and the backstop stops nothing."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpushare.node.api import AgentUnavailable, call
from gpushare.config import load_config
from gpushare.gpus import GiB
from gpushare.gres.sim_backend import SimBackend

pytestmark = [pytest.mark.hostile,
              pytest.mark.skipif(os.geteuid() != 0, reason="runs the flood and the victim as other uids")]
HERE = Path(__file__).parent
TASKS_MAX = 64  # etc/systemd/gpushare-agent.service
FLOODER, VICTIM, AGENT_UID = 65534, 61046, 61047
SCENARIO = {"version": 1, "name": "flood", "processes": [], "gpus": [{"model": "a100-40gb"}]}
FACTS = {"job": "7", "uid": VICTIM, "user": "victim", "gpus": [0], "shared": True, "est_gib": 4.0, "margin_gib": 1.0,
         "shards": 5}


def pids_cgroup(name: str) -> Path | None:
    """A fresh pids cgroup (v2, else v1) limited to TASKS_MAX tasks; None where none can be made here."""
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/pids")):
        try:
            if root == Path("/sys/fs/cgroup") and "pids" not in (root / "cgroup.controllers").read_text().split():
                continue
            group = root / name
            group.mkdir()
            (group / "pids.max").write_text(f"{TASKS_MAX}\n")
            return group
        except OSError:
            continue
    return None


@pytest.fixture
def node() -> Iterator[dict]:
    base = Path(tempfile.mkdtemp(prefix="gpushare-flood-", dir="/tmp"))
    os.chmod(base, 0o755)
    (base / "no-slurm").mkdir()
    SimBackend.from_scenario(SCENARIO, base / "sim.json")
    conf = base / "gpushare.toml"
    conf.write_text(f'[agent]\nstate_dir = "{base}/state"\nrun_dir = "{base}/run"\ndevice_backend = '
                    f'"sim:{base}/sim.json"\nwithhold = "none"\nmetrics_port = 0\nadmin_comment = "no"\n'
                    f'window_samples = 4\nsample_period_s = 0.25\nflush_every_s = 1.0\nlog_file = "{base}/agent.log"\n'
                    'backstop_grace_s = 1.0\nbackstop_tolerance_mib = 256\nforecast_action = "none"\n'
                    f'[slurm]\nbin_dir = "{base}/no-slurm"\n')
    group = pids_cgroup(base.name)

    def limit() -> None:
        if group is not None:
            (group / "cgroup.procs").write_text("0\n")  # this process and every thread it starts
        else:  # RLIMIT_NPROC counts the threads of the agent's own uid
            resource.setrlimit(resource.RLIMIT_NPROC, (TASKS_MAX, TASKS_MAX))
            os.setgid(AGENT_UID)
            os.setuid(AGENT_UID)

    if group is None:
        for path in (base, base / "sim.json", base / "sim.json.lock", base / "no-slurm"):
            if path.exists():
                os.chown(path, AGENT_UID, AGENT_UID)
    agent = subprocess.Popen([sys.executable, "-m", "gpushare.agent.daemon", "--config", str(conf), "--node", "n1"],
                             preexec_fn=limit, stdout=subprocess.DEVNULL, stderr=open(base / "agent.err", "wb"))
    api = base / "run" / "agent" / "agent.sock"
    deadline = time.monotonic() + 60
    while True:
        try:
            if call(api, {"op": "ping"}, timeout_s=1.0).get("ok"):
                break
        except AgentUnavailable:
            pass
        assert agent.poll() is None and time.monotonic() < deadline, (base / "agent.err").read_text()[-2000:]
        time.sleep(0.1)
    try:
        yield {"base": base, "api": api, "live": base / "run" / "live" / "live.sock", "agent": agent,
               "cfg": load_config(str(conf)).agent, "limit": "cgroup" if group else "RLIMIT_NPROC"}
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(20)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(10)
        if group is not None:
            try:
                group.rmdir()
            except OSError:
                pass
        shutil.rmtree(base, ignore_errors=True)


def timed(api: Path, request: dict) -> tuple[float, dict | None]:
    started = time.monotonic()
    try:
        reply: dict | None = call(api, request, timeout_s=5.0)  # the Prolog's own timeout
    except AgentUnavailable:
        reply = None
    return time.monotonic() - started, reply


VICTIM_JOB = "import time; time.sleep(float(__import__('sys').argv[1]))"
LIVE = """
import json, socket, sys
with socket.socket(socket.AF_UNIX) as s:
    s.settimeout(10)
    s.connect(sys.argv[1])
    s.sendall(b'{"op": "live", "job": "7"}\\n')
    print(s.makefile().readline().strip())
"""


def test_a_slow_client_flood_under_the_units_task_limit_leaves_the_victim_and_roots_api_alone(node):
    usual = sorted(timed(node["api"], {"op": "status"})[0] for _ in range(10))[5]
    flood = subprocess.Popen([sys.executable, "-S", str(HERE / "slow_clients.py"), str(node["live"]), "80", "30"],
                             stdout=subprocess.PIPE, text=True, preexec_fn=lambda: os.setuid(FLOODER))
    victim = None
    try:
        time.sleep(3.0)  # the flood is on (its first 80 connections are open and trickling)
        seconds, reply = timed(node["api"], {"op": "register", "job": FACTS})  # the victim's Prolog
        assert reply is not None and reply.get("ok"), f"registration failed during the flood ({seconds:.1f} s): {reply}"
        register_s = seconds
        victim = subprocess.Popen([sys.executable, "-c", VICTIM_JOB, "12"], env={**os.environ, "SLURM_JOB_ID": "7"},
                                  preexec_fn=lambda: os.setuid(VICTIM))
        SimBackend.open(node["base"] / "sim.json").start_process(0, victim.pid, 3 * GiB, host=True)  # inside 5 GiB
        during: list[float] = []
        live: dict = {}
        while victim.poll() is None:
            seconds, reply = timed(node["api"], {"op": "status"})
            assert reply is not None and reply.get("ok"), f"root's API failed during the flood: {reply}"
            during.append(seconds)
            if not live:  # the victim's own user reads its running job's numbers
                done = subprocess.run([sys.executable, "-S", "-c", LIVE, str(node["live"])], capture_output=True,
                                      text=True, timeout=30, preexec_fn=lambda: os.setuid(VICTIM))
                live = json.loads(done.stdout)
            time.sleep(0.5)
        assert victim.returncode == 0, f"the victim ended with {victim.returncode}"
        status = call(node["api"], {"op": "status"}, timeout_s=5.0)
    finally:
        if victim is not None and victim.poll() is None:
            victim.kill()
            victim.wait(10)
        flood.kill()
        flood.wait(10)
    assert node["agent"].poll() is None, (node["base"] / "agent.err").read_text()[-2000:]
    assert live.get("ok") and live["job"] == "7", live
    guard = status["guard"]
    assert guard["backstop_stops"] == guard["unattributed_stops"] == 0, guard
    assert status["unattributed"] == [] and [j["job"] for j in status["jobs"]] == ["7"]
    slowest = max(during)
    print(f"limit={node['limit']} usual_status_s={usual:.3f} register_s={register_s:.3f} "
          f"status_during_flood_s: median={sorted(during)[len(during) // 2]:.3f} max={slowest:.3f} n={len(during)}")
    assert register_s < 2.0 and slowest < max(1.0, 10 * usual), (usual, register_s, during)
