"""Which simulation runs a policy: the placement engine, or the Salus / Gimbal subclasses.

Why a separate step: the CLI and the benchmarks build a run from a config alone; the policy class says
which engine it needs (``Policy.engine``), and this keeps ``engine.py`` free of imports of its subclasses.
"""

from __future__ import annotations

from gpushare.simulator.engine import SimConfig, Simulation
from gpushare.simulator.gimbal import GimbalSimulation
from gpushare.simulator.interference import Interference
from gpushare.simulator.policies import make_policy
from gpushare.simulator.salus import SalusSimulation
from gpushare.simulator.trace import JobSpec

ENGINES: dict[str, type[Simulation]] = {"placement": Simulation, "salus": SalusSimulation, "gimbal": GimbalSimulation}


def simulation(jobs: list[JobSpec], config: SimConfig, interference: Interference | None = None) -> Simulation:
    """A ready-to-run simulation of ``jobs`` under ``config``, on the engine its policy needs."""
    engine = make_policy(config.policy, **config.policy_options()).engine
    return ENGINES[engine](jobs, config, interference)
