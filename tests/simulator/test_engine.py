"""The event engine on tiny hand-checked traces: timings, collocation, TTFK, OOM and recovery."""

import pytest

from gpushare.simulator.engine import SimConfig, Simulation
from gpushare.simulator.interference import Interference
from gpushare.simulator.trace import parse


def run(text, policy="magm", estimator="oracle", gpus=1, recovery=True, mode="share"):
    jobs = parse(text, "t.csv")
    config = SimConfig(gpus_per_node=gpus, policy=policy, estimator=estimator, recovery=recovery, interference=mode,
                       util="classes")  # the hand-computed figures below use the assumed classes
    return Simulation(jobs, config, Interference(None, mode=mode)).run()


TWO_LIGHT = """job_id,submit_s,duration_s,mem_gib,util,ttfk_s
a,0,100,4,light,10
b,0,100,4,light,10
"""


def test_exclusive_runs_one_after_the_other():
    # a: dispatched 0, kernel 10, 100 s of work -> ends 110; b waits for the idle GPU -> 110..220
    sim = run(TWO_LIGHT, policy="exclusive")
    a, b = sim.jobs["a"], sim.jobs["b"]
    assert (a.first_start, a.end) == (0, 110)
    assert (b.first_start, b.end) == (110, 220)
    assert b.wait_s == 110 and b.exec_s == 110


def test_magm_collocates_after_the_ttfk_window():
    # a dispatched at 0, first kernel at 10: the GPU is warming until 10 + 30 = 40, and b (blocked at the
    # head of the queue) retries on 5 s polls -> placed at 40, its kernel at 50.
    # a alone 10..50: 40 s of work. Together (share model, two light jobs, SMACT .3+.3 < 1): speed .95.
    # a's remaining 60 s take 60/.95 = 63.158 s -> a ends 113.158; b then has 40 s left alone -> 153.158
    sim = run(TWO_LIGHT)
    a, b = sim.jobs["a"], sim.jobs["b"]
    assert b.first_start == 40
    assert a.end == pytest.approx(50 + 60 / 0.95)
    assert b.end == pytest.approx(50 + 60 / 0.95 + 40)
    assert a.gpus == b.gpus == [0]


OOM = """job_id,submit_s,duration_s,mem_gib,util,ttfk_s
a,0,100,30,light,10
b,0,100,20,light,10
"""


def test_oom_then_exclusive_recovery():
    # no estimate: MAGM only needs the 2 GB precondition. a: 0..110 alone. b placed at 40 (10 GiB free,
    # after a's TTFK window), first kernel at 50: 30 + 20 GiB > 40 GiB -> b OOMs, a survives.
    # b goes to the recovery queue, waits for an idle GPU (a ends 110) -> 110, kernel 120, ends 220.
    sim = run(OOM, estimator="none")
    a, b = sim.jobs["a"], sim.jobs["b"]
    assert a.end == 110 and a.ooms == 0
    assert b.ooms == 1 and b.recovered and b.state == "done"
    assert b.end == 220
    assert b.exec_s == pytest.approx(10 + 110) and b.wait_s == pytest.approx(40 + 60)


def test_oom_without_recovery_fails_the_job():
    sim = run(OOM, estimator="none", recovery=False)
    assert sim.jobs["b"].state == "failed" and sim.jobs["b"].reason == "out of memory"


def test_oracle_estimate_avoids_the_oom():
    # b's request is 20 + 2 GiB > 10 GiB free: it waits for a (110) and runs 110..220 without an OOM
    sim = run(OOM, estimator="oracle")
    assert sim.jobs["b"].ooms == 0 and sim.jobs["b"].first_start == 110 and sim.jobs["b"].end == 220


def test_slurm_first_fit_ignores_ttfk_and_overpacks():
    # without an estimate Slurm sees 2-shard requests: both placed at 0 on GPU0; both kernels at 10:
    # a grows to 30 GiB first, then b's 20 GiB does not fit -> b OOMs and recovers after a (110..220)
    sim = run(OOM, policy="slurm-shards", estimator="none")
    b = sim.jobs["b"]
    assert b.first_start == 0 and b.ooms == 1 and b.end == 220


def test_rr_spreads_over_gpus():
    sim = run(TWO_LIGHT, policy="rr", gpus=2)
    assert sim.jobs["a"].gpus == [0] and sim.jobs["b"].gpus == [1]
    assert sim.jobs["a"].end == sim.jobs["b"].end == 110


def test_job_too_big_for_any_gpu_fails_with_a_reason():
    sim = run("submit_s,duration_s,mem_gib,gpus\n0,10,4,2\n", gpus=1)
    assert sim.jobs["j000"].state == "failed" and "2 GPUs" in sim.jobs["j000"].reason
    sim = run("submit_s,duration_s,mem_gib\n0,10,50\n", estimator="oracle")
    assert sim.jobs["j000"].state == "failed"


def test_energy_is_the_backend_counter_delta():
    # one A100-40GB: idle 55 W, max 400 W; the backend's power model is linear in SMACT:
    # 10 s TTFK at idle (context only) + 100 s at 55 + 345 * .3 W = 550 + 15850 J
    sim = run("submit_s,duration_s,mem_gib,util,ttfk_s\n0,100,4,light,10\n", policy="exclusive")
    assert sim.energy_j[0] == pytest.approx(550 + 15850, abs=1)
    assert sim.cluster.energy_j(0) == pytest.approx(16400, abs=1)


def test_simulated_gpus_report_what_the_simulated_backend_reports():
    """The simulator's GPUs keep only running processes and a running energy sum; driven through the same
    changes at the same times, the project's SimBackend must report the same memory, activity, power and
    energy counter."""
    from gpushare.gpus import BUILTIN_GPUS, GiB
    from gpushare.gres.sim_backend import SimBackend
    from gpushare.simulator.device import CONTEXT_GIB, SimCluster

    clock = [0.0]
    model = BUILTIN_GPUS["a100-40gb"]
    cluster = SimCluster(model, 40 * GiB, 1, 2, clock=lambda: clock[0])
    idle, peak = model.power_w
    backend = SimBackend.from_scenario({"version": 1, "name": "t", "gpus": [
        {"index": i, "model": model.name, "idle_power_w": idle, "max_power_w": peak} for i in range(2)]},
        clock=lambda: clock[0])
    pids = {}
    for gpu in range(2):
        cluster.record(gpu)  # what the engine does at t = 0

    def launch(gpu, job, mem_gib, util):
        cluster.launch(gpu, job, int(mem_gib * GiB), util, 1)
        pids[job] = cluster.gpus[gpu].residents[job].pid
        backend.start_process(gpu, pids[job], int(CONTEXT_GIB * GiB))

    steps = [
        (0.0, lambda: launch(0, "a", 12, (0.3, 0.15, 0.1))),
        (3.5, lambda: launch(0, "b", 20, (0.85, 0.45, 0.45))),
        (10.0, lambda: (cluster.first_kernel(0, "a"),
                        backend.update_process(pids["a"], memory_mib=12 * 1024, smact=0.3, smocc=0.15, drama=0.1))),
        (10.0, lambda: launch(1, "c", 8, (0.6, 0.3, 0.3))),
        (41.25, lambda: (cluster.first_kernel(0, "b", int(16 * GiB)),
                         backend.update_process(pids["b"], memory_mib=16 * 1024, smact=0.85, smocc=0.45, drama=0.45))),
        (100.0, lambda: (cluster.show(0, "b", smact=0.5), backend.update_process(pids["b"], smact=0.5))),
        (250.0, lambda: (cluster.grow(0, "b", int(30 * GiB)), backend.update_process(pids["b"], memory_mib=30 * 1024))),
        (900.5, lambda: (cluster.end(0, "a"), backend.end_process(pids["a"]))),
        (1200.0, lambda: (cluster.end(1, "c"), backend.end_process(pids["c"]))),
    ]
    for t, step in steps:
        clock[0] = t
        step()
        for gpu in range(2):
            point = cluster.gpus[gpu].history[-1]
            util = backend.utilization(gpu)
            assert point[1:] == (backend.memory(gpu).used, util.smact, util.smocc, util.drama, backend.power_watts(gpu))
            assert cluster.used_bytes(gpu) == backend.memory(gpu).used
    clock[0] = 2000.0
    assert [cluster.energy_j(g) for g in range(2)] == [backend.energy_mj(g) / 1000 for g in range(2)]


def test_policy_sees_the_backend_memory_view():
    # while a is warming (dispatched, no kernel yet) the backend reports its 0.5 GiB CUDA context
    sim = run(OOM, estimator="none")
    history = sim.gpus[0].history
    assert (0, int(0.5 * 2**30)) == history[0][:2] or (0, int(0.5 * 2**30)) == history[1][:2]
    # a at its 30 GiB peak plus b's context before b's first kernel; b's 20 GiB never lands (OOM)
    assert max(point[1] for point in history) == int(30.5 * 2**30)


FOUR = """job_id,submit_s,duration_s,mem_gib,util,ttfk_s
a,0,1000,12,light,10
b,0,1000,20,medium,10
c,0,1000,10,medium,10
d,200,1000,8,light,10
"""


@pytest.mark.parametrize("policy, expected", [
    # a, b, c arrive together; each GPU is warming once it has a job, so they spread: a→0, b→1, c→2
    # (every policy; exclusive too). At 200 s all windows have passed and d (8 GiB + 2 = 10 GiB) sees:
    #   GPU0: a, 12 GiB → 28 free, SMACT .3 | GPU1: b, 20 GiB → 20 free, .6 | GPU2: c, 10 GiB → 30 free, .6
    ("ff", 0),            # lowest index that fits
    ("bf", 1),            # least free memory that fits (20)
    ("magm", 2),          # most free memory (30)
    ("lug", 0),           # lowest SMACT (.3)
    ("rr", 0),            # cursor wrapped after 0, 1, 2
])
def test_each_policy_places_the_fourth_job_by_hand(policy, expected):
    sim = run(FOUR, policy=policy, gpus=3)
    assert [sim.jobs[j].gpus for j in "abc"] == [[0], [1], [2]]
    assert sim.jobs["d"].first_start == 200 and sim.jobs["d"].gpus == [expected]


def test_slurm_first_fit_packs_by_requests_without_waiting():
    # oracle shards a 14, b 22, c 12, d 10. No TTFK wait: a and b both go to GPU0 (36 of 40 shards),
    # c does not fit the 4 left there -> GPU1; d at 200 s: GPU0 has 4 free, GPU1 28 -> GPU1
    sim = run(FOUR, policy="slurm-shards", gpus=3)
    assert [sim.jobs[j].gpus for j in "abcd"] == [[0], [0], [1], [1]]


def test_exclusive_makes_the_fourth_job_wait():
    sim = run(FOUR, policy="exclusive", gpus=3)
    assert sim.jobs["d"].first_start == 1010 and sim.jobs["d"].gpus == [0]  # a frees GPU0 at 10 + 1000


OUTGROWS = """job_id,submit_s,duration_s,mem_gib,util,ttfk_s
a,0,1000,39,light,10
b,300,100,2,light,10
"""


def run_caps(caps):
    jobs = parse(OUTGROWS, "t.csv")
    config = SimConfig(gpus_per_node=1, policy="slurm-shards", estimator="none", interference="share", caps=caps)
    return Simulation(jobs, config, Interference(None, mode="share")).run()


def test_without_caps_an_offender_crashes_its_neighbour():
    # no estimate: 2 shards each. a runs within 2 GiB, outgrows it at 10 + 0.2 * 1000 s to 39 GiB (the room
    # is free), b is placed on the shards left and OOMs at its first kernel although it stays in its share
    sim = run_caps(False)
    a, b = sim.jobs["a"], sim.jobs["b"]
    assert b.neighbour_ooms == 1 and a.neighbour_ooms == 0 and a.ooms == 0
    assert sum(j.neighbour_ooms for j in sim.jobs.values()) == 1


def test_with_caps_the_offender_hits_its_own_cap_and_the_neighbour_is_safe():
    sim = run_caps(True)
    a, b = sim.jobs["a"], sim.jobs["b"]
    assert a.ooms == 1 and a.recovered and a.state == "done"  # its own OOM, then an exclusive rerun
    assert b.ooms == 0 and b.state == "done"
    assert sum(j.neighbour_ooms for j in sim.jobs.values()) == 0


def test_risk_verdicts_taken_without_a_window_agree_with_the_window():
    """The engine decides ``risky`` without scoring the 30-sample window where the noise cannot change the
    verdict (every sample clearly below or above the thresholds, or a steady window scored from the noise
    alone); on random step histories at and around CARMA's thresholds it must agree with the window."""
    import random

    from gpushare.policy import risk
    from gpushare.simulator.engine import GpuView

    rng = random.Random(3)
    levels = [0.0, 0.3, 0.45, 0.6, 0.78, 0.8, 0.82, 0.85, 0.9, 1.0]
    decided = 0
    for trial in range(400):
        sim = Simulation([], SimConfig(gpus_per_node=1, seed=trial % 4), Interference(None, mode="share"))
        gpu = sim.gpus[0]
        t = 0.0
        for _ in range(rng.randrange(1, 5)):
            gpu.history.append((t, 0, rng.choice(levels), rng.choice(levels), rng.choice(levels), 0.0))
            gpu._times.append(t)
            t += rng.choice([0.5, 3.0, 12.0, 40.0])
        for now in (t, t + rng.uniform(0, 20), t + 45.0):
            sim.now = now
            view = GpuView(sim, gpu)
            quick = view._settled()
            exact = risk.assess(*gpu.window_series(now, risk.WINDOW_SAMPLES, sim.config.seed)).risky
            if quick is not None:
                decided += 1
                assert quick == exact, (gpu.history, now)
            assert view.risky == exact
    assert decided > 600  # the shortcut is taken for most windows
