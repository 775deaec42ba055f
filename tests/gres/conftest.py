"""Fixtures for the device-interface tests: scenarios, and backends to run contracts on (the fake
``clock`` is in tests/conftest.py)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest

from gpushare.gres.errors import GpuError
from gpushare.gres.sim_backend import SimBackend


BASIC = {
    "version": 1,
    "name": "node-a",
    "gpus": [
        {"model": "a100-40gb", "mig_capable": True},
        {"model": "l40s-48gb", "idle_power_w": 50, "max_power_w": 350},
    ],
    "processes": [
        {"pid": 4242, "gpu": 1, "start_s": 0, "end_s": 100, "memory_mib": 4096, "smact": 0.6, "smocc": 0.3,
         "drama": 0.2, "steps": [{"after_s": 50, "memory_mib": 8192, "smact": 0.9}]},
    ],
}


@pytest.fixture
def sim(clock: Callable[[], float]) -> SimBackend:
    """An in-memory simulated node: an A100-40GB (MIG capable, MIG off) and a busy L40S."""
    return SimBackend.from_scenario(BASIC, clock=clock)


@pytest.fixture
def mig_sim(clock: Callable[[], float]) -> SimBackend:
    """One A100-40GB already in MIG mode and idle."""
    return SimBackend.from_scenario({"version": 1, "gpus": [{"model": "a100-40gb", "mig_mode": True}]}, clock=clock)


def _nvml_or_skip():
    from gpushare.gres.nvml_backend import NvmlBackend

    backend = NvmlBackend()
    try:
        if backend.gpu_count() == 0:
            pytest.skip("NVML works but reports no GPUs")
    except GpuError as exc:
        pytest.skip(f"no NVIDIA driver/GPU here ({exc}); the contract runs on the simulated backend only")
    return backend


def _nvml_over(sim: SimBackend):
    """NvmlBackend on a fake pynvml that answers from ``sim`` (see nvml_over_sim.py)."""
    from gpushare.gres.nvml_backend import NvmlBackend

    spec = importlib.util.spec_from_file_location("nvml_over_sim", Path(__file__).with_name("nvml_over_sim.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return NvmlBackend(module.build(sim))


@pytest.fixture(params=["sim", "sim-file", "nvml-over-sim", "nvml"])
def backend(request, clock: Callable[[], float], tmp_path):
    """The same contract tests run on every backend; NVML is skipped where there is no driver."""
    if request.param == "sim":
        yield SimBackend.from_scenario(BASIC, clock=clock)
    elif request.param == "sim-file":
        SimBackend.from_scenario(BASIC, tmp_path / "state.json", clock=clock)
        yield SimBackend.open(tmp_path / "state.json", clock=clock)  # as a second process would
    elif request.param == "nvml-over-sim":
        yield _nvml_over(SimBackend.from_scenario(BASIC, clock=clock))
    else:
        nv = _nvml_or_skip()
        yield nv
        nv.close()


@pytest.fixture(params=["sim", "nvml-over-sim"])
def mig_backend(request, clock: Callable[[], float]):
    """An A100-40GB in MIG mode, idle, behind either backend (MIG tests never touch a real GPU)."""
    sim = SimBackend.from_scenario({"version": 1, "gpus": [{"model": "a100-40gb", "mig_mode": True}]}, clock=clock)
    return sim if request.param == "sim" else _nvml_over(sim)
