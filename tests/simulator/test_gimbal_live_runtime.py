"""Gimbal's two modes in the simulator: live (what the node agent does with stock MPS: only a starting job's
share is chosen, running jobs keep theirs, nothing is charged) and runtime recalibration (every job's cap
re-coordinated at boundaries and per measurement window, 3.6 s of work per change of a running job)."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushare.policy import gimbal as gb
from gpushare.node.jobs import thread_percentage_for
from gpushare.simulator.engine import SimConfig
from gpushare.simulator.gimbal import RECALIBRATE_S, RECONFIG_S, WINDOW_S, GimbalSimulation
from gpushare.simulator.interference import Interference
from gpushare.simulator.trace import parse

# a short and a long heavy job start together (kernels at t=10); a third arrives while the long one runs
PAIR = """job_id,submit_s,duration_s,mem_gib,util,ttfk_s
a,0,600,10,heavy,10
b,0,3000,10,heavy,10
c,1200,900,10,heavy,10
"""
MIX = """job_id,submit_s,duration_s,mem_gib,util,ttfk_s,gpus
a,0,3000,30,heavy,10,1
b,0,600,20,heavy,10,1
c,60,300,12,medium,10,1
d,120,900,8,light,10,1
e,120,400,25,heavy,10,2
f,300,200,3,light,10,1
g,900,1500,6,heavy,10,1
h,1000,700,6,medium,10,1
"""


def run(text, policy, gpus=1, cls=GimbalSimulation):
    config = SimConfig(gpus_per_node=gpus, policy=policy, interference="gavel", util="classes")
    return cls(parse(text, "t.csv"), config, Interference(None, mode="gavel")).run()


def caps_by_job(sim):
    seen = defaultdict(list)
    for _, gpu, job, percent in sim.cap_log:
        seen[(gpu, job)].append(percent)
    return seen


@pytest.mark.parametrize("policy", ["gimbal-jct", "gimbal-makespan"])
@pytest.mark.parametrize("text,gpus", [(PAIR, 1), (MIX, 2)])
def test_live_caps_of_running_jobs_never_change(policy, text, gpus):
    sim = run(text, policy, gpus)
    assert all(j.state == "done" for j in sim.jobs.values())
    restarted = {j for j, run_ in sim.jobs.items() if run_.ooms}
    for (_, job), percents in caps_by_job(sim).items():
        if job not in restarted:  # a requeued job starts again and gets a new share, like on the node
            assert len(percents) == 1, (job, percents)
    assert sim.reconfigurations == 0 and sim.switch_log == []
    assert len(sim.decisions) >= len(sim.jobs)


def test_live_keeps_a_squeezed_job_squeezed_after_its_co_runner_leaves():
    # JCT, equal priorities: b starts beside a (a decided first, alone, 100 %) and is the one squeezed;
    # with stock MPS it keeps that share after a ends, where runtime recalibration swells it back
    live = run(PAIR, "gimbal-jct")
    share_b = caps_by_job(live)[(0, "b")]
    assert share_b[0] < 100 and len(share_b) == 1
    runtime = run(PAIR, "gimbal-jct-runtime")
    a_end = runtime.jobs["a"].end
    assert any(p < 100 for t, _, _, p in runtime.cap_log if t < a_end)  # the pair was squeezed
    b_at_a_end = [p for t, _, job, p in runtime.cap_log if job == "b" and t <= a_end][-1]
    assert b_at_a_end == 100  # alone again: swelled at once (live keeps its start share)


@pytest.mark.parametrize("policy", ["gimbal-jct-runtime", "gimbal-makespan-runtime"])
def test_runtime_changes_running_caps_and_charges_each_change(policy):
    sim = run(PAIR, policy)
    assert all(j.state == "done" for j in sim.jobs.values())
    assert sim.reconfigurations > 0 and len(sim.switch_log) == sim.reconfigurations
    assert all(old != new for _, _, old, new in sim.switch_log)
    # no window is left pending past the last completion (it would add idle energy to the run)
    assert sim.now == pytest.approx(max(j.end for j in sim.jobs.values()))
    # every change of a running job comes from the log of caps, which never leaves 10..100 in steps of 10
    assert all(p % 10 == 0 and 10 <= p <= 100 for *_, p in sim.cap_log)
    # searches advance one measurement window at a time: trial plans are WINDOW_S or RECALIBRATE_S apart
    times = sorted({t for t, *_ in sim.switch_log})
    starts = {j.first_start + j.spec.ttfk_s for j in sim.jobs.values()} | {j.end for j in sim.jobs.values()}
    assert any(t not in starts for t in times), "caps also change while the job set stays the same"


def test_a_change_costs_reconfig_s_of_work_once_per_instant():
    sim = GimbalSimulation(parse(MIX, "t.csv"), SimConfig(gpus_per_node=2, policy="gimbal-jct-runtime"),
                           Interference(None, mode="gavel"))
    sim.caps = {0: {"e": 100, "a": 100}, 1: {"e": 100}}
    before = sim.jobs["e"].remaining
    sim._apply(0, {"e": 60, "a": 100})
    sim._apply(1, {"e": 60})  # the same job's worker on its second GPU switches in parallel
    assert sim.jobs["e"].remaining == pytest.approx(before + RECONFIG_S)
    assert sim.reconfigurations == 1 and sim.jobs["a"].remaining == pytest.approx(3000)
    sim.now = WINDOW_S
    sim._apply(0, {"e": 50, "a": 100})
    assert sim.jobs["e"].remaining == pytest.approx(before + 2 * RECONFIG_S) and sim.reconfigurations == 2
    assert RECALIBRATE_S >= WINDOW_S


class AgentView(GimbalSimulation):
    """The simulator seeing only what the node agent knows: Slurm time left, a busy GPU (demand 1.0)."""

    def features(self, job_id):
        return gb.GimbalJob(job_id, max(60.0, self.jobs[job_id].remaining), 1.0)


@pytest.mark.parametrize("policy", ["gimbal-jct", "gimbal-makespan"])
@pytest.mark.parametrize("text,gpus", [(PAIR, 1), (MIX, 2)])
def test_the_agents_share_for_a_starting_job_equals_the_simulators(policy, text, gpus):
    sim = run(text, policy, gpus, cls=AgentView)
    cfg = SimpleNamespace(thread_policy=policy, mps_thread_percentage=100)
    assert sim.decisions
    for now, starting, running, share in sim.decisions:
        corunners = [{"job": job.job_id, "time_limit_s": job.remaining_s, "start": now,
                      "caps": {"mode": "mps", "thread_percentage": percent}} for job, percent in running]
        facts = {"job": starting.job_id, "time_limit_s": starting.remaining_s}
        assert thread_percentage_for(facts, corunners, cfg, now) == share, (now, starting, running)
    if policy == "gimbal-jct":
        assert any(share < 100 for *_, share in sim.decisions), "the comparison includes squeezes"


@settings(max_examples=80, deadline=None)
@given(st.floats(60, 1e5), st.lists(st.tuples(st.floats(60, 1e5), st.sampled_from(range(10, 101, 10))),
                                     min_size=1, max_size=3),
       st.sampled_from(["gimbal-jct", "gimbal-makespan"]))
def test_agent_and_starting_share_agree_everywhere(remaining, running, policy):
    cfg = SimpleNamespace(thread_policy=policy, mps_thread_percentage=100)
    corunners = [{"job": f"r{k}", "time_limit_s": r, "start": 0.0, "caps": {"mode": "mps", "thread_percentage": p}}
                 for k, (r, p) in enumerate(running)]
    expected = gb.starting_share(gb.GimbalJob("s", remaining, 1.0),
                                 [(gb.GimbalJob(f"r{k}", r, 1.0), p) for k, (r, p) in enumerate(running)],
                                 policy.removeprefix("gimbal-"))
    assert thread_percentage_for({"job": "s", "time_limit_s": remaining}, corunners, cfg, 0.0) == expected


def test_starting_share_never_moves_running_jobs_and_can_only_gain():
    running = [(gb.GimbalJob("a", 500, 0.9), 100)]
    starting = gb.GimbalJob("b", 500, 0.9)
    share = gb.starting_share(starting, running, "jct")
    assert share < 100  # equal priorities: the starting job is the one squeezed
    jobs = [running[0][0], starting]
    chosen = gb.thread_share_speeds(jobs, {"a": 100, "b": share})
    free = gb.thread_share_speeds(jobs, {"a": 100, "b": 100})
    assert gb.objective_value(jobs, chosen, "jct") < gb.objective_value(jobs, free, "jct")
    # a longer starting job under makespan has the higher priority: it keeps the whole GPU
    assert gb.starting_share(gb.GimbalJob("b", 5000, 0.9), running, "makespan") == 100
    assert gb.starting_share(starting, [], "jct") == 100


def test_search_one_window_at_a_time_reaches_coordinates_plan():
    jobs = [gb.GimbalJob("heavy", 100, 0.9), gb.GimbalJob("medium", 100, 0.6)]
    search = gb.start_search(jobs, "jct", gb.thread_share_speeds(jobs, {"heavy": 100, "medium": 100}))
    steps = 0
    while not search.done:
        search = search.measured(gb.objective_value(jobs, gb.thread_share_speeds(jobs, search.plan), "jct"))
        steps += 1
    assert search.plan == gb.coordinate(jobs, "jct") and steps >= 1 + gb.PATIENCE
