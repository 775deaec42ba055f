"""Lanes with real processes: the agent's lane service and lanes socket in this process, and real Python
processes training a tiny model on the CPU, their turns taken by the shipped ``sitecustomize`` hooks over
the real socket protocol. Jobs are registered with a real Agent over simulated GPUs; a process is matched
to its job by its environment (``environ_job``, the agent's rule on nodes without job cgroups)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from lane_log import completed_turns

from gpushare.agent.daemon import Agent
from gpushare.agent.lane_api import LaneServer
from gpushare.node.api import lanes_socket_path

from gpushare.agent.sampler import environ_job
from gpushare.config import parse_config
from gpushare.gpus import GiB
from gpushare.gres.sim_backend import SimBackend
from gpushare.prolog.task_prolog import lane_site_dir

pytestmark = pytest.mark.torch  # starts gpu-estimate captures: torch in a child process or the warm worker

pytest.importorskip("torch")
WORKER = Path(__file__).with_name("lane_worker.py")
SCENARIO = {"version": 1, "name": "lanes", "processes": [], "gpus": [{"model": "a100-40gb"}]}


class Node:
    """A real Agent and its lanes socket; ``spawn`` starts a job's training process."""

    def __init__(self, tmp: Path, turn_limit_s: float, policy: str) -> None:
        self.cfg = parse_config({"agent": {"state_dir": str(tmp / "state"), "run_dir": str(tmp / "run"),
                                           "collocation": "fraction", "lane_turn_limit_s": turn_limit_s,
                                           "lane_policy": policy}}).agent
        self.path = lanes_socket_path(self.cfg.run_dir)
        self._start()
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def _start(self) -> None:
        self.agent = Agent(self.cfg, SimBackend.from_scenario(SCENARIO), registry=CollectorRegistry(),
                           pid_job=environ_job)
        self.agent.load()
        self.server = LaneServer(self.path, self.agent.lanes, self.agent.lane_owner).start()

    def restart(self) -> None:
        """What an agent restart does to lanes: every session ends, and a new agent with empty lanes
        picks the jobs up from its store."""
        self.server.stop()
        self._start()

    def register(self, job: str, persistent_gib: float = 1.0, ephemeral_gib: float = 4.0,
                 time_limit_s: float | None = None) -> None:
        self.agent.register({"job": job, "uid": os.getuid(), "user": "u", "gpus": [0], "shared": True,
                             "est_gib": persistent_gib + ephemeral_gib, "margin_gib": 1.0, "shards": 5,
                             "time_limit_s": time_limit_s,
                             "lanes": True, "persistent_bytes": int(persistent_gib * GiB),
                             "ephemeral_bytes": int(ephemeral_gib * GiB)})

    def spawn(self, job: str, *args: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "SLURM_JOB_ID": job, "GPUSHARE_LANES": "1", "GPUSHARE_LANE_SOCKET": str(self.path),
               "PYTHONPATH": lane_site_dir()}
        proc = subprocess.Popen([sys.executable, str(WORKER), str(self.tmp / f"{job}.log"), *args], env=env,
                                stderr=open(self.tmp / f"{job}.err", "wb"))
        self.procs.append(proc)
        return proc

    def log(self, job: str) -> list[str]:
        path = self.tmp / f"{job}.log"
        return path.read_text().splitlines() if path.exists() else []

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        self.server.stop()


@pytest.fixture
def node(tmp_path):
    made: list[Node] = []

    def _make(turn_limit_s: float = 600.0, policy: str = "round-robin") -> Node:
        made.append(Node(tmp_path, turn_limit_s, policy))
        return made[-1]

    yield _make
    for each in made:
        each.stop()


def turns(node: Node, jobs: list[str]) -> list[tuple[float, float, str]]:
    return completed_turns({job: node.log(job) for job in jobs})


def wait_done(procs, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.wait(max(1.0, deadline - time.monotonic()))


def start_together(n, jobs: list[str], iterations: str, go: Path) -> list[subprocess.Popen]:
    """One worker per job, each waiting for ``go`` once it has started; ``go`` is made when all have, so the
    jobs meet the lane together."""
    procs = [n.spawn(job, iterations, "0.05", str(go)) for job in jobs]
    deadline = time.monotonic() + 120
    while not all(any(line.startswith("pid") for line in n.log(job)) for job in jobs):
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.1)
    go.touch()
    return procs


def test_three_processes_take_turns_in_rotation(node, tmp_path):
    n = node(policy="round-robin")
    jobs = ["101", "102", "103"]
    for job in jobs:
        n.register(job)
    procs = start_together(n, jobs, "25", tmp_path / "go")
    wait_done(procs, 180)
    assert [p.returncode for p in procs] == [0, 0, 0], [(tmp_path / f"{j}.err").read_text() for j in jobs]
    order = turns(n, jobs)
    assert len(order) == 75
    for (_, end, _), (start, _, _) in zip(order, order[1:]):
        assert end <= start, "two jobs of one lane ran an iteration at the same time"
    # once all three have joined, and until the first one finishes, every three turns are three jobs
    seq = [job for _, _, job in order]
    first = max(seq.index(job) for job in jobs)
    last = min(max(i for i, j in enumerate(seq) if j == job) for job in jobs)
    assert last - first >= 6, seq
    for i in range(first, last - 1):
        assert len(set(seq[i:i + 3])) == 3, seq
    assert n.agent.lanes.snapshot()["lanes"] == []  # every job left its lane when its process ended


def test_a_killed_holder_loses_its_turn_and_the_others_finish(node, tmp_path):
    n = node(turn_limit_s=600.0)  # no demotion: the turn must come back because the process died
    for job in ("201", "202", "203"):
        n.register(job)
    victim = n.spawn("201", "1000", "0.5")
    deadline = time.monotonic() + 120
    while not n.log("201") or not n.log("201")[-1].startswith("start"):
        assert time.monotonic() < deadline, "victim never held its turn"
        time.sleep(0.02)
    others = [n.spawn("202", "5", "0.02"), n.spawn("203", "5", "0.02")]
    # kill the victim while it holds its turn and the others have started: a condition, not a fixed sleep
    # (under load the others take seconds to start, and the victim's 0.5 s turn may have passed to them)
    deadline = time.monotonic() + 120
    while not (all(n.log(job) for job in ("202", "203")) and n.log("201")[-1].startswith("start")
               and n.agent.lanes.board.holder("201")):
        assert time.monotonic() < deadline, f"victim not holding its turn with the others started: {n.log('201')[-3:]}"
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    wait_done(others, 120)
    assert [p.returncode for p in others] == [0, 0]
    assert len(turns(n, ["202", "203"])) == 10
    assert "201" not in n.agent.lanes.board.members


def test_a_holder_that_never_yields_is_demoted(node, tmp_path):
    n = node(turn_limit_s=1.0)
    for job in ("301", "302"):
        n.register(job)
    hog = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; sys.path.insert(0, sys.argv[1]); import gpushare_lanes as g\n"
        "s = g.LaneSession(sys.argv[2], '301'); s.turn(); print('held', flush=True); time.sleep(30)\n"
        "print(s.release(), flush=True)"), lane_site_dir(), str(n.path)],
        env={**os.environ, "SLURM_JOB_ID": "301"}, stdout=subprocess.PIPE, text=True)
    n.procs.append(hog)  # type: ignore[arg-type]
    assert hog.stdout is not None and hog.stdout.readline().strip() == "held"
    worker = n.spawn("302", "4", "0.02")
    wait_done([worker], 120)
    assert worker.returncode == 0, (tmp_path / "302.err").read_text()
    assert n.agent.lanes.demotions >= 1
    assert n.agent.lanes.board.members["301"].demoted >= 1


def test_only_the_jobs_own_processes_may_join(node, tmp_path):
    n = node()
    n.register("401")
    n.agent.register({"job": "402", "uid": os.getuid(), "user": "u", "gpus": [0], "shared": True,
                      "est_gib": 2.0, "margin_gib": 1.0, "shards": 3})  # not a lane job
    env = {**os.environ}
    env.pop("SLURM_JOB_ID", None)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import gpushare_lanes as g\n"
            "for job in sys.argv[3:]:\n"
            "    try: g.LaneSession(sys.argv[2], job); print('joined', job)\n"
            "    except g.LaneError as e: print('refused', job, e)\n")
    for job_env, job, expect in ((None, "401", "not one of job 401"), ("402", "402", "not a single-GPU lane job"),
                                 ("401", "999", "not running here")):
        if job_env:
            env["SLURM_JOB_ID"] = job_env
        done = subprocess.run([sys.executable, "-c", code, lane_site_dir(), str(n.path), job], env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.stdout.startswith("refused") and expect in done.stdout, done.stdout + done.stderr


def test_srtf_runs_the_job_with_the_least_time_limit_left_first(node, tmp_path):
    n = node(policy="srtf")
    limits = {"601": 7200.0, "602": 600.0}
    for job, limit in limits.items():
        n.register(job, time_limit_s=limit)
    procs = start_together(n, list(limits), "8", tmp_path / "go")
    wait_done(procs, 180)
    assert [p.returncode for p in procs] == [0, 0], [(tmp_path / f"{j}.err").read_text() for j in limits]
    seq = [job for _, _, job in turns(n, list(limits))]
    assert len(seq) == 16
    # once the short job has its first turn it keeps the lane to its end; the long one gets the rest
    first = seq.index("602")
    assert seq[first:first + 8] == ["602"] * 8 and set(seq[first + 8:]) <= {"601"}, seq


def test_jobs_rejoin_their_lane_after_an_agent_restart(node, tmp_path):
    n = node(policy="round-robin")
    jobs = ["501", "502"]
    for job in jobs:
        n.register(job)
    procs = [n.spawn(job, "40", "0.05") for job in jobs]
    deadline = time.monotonic() + 120
    while len(turns(n, jobs)) < 6:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no turns before the restart"
        time.sleep(0.05)
    n.restart()
    restarted_at = time.time()
    while set(n.agent.lanes.board.members) != set(jobs):
        assert time.monotonic() < deadline + 60, "the jobs did not join the restarted agent's lanes"
        time.sleep(0.05)
    wait_done(procs, 180)
    errs = [(tmp_path / f"{j}.err").read_text() for j in jobs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert all("joined the lane again" in err and "off for this run" not in err for err in errs), errs
    order = turns(n, jobs)
    assert len(order) == 80
    # after the iteration in flight at the restart, turns never overlap again: the new agent gates them
    later = [t for t in order if t[0] > restarted_at + 1.0]
    assert len(later) > 10 and {job for _, _, job in later} == set(jobs)
    for (_, end, _), (start, _, _) in zip(later, later[1:]):
        assert end <= start, "two jobs of one lane ran an iteration at the same time after the restart"
