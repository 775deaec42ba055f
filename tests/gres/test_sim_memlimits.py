"""The simulated driver's per-cgroup memory limits (gpushare.gres.sim_memlimits) against NVIDIA's documented
semantics, and the NVML backend's answer where the driver has no such functions."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gpushare.gpus import MiB, GiB
from gpushare.gres import GpuError, NvmlCode
from gpushare.gres.memlimits import LIMIT_MAX
from gpushare.gres.sim_backend import SimBackend
from gpushare.gres.sim_scenario import ScenarioError, validate_scenario

OOM = 2


def node(clock: Callable[[], float], limits: str, **gpu: object) -> SimBackend:
    return SimBackend.from_scenario({"version": 1, "gpus": [{"model": "a100-40gb", "memory_limits": limits, **gpu}]},
                                    clock=clock)


@pytest.fixture
def job(tmp_path: Path) -> Path:
    """A job cgroup with a task below it, with dmem files where the parent enabled +dmem."""
    cg = tmp_path / "slurmstepd.scope" / "job_7"
    (cg / "step_0" / "task_0").mkdir(parents=True)
    (cg / "dmem.max").write_text("max\n")
    return cg


def test_allocations_stop_at_the_hard_limit_and_neighbours_are_untouched(clock, job: Path) -> None:
    sim = node(clock, "dmem")
    sim.set_memory_limit(0, str(job), 2 * GiB)
    task = str(job / "step_0" / "task_0")
    assert sim.allocate(0, 100, GiB, task) == 0
    assert sim.allocate(0, 101, GiB, task) == 0  # a second process of the job: one budget for the cgroup
    assert sim.allocate(0, 100, MiB, task) == OOM
    assert sim.memory_limit(0, str(job)).used == 2 * GiB and sim.memory_limit(0, str(job)).hard == 2 * GiB
    assert sim.allocate(0, 200, 10 * GiB, "/sys/fs/cgroup/other/job_8") == 0  # not under the limit
    assert sim.memory(0).used == 12 * GiB


def test_managed_memory_is_not_charged_to_the_cgroup(clock, job: Path) -> None:
    sim = node(clock, "dmem")
    sim.set_memory_limit(0, str(job), GiB)
    assert sim.allocate(0, 100, 3 * GiB, str(job), managed=True) == 0
    assert sim.memory_limit(0, str(job)).used == 0
    assert sim.allocate(0, 100, GiB, str(job)) == 0  # the whole limit is still there for device memory
    assert sim.memory(0).used == 4 * GiB  # resident on the device all the same


def test_mem_get_info_total_shows_the_limit_only_in_the_leaf(clock, job: Path) -> None:
    sim = node(clock, "dmem")
    sim.set_memory_limit(0, str(job), 2 * GiB)
    sim.allocate(0, 100, GiB // 2, str(job / "step_0" / "task_0"))
    physical = sim.gpu(0).total_bytes
    assert sim.mem_get_info(0, str(job)) == (GiB + GiB // 2, 2 * GiB)  # the limit's own cgroup
    assert sim.mem_get_info(0, str(job / "step_0" / "task_0")) == (GiB + GiB // 2, physical)  # below it
    assert sim.mem_get_info(0, "/elsewhere") == (physical - GiB // 2, physical)


def test_dmem_limits_nest_misc_limits_do_not(clock, job: Path) -> None:
    task = job / "step_0"
    (task / "dmem.max").write_text("max\n")
    for mode, expect in (("dmem", OOM), ("misc", 0)):
        sim = node(clock, mode)
        sim.set_memory_limit(0, str(job), GiB)
        sim.set_memory_limit(0, str(task), 4 * GiB)
        assert sim.allocate(0, 100, 2 * GiB, str(task)) == expect, mode


def test_misc_refuses_a_hard_limit_below_current_use(clock, job: Path) -> None:
    sim = node(clock, "misc")
    sim.allocate(0, 100, 2 * GiB, str(job))
    with pytest.raises(GpuError) as err:
        sim.set_memory_limit(0, str(job), GiB)
    assert err.value.code is NvmlCode.INVALID_ARGUMENT


@pytest.mark.parametrize("limits, code", [("absent", NvmlCode.FUNCTION_NOT_FOUND), ("off", NvmlCode.NOT_SUPPORTED)])
def test_a_driver_without_limits_says_so(clock, job: Path, limits: str, code: NvmlCode) -> None:
    sim = node(clock, limits)
    for call in (lambda: sim.set_memory_limit(0, str(job), GiB), lambda: sim.memory_limit(0, str(job))):
        with pytest.raises(GpuError) as err:
            call()
        assert err.value.code is code


def test_mig_no_cgroup_no_dmem_files_and_clearing(clock, job: Path, tmp_path: Path) -> None:
    with pytest.raises(GpuError) as err:
        node(clock, "dmem", mig_mode=True).set_memory_limit(0, str(job), GiB)
    assert err.value.code is NvmlCode.NOT_SUPPORTED
    sim = node(clock, "dmem")
    with pytest.raises(GpuError) as err:
        sim.set_memory_limit(0, str(tmp_path / "gone"), GiB)
    assert err.value.code is NvmlCode.NOT_FOUND
    with pytest.raises(GpuError) as err:
        sim.set_memory_limit(0, str(job / "step_0"), GiB)  # no dmem.max: +dmem not enabled below the job
    assert err.value.code is NvmlCode.NOT_SUPPORTED
    with pytest.raises(GpuError):
        sim.set_memory_limit(0, "relative/job_7", GiB)
    sim.set_memory_limit(0, str(job), GiB)
    sim.clear_memory_limit(0, str(job))
    assert sim.memory_limit(0, str(job)).hard is None
    assert sim.allocate(0, 100, 2 * GiB, str(job)) == 0
    assert LIMIT_MAX == 2**64 - 1


def test_scenario_rejects_an_unknown_mode() -> None:
    with pytest.raises(ScenarioError, match="memory_limits"):
        validate_scenario({"version": 1, "gpus": [{"model": "a100-40gb", "memory_limits": "yes"}]})


def test_nvml_backend_without_the_function_is_function_not_found(sim: SimBackend) -> None:
    """The NVML backend over a binding that cannot reach the symbol (tests/gres/nvml_over_sim.py) answers
    FUNCTION_NOT_FOUND, the code the Prolog turns into "driver too old"."""
    import importlib.util

    from gpushare.gres.nvml_backend import NvmlBackend

    spec = importlib.util.spec_from_file_location("nvml_over_sim", Path(__file__).with_name("nvml_over_sim.py"))
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    backend = NvmlBackend(module=mod.build(sim))
    for call in (lambda: backend.set_memory_limit(0, "/sys/fs/cgroup/job_1", GiB),
                 lambda: backend.memory_limit(0, "/sys/fs/cgroup/job_1")):
        with pytest.raises(GpuError) as err:
            call()
        assert err.value.code is NvmlCode.FUNCTION_NOT_FOUND
