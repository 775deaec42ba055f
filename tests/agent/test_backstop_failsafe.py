"""The backstop fails safe (gpushare.agent.failsafe): while the agent cannot register or attribute a job, it
stops nothing it cannot attribute with evidence, and never charges one job for another's memory. The agent
object on the simulated backend with a fake clock, real processes standing in for GPU processes (the
backstop SIGKILLs them), Slurm as a stand-in that fails the way a node short of tasks made it fail."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from gpushare.agent.daemon import Agent
from gpushare.agent.failsafe import FailSafe, hold_reason
from gpushare.agent.status_cli import render
from gpushare.config import parse_config
from gpushare.gpus import GiB
from gpushare.gres.sim_backend import SimBackend
from gpushare.prolog.slurmd_prolog import _register_locally
from gpushare.slurm.jobs import Job

SCENARIO = {"version": 1, "name": "failsafe", "processes": [], "gpus": [{"model": "a100-40gb"}]}
FACTS = {"uid": 1000, "user": "u1000", "gpus": [0], "shared": True, "est_gib": 4.0, "margin_gib": 1.0, "shards": 5}


class FailingSlurm:
    """``scontrol`` failing with EAGAIN (a node out of tasks), or answering with ``job`` once it recovers."""

    conf_path = bin_dir = None

    def __init__(self) -> None:
        self.answer: Job | None = None
        self.asked: list[str] = []

    def job(self, job_id: str) -> Job | None:
        self.asked.append(job_id)
        if self.answer is None:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        return self.answer


@pytest.fixture
def sleepers():
    started: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def make_agent(tmp_path, clock, pids, uids, slurm=None):
    backend = SimBackend.from_scenario(SCENARIO, clock=clock)
    cfg = parse_config({"agent": {"state_dir": str(tmp_path / "state"), "run_dir": str(tmp_path / "run"),
                                  "window_samples": 5, "collocation": "fraction", "backstop_grace_s": 2.0,
                                  "backstop_tolerance_mib": 256, "forecast_action": "none",
                                  "admin_comment": "no"}}).agent
    agent = Agent(cfg, backend, clock=clock, registry=CollectorRegistry(), pid_job=pids.get, pid_uid=uids.get,
                  slurm=slurm)
    return agent, backend, cfg


def run(agent, clock, seconds: int) -> None:
    for _ in range(seconds):
        agent.tick()
        agent.followup_pending()
        clock.advance(1.0)


@pytest.mark.hostile
def test_a_job_its_prolog_registered_alone_is_taken_from_the_store_and_runs_on(tmp_path, clock, sleepers):
    """The Prolog could not reach the agent and wrote the job store itself: the agent finds the job's
    processes there and tracks the job, instead of stopping them as unattributed memory (issue: exit 137
    41 s later)."""
    victim = sleepers()
    agent, sim, cfg = make_agent(tmp_path, clock, {victim.pid: "7"}, {victim.pid: 1000})
    _register_locally({"job": "7", **FACTS}, cfg, sim)
    sim.start_process(0, victim.pid, 3 * GiB)  # inside its 5 GiB share
    run(agent, clock, 60)
    assert victim.poll() is None
    assert "7" in agent.sampler.jobs and agent.sampler.jobs["7"].peak_bytes["0"] == 3 * GiB
    assert agent.snapshot()["unattributed"] == [] and agent.counters["unattributed_stops"] == 0


@pytest.mark.hostile
def test_while_slurm_fails_a_process_of_an_unregistered_job_is_recorded_not_stopped(tmp_path, clock, sleepers):
    """No registration anywhere and ``scontrol`` failing: the process claims a job the agent cannot confirm,
    so it is held (recorded once, not stopped); status and metrics say why. Once Slurm answers that the job
    may not run here, the evidence is there and it is stopped."""
    stray = sleepers()
    slurm = FailingSlurm()
    agent, sim, _ = make_agent(tmp_path, clock, {stray.pid: "9"}, {stray.pid: 1000}, slurm=slurm)
    sim.start_process(0, stray.pid, 8 * GiB)
    run(agent, clock, 60)
    assert stray.poll() is None and slurm.asked
    (record,) = agent.snapshot()["unattributed"]
    assert record["action"] == "hold" and "slurm" in record["held"] and record["claimed_job"] == "9"
    assert agent.counters["unattributed_stops"] == 0 and agent.counters["unattributed_held"] == 1
    status = agent.snapshot()
    assert status["failsafe"]["holding"] and "slurm" in status["failsafe"]["reasons"] and "backstop fail-safe" in render(status)
    assert agent.registry.get_sample_value("gpushare_agent_failsafe", {"reason": "slurm"}) == 1.0
    assert agent.registry.get_sample_value("gpushare_guard_actions_total", {"action": "unattributed_held"}) == 1.0
    slurm.answer = Job(job_id="9", states=("PENDING",), user_id=1000)  # Slurm back: not running here
    run(agent, clock, 40)
    assert stray.wait(10) == -9
    assert agent.snapshot()["unattributed"][-1]["action"] == "stop"
    assert agent.registry.get_sample_value("gpushare_agent_failsafe", {"reason": "slurm"}) == 0.0


@pytest.mark.hostile
def test_an_unregistered_jobs_memory_is_never_charged_to_its_users_other_job(tmp_path, clock, sleepers):
    """Two jobs of one user on one GPU, the second unregistered (its registration failed): its 11.7 GiB is
    its own, not the registered job's, which runs on inside its share."""
    innocent, other = sleepers(), sleepers()
    agent, sim, _ = make_agent(tmp_path, clock, {innocent.pid: "11", other.pid: "12"},
                               {innocent.pid: 1000, other.pid: 1000}, slurm=FailingSlurm())
    agent.register({"job": "11", **FACTS})
    sim.start_process(0, innocent.pid, 3 * GiB)
    sim.start_process(0, other.pid, int(11.7 * GiB))
    run(agent, clock, 60)
    assert innocent.poll() is None and other.poll() is None
    assert "oom" not in agent.store.get("11") and agent.sampler.jobs["11"].peak_bytes["0"] == 3 * GiB


def test_the_hold_decision():
    assert hold_reason(None, False, False, {}) is None  # a process of no job at all: evidence enough
    assert hold_reason("5", True, False, {}) is None  # claims a job that is tracked (another user's, or elsewhere)
    assert hold_reason("5", False, True, {}) is None  # Slurm said job 5 may not run here
    assert "not confirmed" in (hold_reason("5", False, False, {}) or "")
    assert "tick" in (hold_reason(None, False, False, {"tick": "sampling tick failed"}) or "")


def test_failsafe_reasons_clear_or_lapse():
    now = [0.0]
    failsafe = FailSafe(clock=lambda: now[0])
    failsafe.hold("tick", "sampling tick failed")
    failsafe.hold("threads", "cannot start a worker thread", for_s=60.0)
    assert set(failsafe.reasons()) == {"tick", "threads"}
    failsafe.clear("tick")
    now[0] = 61.0
    assert failsafe.snapshot() == {"holding": False, "reasons": {}}
