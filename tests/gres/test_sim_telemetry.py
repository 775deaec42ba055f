"""Simulated telemetry: timelines, energy integrated over a fake clock, injected NVML errors."""

from __future__ import annotations

import math

import pytest

from gpushare.gpus import MiB
from gpushare.gres import NA, GpuError, NvmlCode
from gpushare.gres.sim_backend import SimBackend


def test_process_timeline_and_steps(sim, clock):
    assert [p.pid for p in sim.processes(1)] == [4242]
    assert sim.memory(1).used == 4096 * MiB
    clock.advance(60)  # past the step at 50 s
    assert sim.processes(1)[0].used_bytes == 8192 * MiB
    u = sim.utilization(1)
    assert (u.source, u.smact, u.smocc, u.drama) == ("dcgm", 0.9, 0.3, 0.2)
    clock.advance(50)  # ended at 100 s
    assert sim.processes(1) == [] and sim.memory(1).used == 0
    assert sim.utilization(1).smact == 0.0


def test_energy_integrates_power_exactly(sim, clock):
    start = sim.energy_mj(1)
    assert start == 0 and sim.power_watts(1) == pytest.approx(50 + 300 * 0.6)
    clock.advance(50)
    assert sim.energy_mj(1) == round(50 * (50 + 300 * 0.6) * 1000)
    clock.advance(150)  # 50 s at smact 0.9, then 100 s idle
    expected = 50 * 230 + 50 * (50 + 300 * 0.9) + 100 * 50
    assert sim.energy_mj(1) == expected * 1000
    assert sim.energy_mj(0) == 60 * 200 * 1000  # the idle A100 at the default 60 W


def test_energy_independent_of_sampling_rate(clock):
    a = SimBackend.from_scenario(
        {"version": 1, "gpus": [{"model": "h100-80gb", "energy_start_mj": 123}],
         "processes": [{"pid": 1, "gpu": 0, "start_s": 3.5, "end_s": 17.25, "memory_mib": 10, "smact": 0.4}]},
        clock=clock)
    samples = []
    for _ in range(40):
        clock.advance(0.5)
        samples.append(a.energy_mj(0))
    assert samples == sorted(samples) and samples[0] > 123
    assert samples[-1] == 123 + round((20 * 60 + 13.75 * 340 * 0.4) * 1000)


def test_dynamic_processes(sim, clock):
    sim.start_process(0, pid=7, memory_bytes=2 << 30, smact=0.5)
    clock.advance(10)
    sim.update_process(7, smact=1.0, memory_mib=4096)
    clock.advance(10)
    assert sim.memory(0).used == 4096 * MiB and sim.utilization(0).smact == 1.0
    sim.end_process(7)
    clock.advance(10)
    assert sim.energy_mj(0) == (10 * (60 + 340 * 0.5) + 10 * 400 + 10 * 60) * 1000
    with pytest.raises(GpuError) as err:
        sim.end_process(7)
    assert err.value.code is NvmlCode.NOT_FOUND


def test_utilization_capped_and_nvml_source(clock):
    b = SimBackend.from_scenario(
        {"version": 1, "gpus": [{"model": "v100-32gb", "utilization_source": "nvml"}],
         "processes": [{"pid": p, "gpu": 0, "memory_mib": 100, "smact": 0.7, "drama": 0.6} for p in (1, 2)]},
        clock=clock)
    u = b.utilization(0)
    assert u.source == "nvml" and u.smact is NA and u.gpu == 1.0 and u.memory == 1.0


def test_unsupported_metrics_read_na(clock):
    b = SimBackend.from_scenario(
        {"version": 1, "gpus": [{"model": "rtx3060-12gb", "unsupported": ["power", "energy", "processes"]}],
         "processes": [{"pid": 3, "gpu": 0, "memory_mib": 100}]}, clock=clock)
    assert b.power_watts(0) is NA and b.energy_mj(0) is NA
    assert math.isnan(b.power_watts(0) / 1000)
    [p] = b.processes(0)
    assert p.pid == 3 and p.used_bytes is NA
    assert b.memory(0).used == 100 * MiB


def test_injected_error_raises_with_code(sim):
    sim.inject_error(1, "memory", "NO_PERMISSION")
    with pytest.raises(GpuError) as err:
        sim.memory(1)
    assert err.value.code is NvmlCode.NO_PERMISSION
    sim.inject_error(1, "memory", None)
    assert sim.memory(1).used == 4096 * MiB
    sim.inject_error(1, "utilization", NvmlCode.NOT_SUPPORTED)
    assert sim.utilization(1).smact is NA


def test_gpu_lost_after_scenario_time(clock):
    b = SimBackend.from_scenario({"version": 1, "gpus": [{"model": "a100-80gb", "lost_at_s": 30}]}, clock=clock)
    assert b.memory(0).used == 0
    clock.advance(30)
    for call in (b.memory, b.energy_mj, b.power_watts, b.utilization, b.gpu):
        with pytest.raises(GpuError) as err:
            call(0)
        assert err.value.gpu_lost and err.value.code is NvmlCode.GPU_IS_LOST


def test_duplicate_running_pid_refused(sim):
    with pytest.raises(GpuError) as err:
        sim.start_process(0, pid=4242, memory_bytes=1)
    assert err.value.code is NvmlCode.INVALID_ARGUMENT


def test_process_utilization_reports_processes_running_kernels(clock):
    from gpushare.gres.sim_backend import SimBackend

    sim = SimBackend.from_scenario({"version": 1, "gpus": [{"model": "a100-40gb"}, {"model": "a100-40gb",
                                    "unsupported": ["process_utilization"]}]}, clock=clock)
    sim.start_process(0, 11, 1 << 30)  # a CUDA context, no kernel yet
    assert sim.process_utilization(0) == []
    clock.advance(0.5)
    sim.update_process(11, smact=0.4)
    clock.advance(0.5)
    (sample,) = sim.process_utilization(0)
    assert sample.pid == 11 and sample.sm == 0.4
    assert sim.process_utilization(0, since_us=sample.timestamp_us) == []  # nothing newer
    clock.advance(1.0)
    assert sim.process_utilization(0, since_us=sample.timestamp_us)[0].timestamp_us > sample.timestamp_us
    assert sim.process_utilization(1) is NA  # a GPU that cannot sample per process


def test_a_killed_host_process_leaves_the_gpu_like_a_dead_process_leaves_the_driver(tmp_path, clock):
    import subprocess

    sim = SimBackend.from_scenario({"version": 1, "gpus": [{"model": "a100-40gb"}]}, tmp_path / "sim.json", clock=clock)
    child = subprocess.Popen(["sleep", "60"])
    try:
        sim.start_process(0, child.pid, 2048 * MiB, smact=0.5, host=True)
        sim.start_process(0, 999_999_999, 1024 * MiB)  # a simulated process of no host process stays
        clock.advance(5)
        assert sorted(p.pid for p in sim.processes(0)) == sorted([child.pid, 999_999_999])
        child.kill()
        child.wait()  # reaped: gone, as a process whose job the backstop stopped
        assert [p.pid for p in sim.processes(0)] == [999_999_999] and sim.memory(0).used == 1024 * MiB
        assert SimBackend.open(tmp_path / "sim.json", clock=clock).memory(0).used == 1024 * MiB  # persisted
    finally:
        child.kill()
