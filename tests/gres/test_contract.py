"""The backend contract: identical tests for the NVML and simulated backends (read-only on real GPUs)."""

from __future__ import annotations

import math

import pytest

from gpushare.gres import NA, GpuBackend, GpuError, NvmlCode, is_na


def test_is_a_gpu_backend(backend):
    assert isinstance(backend, GpuBackend)
    assert backend.name in ("nvml", "sim")


def test_inventory(backend):
    gpus = backend.gpus()
    assert len(gpus) == backend.gpu_count() > 0
    uuids = {g.uuid for g in gpus}
    assert len(uuids) == len(gpus)
    for i, g in enumerate(gpus):
        assert g.index == i
        assert g.uuid.startswith("GPU-")
        assert g.name and g.total_bytes > 1 << 30 and g.minor >= 0
        assert (g.mig_current is NA) == (g.mig_pending is NA)
        assert backend.gpu(i) == g


def test_bad_index_is_invalid_argument(backend):
    with pytest.raises(GpuError) as err:
        backend.gpu(backend.gpu_count() + 7)
    assert err.value.code in (NvmlCode.INVALID_ARGUMENT, NvmlCode.NOT_FOUND)


def test_memory_adds_up(backend):
    for g in backend.gpus():
        mem = backend.memory(g.index)
        assert mem.total == g.total_bytes
        if not is_na(mem.used):
            assert 0 <= mem.used <= mem.total
            assert mem.free == mem.total - mem.used or abs(mem.free + mem.used - mem.total) < (1 << 30)


def test_processes_are_records(backend):
    for g in backend.gpus():
        for p in backend.processes(g.index):
            assert p.pid > 0
            assert is_na(p.used_bytes) or p.used_bytes >= 0


def test_utilization_says_its_source(backend):
    for g in backend.gpus():
        u = backend.utilization(g.index)
        assert u.source in ("dcgm", "nvml")
        fields = (u.smact, u.smocc, u.drama) if u.source == "dcgm" else (u.gpu, u.memory)
        for value in fields:
            assert is_na(value) or 0.0 <= value <= 1.0
        if u.source == "nvml":
            assert u.smact is NA and u.smocc is NA and u.drama is NA


def test_power_and_energy_are_numbers_or_na(backend):
    for g in backend.gpus():
        power = backend.power_watts(g.index)
        energy = backend.energy_mj(g.index)
        assert is_na(power) or power >= 0
        assert is_na(energy) or (isinstance(energy, int) and energy >= 0)
        assert math.isnan(power / 1) or power / 1 >= 0  # callers divide without branches


def test_energy_counter_never_decreases(backend):
    first = [backend.energy_mj(g.index) for g in backend.gpus()]
    if hasattr(backend, "clock"):
        backend.clock.advance(3)  # the sim's fake clock; a real GPU moves on its own
    second = [backend.energy_mj(g.index) for g in backend.gpus()]
    for a, b in zip(first, second):
        assert is_na(a) or b >= a


def test_mig_devices_only_in_mig_mode(backend):
    for g in backend.gpus():
        devices = backend.mig_devices(g.index)
        if g.mig_current is not True:
            assert devices == []
        for d in devices:
            assert d.uuid.startswith("MIG-") and d.gpu_index == g.index and d.gi_cap_minor > 2


def test_mps_control_is_offered(backend, tmp_path):
    mps = backend.mps(str(tmp_path))
    assert mps.run_dir == str(tmp_path)
    for name in ("start", "stop", "running", "set_default_pinned_mem_limit", "set_default_active_thread_percentage"):
        assert callable(getattr(mps, name))


def test_process_utilization_is_samples_or_na(backend):
    for g in backend.gpus():
        samples = backend.process_utilization(g.index)
        if is_na(samples):
            continue
        for sample in samples:
            assert sample.pid > 0 and 0.0 <= sample.sm <= 1.0 and sample.timestamp_us > 0
            assert backend.process_utilization(g.index, sample.timestamp_us) == [] or all(
                s.timestamp_us > sample.timestamp_us for s in backend.process_utilization(g.index, sample.timestamp_us))
