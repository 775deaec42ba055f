"""Salus and Gimbal policies in the simulator: each runs on small traces and keeps its invariants at
every event (Salus: admitted memory within capacity; Gimbal: caps multiples of 10 within 10..100)."""

import pytest
from click.testing import CliRunner

from gpushare.simulator import memory_split, report
from gpushare.simulator.cli import command
from gpushare.simulator.engine import SimConfig
from gpushare.simulator.gimbal import GimbalSimulation
from gpushare.simulator.interference import Interference
from gpushare.simulator.runner import simulation
from gpushare.simulator.salus import EXECUTION_OVERHEAD, ITERATION_S, SWITCH_S, SalusSimulation
from gpushare.simulator.sweep import hyperparameter_sweep
from gpushare.simulator.trace import parse

SALUS = ("salus-pack", "salus-srtf", "salus-fair")
GIMBAL = ("gimbal-jct", "gimbal-makespan", "gimbal-jct-runtime", "gimbal-makespan-runtime", "gimbal-free")

MIX = """job_id,submit_s,duration_s,mem_gib,util,ttfk_s,gpus
a,0,3000,30,heavy,10,1
b,0,600,20,heavy,10,1
c,60,300,12,medium,10,1
d,120,900,8,light,10,1
e,120,400,25,heavy,10,2
f,300,200,3,light,10,1
"""


def _checked(cls):
    class Checked(cls):
        violations: list = []
        events = 0

        def _update_rates(self):
            super()._update_rates()
            self.events += 1
            for gpu in self.gpus:
                if isinstance(self, SalusSimulation):
                    if self.lanes[gpu.index].admitted_bytes > gpu.capacity_bytes:
                        self.violations.append((self.now, gpu.index))
                    if self.cluster.used_bytes(gpu.index) > gpu.capacity_bytes:
                        self.violations.append((self.now, gpu.index, "backend"))
    return Checked


def run(text_or_jobs, policy, gpus=2, mode="gavel"):
    jobs = parse(text_or_jobs, "t.csv") if isinstance(text_or_jobs, str) else text_or_jobs
    config = SimConfig(gpus_per_node=gpus, policy=policy, interference=mode, util="classes")
    cls = SalusSimulation if policy.startswith("salus") else GimbalSimulation
    return _checked(cls)(jobs, config, Interference(None, mode=mode)).run()


@pytest.mark.parametrize("policy", SALUS)
@pytest.mark.parametrize("mode", ["gavel", "share"])
def test_salus_runs_and_never_admits_beyond_capacity(policy, mode):
    sim = run(MIX, policy, mode=mode)
    assert all(j.state == "done" for j in sim.jobs.values())
    assert sim.events > 0 and sim.violations == []
    assert sum(j.ooms for j in sim.jobs.values()) == 0
    assert 0 < sim.max_admitted_fraction <= 1


def test_salus_lane_time_sharing_follows_the_policy():
    # one GPU of 40 GiB: a (P 3, E 27) and b (P 2, E 18) cannot both open lanes (3+27+2+18 > 40) -> b joins a's lane
    text = """job_id,submit_s,duration_s,mem_gib,util,ttfk_s
a,0,1000,30,heavy,10
b,0,100,20,heavy,10
"""
    ends = {p: run(text, p, gpus=1).jobs for p in SALUS}
    solo = 1 / EXECUTION_OVERHEAD
    # PACK: a has the lane first, b waits for its turn until a ends
    assert ends["salus-pack"]["a"].end == pytest.approx(10 + 1000 * solo)
    assert ends["salus-pack"]["b"].end == pytest.approx(10 + 1100 * solo)
    # SRTF: b (shorter) pre-empts a (both first kernels at 10, a's event first) and pays the switch; a
    # taking the lane back from a finished job is not charged (a pre-emption is what costs a switch)
    assert ends["salus-srtf"]["b"].end == pytest.approx(10 + (100 + SWITCH_S) * solo)
    assert ends["salus-srtf"]["a"].end == pytest.approx(10 + (1100 + SWITCH_S) * solo)
    # FAIR: equal shares with a switch per iteration
    fair = solo * (ITERATION_S + SWITCH_S) / ITERATION_S
    assert ends["salus-fair"]["b"].end == pytest.approx(10 + 200 * fair)
    assert ends["salus-fair"]["a"].end == pytest.approx(10 + 200 * fair + 900 * solo)


def test_salus_lanes_side_by_side_when_memory_allows():
    text = """job_id,submit_s,duration_s,mem_gib,util,ttfk_s
a,0,100,4,light,10
b,0,100,4,light,10
"""
    sim = run(text, "salus-pack", gpus=1, mode="share")
    assert len({j.end for j in sim.jobs.values()}) == 1  # two lanes, same speed, same end
    assert sim.jobs["a"].end == pytest.approx(10 + 100 / (EXECUTION_OVERHEAD * 0.95))


@pytest.mark.parametrize("policy", GIMBAL)
def test_gimbal_runs_and_caps_are_valid(policy):
    sim = run(MIX, policy)
    assert all(j.state == "done" for j in sim.jobs.values())
    assert sim.cap_log, "a decision is logged at every job start (and, -runtime, every change)"
    assert all(p % 10 == 0 and 10 <= p <= 100 for _, _, _, p in sim.cap_log)
    assert all(len(plan) <= 2 for plan in sim.caps.values())  # Gimbal §5.1: two jobs per GPU
    if policy == "gimbal-free":
        assert {p for *_, p in sim.cap_log} == {100} and sim.reconfigurations == 0
    if not policy.endswith("-runtime"):  # live: running jobs keep the share they started with
        assert sim.reconfigurations == 0


@pytest.mark.parametrize("policy", ["gimbal-jct", "gimbal-jct-runtime"])
def test_gimbal_squeezes_a_heavy_pair(policy):
    text = """job_id,submit_s,duration_s,mem_gib,util,ttfk_s
a,0,1000,10,heavy,10
b,0,1000,10,heavy,10
"""
    free = run(text, "gimbal-free", gpus=1)
    jct = run(text, policy, gpus=1)
    assert any(p < 100 for *_, p in jct.cap_log)
    mean = lambda s: sum(j.end for j in s.jobs.values()) / 2  # noqa: E731
    assert mean(jct) < mean(free)


def test_runner_picks_the_engine():
    jobs = parse(MIX, "t.csv")
    assert type(simulation(jobs, SimConfig(policy="magm"))).__name__ == "Simulation"
    assert isinstance(simulation(jobs, SimConfig(policy="salus-fair")), SalusSimulation)
    assert isinstance(simulation(jobs, SimConfig(policy="gimbal-makespan")), GimbalSimulation)


def test_sweep_is_seeded_and_small():
    a, b = hyperparameter_sweep(30, seed=4), hyperparameter_sweep(30, seed=4)
    assert a == b and a != hyperparameter_sweep(30, seed=5)
    assert all(j.gpus == 1 and j.submit_s == 0 and j.mem_gib < 10 and j.util == "light" for j in a)
    with pytest.raises(ValueError):
        hyperparameter_sweep(0)


def test_memory_split_by_family():
    jobs = parse("job_id,submit_s,model,batch\nx,0,resnet50,64\ny,0,BERT_base,32\nz,0,resnet18,32\n", "t.csv")
    fractions = {j.job_id: memory_split.split(j)[0] / sum(memory_split.split(j)) for j in jobs}
    assert fractions == pytest.approx({"x": 0.10, "y": 0.35, "z": 0.15}, abs=1e-6)


@pytest.mark.parametrize("policy", SALUS + GIMBAL)
def test_cli_runs_each_new_policy_on_a_sweep(policy, tmp_path):
    result = CliRunner().invoke(command, ["--policy", policy, "--sweep", "12", "--data-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "12 completed" in result.output


def test_summary_of_a_salus_run():
    summary = report.summarise(run(MIX, "salus-srtf"))
    assert summary["completed"] == 6 and summary["energy_mj"] > 0
