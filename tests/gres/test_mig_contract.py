"""MIG calls through the GpuBackend interface, identical on the simulated backend and on the NVML backend
(driven by a fake pynvml over the simulator), so the executor sees one set of semantics."""

from __future__ import annotations

import pytest

from gpushare.gres import GpuError, NvmlCode

P1G, P2G, P3G, P7G = 19, 14, 9, 0


def code_of(fn, *args) -> NvmlCode:
    with pytest.raises(GpuError) as err:
        fn(*args)
    return err.value.code


def test_profiles_and_placements(mig_backend):
    profiles = {p.name: p for p in mig_backend.gi_profiles(0)}
    assert set(profiles) >= {"1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"}
    three = profiles["3g.20gb"]
    assert (three.id, three.compute_slices, three.max_count) == (P3G, 3, 2)
    assert [(p.start, p.size) for p in three.placements] == [(0, 4), (4, 4)]
    assert 19 << 30 < three.memory_bytes < 20 << 30


def test_build_a_layout_and_tear_it_down(mig_backend):
    layout = ((P2G, 0), (P2G, 2), (P1G, 4), (P1G, 5), (P1G, 6))  # 2g×2 + 1g×3: all 7 compute slices
    made = [mig_backend.create_gpu_instance(0, pid, start) for pid, start in layout]
    assert [(g.profile_name, g.placement.start) for g in made] == [
        ("2g.10gb", 0), ("2g.10gb", 2), ("1g.5gb", 4), ("1g.5gb", 5), ("1g.5gb", 6)]
    assert code_of(mig_backend.create_gpu_instance, 0, P1G, 3) is NvmlCode.INSUFFICIENT_RESOURCES
    for gi in made:
        ci = mig_backend.create_compute_instance(0, gi.id)
        assert ci.gpu_instance_id == gi.id
    devices = mig_backend.mig_devices(0)
    assert sorted(d.profile_name for d in devices) == ["1g.5gb"] * 3 + ["2g.10gb"] * 2
    assert all(d.uuid.startswith("MIG-") and d.ci_cap_minor == d.gi_cap_minor + 1 for d in devices)
    assert {g.id for g in mig_backend.gpu_instances(0)} == {g.id for g in made}
    for gi in made:
        assert code_of(mig_backend.destroy_gpu_instance, 0, gi.id) is NvmlCode.IN_USE
        for ci in mig_backend.compute_instances(0, gi.id):
            mig_backend.destroy_compute_instance(0, gi.id, ci.id)
        mig_backend.destroy_gpu_instance(0, gi.id)
    assert mig_backend.gpu_instances(0) == [] and mig_backend.mig_devices(0) == []


def test_conflicts_and_bad_arguments(mig_backend):
    mig_backend.create_gpu_instance(0, P7G, 0)
    assert code_of(mig_backend.create_gpu_instance, 0, P1G, 3) is NvmlCode.INSUFFICIENT_RESOURCES
    assert code_of(mig_backend.create_gpu_instance, 0, P3G, 2) is NvmlCode.INVALID_ARGUMENT
    assert code_of(mig_backend.create_gpu_instance, 0, 77, 0) is NvmlCode.INVALID_ARGUMENT
    assert code_of(mig_backend.destroy_gpu_instance, 0, 9) is NvmlCode.NOT_FOUND
    assert code_of(mig_backend.destroy_compute_instance, 0, 0, 0) is NvmlCode.NOT_FOUND


def test_disable_mig_with_instances_is_in_use(mig_backend):
    mig_backend.create_gpu_instance(0, P3G, 4)
    assert code_of(mig_backend.set_mig_mode, 0, False) is NvmlCode.IN_USE
    assert mig_backend.gpu(0).mig_current is True
