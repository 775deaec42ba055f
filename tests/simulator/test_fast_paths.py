"""The engine's fast paths give the slow paths' answers to the last bit: rates from interference rows
(``Interference.speed_among`` against ``speed``), whole-GPU requests from the sorted idle list
(``Simulation._choose_idle`` against ``Policy.choose``)."""

import random

import pytest

from gpushare.simulator.cli import data_dir
from gpushare.simulator.engine import SimConfig, Simulation
from gpushare.simulator.interference import MODES, Interference
from gpushare.simulator.policies import JobRequest
from gpushare.simulator.trace import JobSpec

GAVEL = data_dir(None) / "gavel_simulation_throughputs.json"
PROXIES = [None, "ResNet-50 (batch size 64)", "Transformer (batch size 16)", "LM (batch size 20)",
           "Recommendation (batch size 512)", "CycleGAN"]


@pytest.mark.parametrize("mode", MODES)
def test_speed_among_is_speed_bit_for_bit(mode):
    slow, fast = Interference.load(GAVEL, mode), Interference.load(GAVEL, mode)
    rng = random.Random(7)
    for _ in range(600):
        jobs = [(rng.choice(PROXIES), rng.choice([0.2, 0.3, 0.45, 0.6, 0.7, 0.85])) for _ in range(rng.randint(1, 14))]
        at = rng.randrange(len(jobs))
        kinds = [fast.kind(*job) for job in jobs]
        expected = slow.speed(jobs[at], [job for i, job in enumerate(jobs) if i != at])
        assert fast.speed_among(kinds[at], kinds, at) == expected  # exact, not approximate
        assert fast.speed_among(kinds[at], kinds, -1) == slow.speed(jobs[at], jobs)
    assert fast.fallback_pairs == slow.fallback_pairs  # the same pairs met, the same ones reported


def test_whole_gpu_choice_from_the_idle_list_is_the_policys():
    jobs = [JobSpec(f"j{i}", 0.0, 1, 100.0, 4.0, "medium", 10.0) for i in range(3)]
    sim = Simulation(jobs, SimConfig(nodes=4, gpus_per_node=4, gpu="a100-40gb", policy="exclusive"))
    rng = random.Random(3)
    for step in range(300):
        gpu = sim.gpus[rng.randrange(len(sim.gpus))]
        if gpu.residents and rng.random() < 0.5:
            sim.cluster.end(gpu.index, next(iter(gpu.residents)))
        else:
            sim.cluster.launch(gpu.index, f"x{step}", 1 << 30, (0.3, 0.1, 0.1), 1)
        for n in (1, 2, 3, 4):
            request = JobRequest(f"q{step}", gpus=n, exclusive=True)
            assert sim._choose_idle(n) == sim.policy.choose(request, sim.snapshot())
