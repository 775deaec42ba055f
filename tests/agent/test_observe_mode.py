"""Observe mode on a node, with a fake clock and the simulated backend: a job that ``[policy] mode = "observe"``
left on its whole GPU is neither capped nor stopped, and the agent logs and records the cap it would have had
and the stop its backstop would have made (gpushare.policy.observe)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpushare.node.comment import run_summary
from gpushare.agent.daemon import Agent
from gpushare.node.jobs import clean_facts, final_record, registration_facts
from gpushare.config import parse_config
from gpushare.gpus import GiB
from gpushare.gres.sim_backend import SimBackend
from gpushare.policy.observe import Shadow, would_share
from gpushare.slurm import record as record_format
from gpushare.slurm.jobs import job_from_json

SCENARIO = {"version": 1, "name": "observe", "processes": [],
            "gpus": [{"model": "a100-40gb", "idle_power_w": 50, "max_power_w": 350}]}
# what gpushare-submitd records in observe mode (slurm_plugins/scope.py ``observed``): the request untouched
OBSERVED = ('gpushare:{"v":1,"decision":"observe","would":"shared","old":"gres:gpu:1","new":"gres:shard:5",'
            '"est_gib":4.0,"margin_gib":1.0}')


class Slurm:
    """scontrol as the agent sees it: one running job whose AdminComment takes updates."""

    def __init__(self, comment: str) -> None:
        self.comment, self.updates = comment, 0

    def job(self, job_id: str) -> Any:
        return job_from_json({"job_id": int(job_id), "job_state": "RUNNING", "user_id": 1000, "user_name": "u1000",
                              "nodes": "n1", "tres_per_node": "gres:gpu:1", "admin_comment": self.comment})

    def update_job(self, job_id: str, **fields: str) -> None:
        self.comment, self.updates = fields["admincomment"], self.updates + 1


def make_agent(tmp_path, clock) -> tuple[Agent, SimBackend, CollectorRegistry]:
    backend = SimBackend.from_scenario(SCENARIO, clock=clock)
    cfg = parse_config({"agent": {"state_dir": str(tmp_path / "state"), "run_dir": str(tmp_path / "run"),
                                  "window_samples": 5, "flush_every_s": 3.0, "collocation": "fraction"}}).agent
    registry = CollectorRegistry()
    agent = Agent(cfg, backend, clock=clock, registry=registry, pid_job={501: "7"}.get, pid_uid=lambda pid: 1000)
    return agent, backend, registry


def run(agent: Agent, clock, seconds: int) -> None:
    for _ in range(seconds):
        agent.tick()
        clock.advance(1.0)


def test_an_observed_job_runs_uncapped_and_unstopped_and_what_would_have_happened_is_recorded(tmp_path, clock,
                                                                                               caplog) -> None:
    slurm = Slurm(OBSERVED)
    facts = registration_facts("7", 1000, "u1000", [0], slurm.job("7"))
    assert facts["shared"] is False and (facts["would_mib"], facts["would_shards"]) == (5120, 5)  # 4 + 1 GiB
    agent, sim, registry = make_agent(tmp_path, clock)
    agent.slurm = slurm
    with caplog.at_level(logging.INFO, logger="gpushare.agent"):
        entry = agent.register(facts)
    assert entry["caps"]["mode"] == "none" and not entry["caps"].get("mem_limit_mib")  # its whole GPU, uncapped
    assert "observe mode: would have run shared as shard:5 with a 5.00 GiB memory cap" in caplog.text

    sim.start_process(0, 501, 3 * GiB)
    sim.update_process(501, smact=0.5)
    run(agent, clock, 3)
    agent.annotate_pending()
    assert record_format.parse(slurm.comment)["run"]["would"] == {"cap_gib": 5.0}  # with its first kernel
    assert record_format.parse(slurm.comment)["decision"] == "observe"  # the submit record is kept

    sim.update_process(501, memory_mib=8 * 1024)  # above 5 GiB + the backstop's 0.5 GiB tolerance
    run(agent, clock, 9)
    assert agent.counters["observe_would_stop"] == 0  # still inside the backstop's 10 s grace
    with caplog.at_level(logging.WARNING, logger="gpushare.agent"):
        run(agent, clock, 4)
    assert agent.counters["observe_would_stop"] == 1 and agent.counters["backstop_stops"] == 0
    assert [p.pid for p in sim.processes(0)] == [501]  # left running
    assert "observe mode: the backstop would have stopped it: 8.00 GiB on GPU 0 above its would-be cap of 5.00 GiB" \
        in caplog.text
    agent.annotate_pending()
    assert record_format.parse(slurm.comment)["run"]["would"] == {"cap_gib": 5.0, "stop": "backstop", "over_gib": 8.0}
    assert registry.get_sample_value("gpushare_guard_actions_total", {"action": "observe_would_stop"}) == 1.0
    run(agent, clock, 20)
    assert agent.counters["observe_would_stop"] == 1  # once a job

    closed = agent.close("7")
    assert closed is not None
    summary = run_summary(final_record(closed, sim, node="n1"))
    assert summary["would"] == {"cap_gib": 5.0, "stop": "backstop", "over_gib": 8.0} and "cap_gib" not in summary


def test_only_an_observe_decision_that_would_share_gives_a_would_be_cap() -> None:
    shared = 'gpushare:{"v":1,"decision":"shared","new":"gres:shard:5","est_gib":4.0,"margin_gib":1.0}'
    assert "would_mib" not in registration_facts("7", 1000, "u", [0], Slurm(shared).job("7"))
    exclusive = OBSERVED.replace('"would":"shared"', '"would":"exclusive"')
    assert "would_mib" not in registration_facts("7", 1000, "u", [0], Slurm(exclusive).job("7"))
    assert would_share({"decision": "observe", "would": "shared", "new": "gres/shard:3"}) == (3, None, None)
    assert would_share({"decision": "observe", "would": "shared", "new": "gres:gpu:1"}) is None
    # without an estimate the grant is the cap; a hostile value is refused at the agent's door
    assert registration_facts("7", 1000, "u", [0], Slurm(OBSERVED.replace(',"est_gib":4.0', "")).job("7"))[
        "would_mib"] == 5 * 1024
    base = {"job": "7", "uid": 1000, "gpus": [0], "shared": False}
    with pytest.raises(ValueError, match="would_mib"):
        clean_facts({**base, "would_mib": -1, "would_shards": 5})
    assert clean_facts({**base, "would_mib": 5120, "would_shards": 5})["would_mib"] == 5120


def test_the_shadow_backstop_keeps_grace_per_gpu_and_forgets_a_closed_job() -> None:
    shadow = Shadow(tolerance_bytes=GiB // 2, grace_s=10.0)
    assert shadow.check(0.0, "7", 5 * GiB, {"0": 6 * GiB}) is None
    assert shadow.check(5.0, "7", 5 * GiB, {"0": 5 * GiB}) is None  # back under: the grace starts again
    assert shadow.check(6.0, "7", 5 * GiB, {"0": 6 * GiB}) is None
    found = shadow.check(16.0, "7", 5 * GiB, {"0": 7 * GiB})
    assert found is not None and found["over_since"] == 6.0 and found["peak_bytes"] == 7 * GiB
    assert found["action"] == "would-stop"
    assert shadow.check(40.0, "7", 5 * GiB, {"0": 9 * GiB}) is None  # reported once
    shadow.forget("7")
    assert shadow.check(41.0, "7", 0, {"0": 9 * GiB}) is None  # no would-be cap: nothing to judge
