"""The backstop and the forecaster inside the agent: fake clock, simulated GPUs, a real process to stop."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from prometheus_client import CollectorRegistry

from gpushare.agent.backstop import judge, oom_message
from gpushare.agent.daemon import Agent
from gpushare.agent.enforce import append_to_job_log, bigger_share, requeue_early, stop_processes
from gpushare.node.jobs import final_record
from gpushare.config import parse_config
from gpushare.gpus import GiB, MiB
from gpushare.gres.sim_backend import SimBackend
from gpushare.slurm.gres_request import GresRequest

SCENARIO = {"version": 1, "name": "guard", "processes": [], "gpus": [{"model": "a100-40gb"}]}


def make_agent(tmp_path, clock, pids, uids=None, **agent):
    """``uids``: each pid's owner; by default the owner of the job it claims (an honest process), else 1000."""
    backend = SimBackend.from_scenario(SCENARIO, clock=clock)
    cfg = parse_config({"agent": {"state_dir": str(tmp_path / "state"), "run_dir": str(tmp_path / "run"),
                                  "window_samples": 5, "collocation": "fraction", **agent}}).agent
    holder: list[Agent] = []

    def uid_of(pid: int) -> int | None:
        if uids is not None:
            return uids.get(pid)
        acc = holder[0].sampler.jobs.get(pids.get(pid)) if holder else None
        return acc.uid if acc is not None else None

    holder.append(Agent(cfg, backend, clock=clock, registry=CollectorRegistry(), pid_job=lambda pid: pids.get(pid),
                        pid_uid=uid_of))
    return holder[0], backend


def register(agent, job_id, uid=1000):
    return agent.register({"job": job_id, "uid": uid, "user": f"u{uid}", "gpus": [0], "shared": True,
                           "est_gib": 4.0, "margin_gib": 1.0, "shards": 5})


@pytest.fixture
def victim():
    """A real process standing in for the job's GPU process (the backstop SIGKILLs it)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def test_judge_waits_for_the_grace_period():
    assert judge(5 * GiB, 5 * GiB, 0, 3.0, 10.0, None).state == "ok"
    first = judge(6 * GiB, 5 * GiB, 0, 3.0, 10.0, None)
    assert first.state == "over" and first.over_since == 10.0
    assert judge(6 * GiB, 5 * GiB, 0, 3.0, 13.0, first.over_since).state == "act"
    assert judge(5.2 * GiB, 5 * GiB, 512 * MiB, 3.0, 13.0, 10.0).state == "ok"  # within the tolerance
    assert judge(9 * GiB, 0, 0, 0.0, 1.0, None).state == "ok"  # no cap known: never acts


def test_backstop_stops_the_offender_and_records_its_own_oom(tmp_path, clock, victim):
    pids = {victim.pid: "11", 777: "12"}
    agent, sim = make_agent(tmp_path, clock, pids, backstop_grace_s=3.0, backstop_tolerance_mib=256,
                            forecast_action="none")
    register(agent, "11")
    register(agent, "12", uid=1001)
    sim.start_process(0, victim.pid, 4 * GiB)
    sim.start_process(0, 777, 3 * GiB)
    for _ in range(3):
        agent.tick()
        clock.advance(1.0)
    assert victim.poll() is None  # within its cap: untouched
    sim.update_process(victim.pid, memory_mib=7 * 1024)  # past 5 GiB + 256 MiB
    for _ in range(3):
        agent.tick()
        clock.advance(1.0)
    assert victim.poll() is None  # still inside the grace period
    agent.tick()
    assert victim.wait(10) == -9  # SIGKILL: the memory is freed at once
    entry = agent.store.get("11")
    oom = entry["oom"]
    assert oom["source"] == "agent-backstop" and oom["action"] == "stop" and oom["gpu"] == 0
    assert oom["peak_bytes"] == 7 * GiB and oom["cap_bytes"] == 5 * GiB and oom["tolerance_bytes"] == 256 * MiB
    assert oom["pids"] == [victim.pid] and oom["at"] - oom["over_since"] >= 3.0
    assert "oom" not in agent.store.get("12")  # the neighbour is left alone
    assert agent.counters["backstop_stops"] == 1
    record = agent.close("11")
    assert final_record(record, sim)["oom"]["source"] == "agent-backstop"


def test_backstop_record_only_does_not_stop(tmp_path, clock, victim):
    agent, sim = make_agent(tmp_path, clock, {victim.pid: "21"}, backstop="record", backstop_grace_s=0.0,
                            forecast_action="none")
    register(agent, "21")
    sim.start_process(0, victim.pid, 9 * GiB)
    agent.tick()
    assert agent.store.get("21")["oom"]["action"] == "record" and victim.poll() is None


def test_stop_processes_skips_a_pid_of_another_job(victim):
    assert stop_processes("5", [victim.pid, 1], lambda pid: "6") == []
    assert victim.poll() is None


def test_forecaster_warns_before_a_leak_reaches_the_cap(tmp_path, clock):
    agent, sim = make_agent(tmp_path, clock, {901: "31"}, forecast_horizon_s=60.0, forecast_confirm=3,
                            backstop="none")
    register(agent, "31")
    sim.start_process(0, 901, 2 * GiB)
    fired_at = None
    for second in range(120):
        sim.update_process(901, memory_mib=2048 + 40 * second)  # 40 MiB/s: 5 GiB cap at about 77 s
        agent.tick()
        if fired_at is None and agent.store.get("31").get("forecast"):
            fired_at = second
        clock.advance(1.0)
    assert fired_at is not None and 20 <= fired_at < 77  # well before the cap
    forecast = agent.store.get("31")["forecast"]
    assert forecast["source"] == "agent-forecast" and forecast["action"] == "warn"
    assert forecast["cap_bytes"] == 5 * GiB and forecast["predicted_bytes"] >= 5 * GiB
    assert agent.counters["forecast_warnings"] == 1  # fired once, not every tick


@pytest.fixture
def open_dir():
    """A directory other users can reach (pytest's own base directory is root-only)."""
    import shutil
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="gpushare-joblog-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_job_log_is_written_as_the_user_and_never_through_a_symlink(open_dir):
    if os.geteuid() != 0:
        pytest.skip("needs root to switch users")
    tmp_path = open_dir
    log = tmp_path / "job.out"
    log.write_text("started\n")
    os.chmod(tmp_path, 0o777)
    os.chown(log, 65534, 65534)
    assert append_to_job_log(str(log), 65534, 65534, "hello\n")
    assert log.read_text() == "started\nhello\n"
    secret = tmp_path / "root-only"
    secret.write_text("x")
    os.chmod(secret, 0o600)
    assert not append_to_job_log(str(secret), 65534, 65534, "nope\n")  # the user cannot write it
    link = tmp_path / "link.out"
    link.symlink_to(log)
    assert not append_to_job_log(str(link), 65534, 65534, "nope\n")  # O_NOFOLLOW
    assert not append_to_job_log(str(tmp_path / "absent.out"), 65534, 65534, "nope\n")  # never created
    assert log.read_text() == "started\nhello\n"


def test_oom_message_names_the_numbers():
    text = oom_message("7", {"action": "stop", "peak_bytes": 7 * GiB, "cap_bytes": 5 * GiB, "gpu": 0,
                             "tolerance_bytes": 512 * MiB, "at": 20.0, "over_since": 10.0})
    assert "GPU out of memory" in text and "7.00 GiB" in text and "5.00 GiB" in text and "10 s" in text


def test_bigger_share():
    assert bigger_share(GresRequest.parse("gres:shard:6"), 9.5 * GiB) == 11
    assert bigger_share(GresRequest.parse("gres/shard:6"), 2 * GiB) == 7  # always at least one more
    assert bigger_share(GresRequest.parse("gres:gpu:1"), 9 * GiB) is None


class FakeSlurm:
    """Records the scontrol calls requeue_early makes (SlurmClient's interface, typed Job records)."""

    def __init__(self, state="RUNNING", fail_update=False):
        from gpushare.slurm.jobs import Job

        self.job = Job(job_id="5", states=(state,), tres_per_node="gres:shard:6", requeue=True)
        self.calls: list[tuple] = []
        self.fail_update = fail_update

    def require_job(self, job_id):
        return self.job

    def requeue_hold(self, job_id):
        self.calls.append(("requeuehold", job_id))

    def update_job(self, job_id, **fields):
        self.calls.append(("update", job_id, fields))
        if self.fail_update:
            raise RuntimeError("refused")

    def release(self, job_id):
        self.calls.append(("release", job_id))


def test_requeue_early_holds_enlarges_and_always_releases():
    slurm = FakeSlurm()
    assert requeue_early(slurm, "5", 9 * GiB)
    assert slurm.calls == [("requeuehold", "5"), ("update", "5", {"gres": "shard:10"}), ("release", "5")]
    failing = FakeSlurm(fail_update=True)
    assert requeue_early(failing, "5", 9 * GiB)  # reruns with its old share rather than staying held
    assert failing.calls[-1] == ("release", "5")
    pending = FakeSlurm(state="PENDING")
    assert not requeue_early(pending, "5", 9 * GiB) and pending.calls == []


@pytest.fixture
def sleepers():
    """Real processes standing in for GPU processes of several users (the agent may SIGKILL them)."""
    started: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def two_users(tmp_path, clock, pids, uids):
    agent, sim = make_agent(tmp_path, clock, pids, uids=uids, backstop_grace_s=2.0, backstop_tolerance_mib=256,
                            forecast_action="none")
    register(agent, "11", uid=1000)  # the victim
    register(agent, "12", uid=2000)  # the other user's own job on the same GPU
    return agent, sim


def tick(agent, clock, seconds: int) -> None:
    for _ in range(seconds):
        agent.tick()
        clock.advance(1.0)


@pytest.mark.hostile
def test_a_process_claiming_another_users_job_is_billed_and_stopped_as_its_own_users(tmp_path, clock, sleepers):
    """Without job cgroups, another user's process exports SLURM_JOB_ID=<victim> and takes 8 GiB: it is
    its own user's job's memory (stopped there), never the victim's (issue 22, attack 2)."""
    victim, forger = sleepers(), sleepers()
    agent, sim = two_users(tmp_path, clock, {victim.pid: "11", forger.pid: "11"},
                           {victim.pid: 1000, forger.pid: 2000})
    sim.start_process(0, victim.pid, 3 * GiB)
    sim.start_process(0, forger.pid, 8 * GiB)
    tick(agent, clock, 4)
    assert forger.wait(10) == -9 and victim.poll() is None
    assert "oom" not in agent.store.get("11") and agent.sampler.jobs["11"].peak_bytes["0"] == 3 * GiB
    oom = agent.store.get("12")["oom"]
    assert oom["pids"] == [forger.pid] and oom["peak_bytes"] == 8 * GiB


@pytest.mark.hostile
def test_a_process_that_drops_its_job_id_is_still_its_jobs(tmp_path, clock, sleepers):
    """``env -u SLURM_JOB_ID python train.py`` inside one's own job: 20 GiB on a 5 GiB cap is stopped."""
    escaped = sleepers()
    agent, sim = two_users(tmp_path, clock, {}, {escaped.pid: 2000})
    sim.start_process(0, escaped.pid, 20 * GiB)
    tick(agent, clock, 4)
    assert escaped.wait(10) == -9
    assert agent.store.get("12")["oom"]["pids"] == [escaped.pid] and "oom" not in agent.store.get("11")


@pytest.mark.hostile
def test_a_process_of_no_job_on_its_gpu_is_stopped_and_recorded_billed_to_nobody(tmp_path, clock, sleepers):
    """A user with no job on this GPU runs on it claiming the victim's job id: an unattributed overrun."""
    victim, stranger = sleepers(), sleepers()
    agent, sim = two_users(tmp_path, clock, {victim.pid: "11", stranger.pid: "11"},
                           {victim.pid: 1000, stranger.pid: 3000})
    sim.start_process(0, victim.pid, 3 * GiB)
    sim.start_process(0, stranger.pid, 8 * GiB)
    tick(agent, clock, 2)
    assert stranger.poll() is None  # within the grace period (and the adoption retry: it claims a job id)
    tick(agent, clock, 40)
    assert stranger.wait(10) == -9 and victim.poll() is None
    (record,) = agent.snapshot()["unattributed"]
    assert (record["pid"], record["uid"], record["claimed_job"], record["action"]) == (stranger.pid, 3000, "11", "stop")
    assert record["pids"] == [stranger.pid] and agent.counters["unattributed_stops"] == 1
    assert agent.sampler.jobs["11"].peak_bytes["0"] == 3 * GiB and "oom" not in agent.store.get("11")
    assert "oom" not in agent.store.get("12")


@pytest.mark.hostile
def test_a_lane_job_is_held_to_its_charge_outside_its_turn(tmp_path, clock, sleepers):
    """A lane job is charged persistent + half its ephemeral (shard:4 for 1 + 4 GiB, +1 GiB margin): it may
    use its full estimate only while it holds its lane's turn. Demoted, or never joined, it is stopped at
    its charge (issue 22, attack 3)."""
    demoted, holder, loner = sleepers(), sleepers(), sleepers()
    pids = {demoted.pid: "7", holder.pid: "8", loner.pid: "9"}
    agent, sim = make_agent(tmp_path, clock, pids, backstop_grace_s=2.0, backstop_tolerance_mib=256,
                            forecast_action="none", lane_turn_limit_s=60.0)
    for job in ("7", "8", "9"):
        agent.register({"job": job, "uid": 1000, "user": "u", "gpus": [0], "shared": True, "est_gib": 5.0,
                        "margin_gib": 1.0, "shards": 4, "lanes": True, "persistent_bytes": GiB,
                        "ephemeral_bytes": 4 * GiB})
    assert agent.sampler.jobs["7"].lane_cap_bytes == 4 * GiB and agent.sampler.jobs["7"].cap_bytes == 6 * GiB
    agent.lanes.join("7")
    assert agent.lanes.turn("7", lambda: True, 0)["granted"]
    agent.lanes.join("8")
    assert not agent.lanes.turn("8", lambda: True, 0)["granted"]  # waits behind 7
    sim.start_process(0, demoted.pid, int(5.5 * GiB))  # its turn: up to its full 6 GiB
    sim.start_process(0, holder.pid, int(3.5 * GiB))  # waiting: within its 4 GiB charge
    tick(agent, clock, 4)
    assert demoted.poll() is None and holder.poll() is None
    assert agent.lanes.board.overdue(time.monotonic() + 1000.0, 60.0) == ["7"]  # demoted: 8 gets the turn
    sim.update_process(holder.pid, memory_mib=5.5 * 1024)
    sim.start_process(0, loner.pid, int(5.5 * GiB))  # a lane job that never joined its lane (python -S)
    tick(agent, clock, 4)
    assert demoted.wait(10) == -9 and loner.wait(10) == -9 and holder.poll() is None
    for job in ("7", "9"):
        oom = agent.store.get(job)["oom"]
        assert oom["lane"] == "off-turn" and oom["cap_bytes"] == 4 * GiB
    assert "oom" not in agent.store.get("8")
    assert "outside its lane turn" in oom_message("9", agent.store.get("9")["oom"])


@pytest.mark.hostile
def test_the_neighbours_of_a_job_over_its_cap_are_marked_as_its_possible_victims(tmp_path, clock):
    """From the first sample it is over its cap (grace or not), every other shared job on its GPU carries
    ``collateral`` naming it, once; the offender itself does not."""
    agent, sim = make_agent(tmp_path, clock, {801: "11", 802: "12"}, backstop="record", backstop_grace_s=5.0,
                            forecast_action="none")
    register(agent, "11")
    register(agent, "12", uid=1001)
    sim.start_process(0, 801, 3 * GiB)
    sim.start_process(0, 802, 2 * GiB)
    tick(agent, clock, 2)
    assert "collateral" not in agent.store.get("12")
    sim.update_process(801, memory_mib=30 * 1024)
    agent.tick()
    note = agent.store.get("12")["collateral"]
    assert note == {"by": "11", "gpu": 0, "at": clock()} and "collateral" not in agent.store.get("11")
    tick(agent, clock, 3)
    assert agent.store.get("12")["collateral"] == note  # once per offender
    assert final_record(agent.close("12"), sim)["collateral"] == note  # the run record carries it too


@pytest.mark.hostile
def test_a_job_over_its_cap_on_a_full_gpu_is_stopped_at_the_first_sample(tmp_path, clock, sleepers):
    """The grace period spares spikes nobody pays for; on a GPU with a neighbour and no memory left, the
    overrun is the neighbour's memory, so it is stopped at once (issue 22: 10-11 s before)."""
    offender, neighbour = sleepers(), sleepers()
    agent, sim = make_agent(tmp_path, clock, {offender.pid: "11", neighbour.pid: "12"}, backstop_grace_s=10.0,
                            forecast_action="none")
    register(agent, "11")
    register(agent, "12", uid=1001)
    sim.start_process(0, neighbour.pid, 4 * GiB)  # within its 5 GiB cap
    sim.start_process(0, offender.pid, 36 * GiB)  # 4 + 36 = the whole 40 GiB
    agent.tick()
    assert offender.wait(10) == -9 and neighbour.poll() is None
    assert agent.store.get("11")["oom"]["at"] == agent.store.get("11")["oom"]["over_since"]
