"""MIG semantics of the simulated backend: the rules the MIG executor is tested against."""

from __future__ import annotations

import pytest

from gpushare.gres import GpuError, NvmlCode
from gpushare.gres.device import ci_cap_minor, gi_cap_minor
from gpushare.gres.sim_backend import SimBackend

# A100-40GB GI profile ids (docs/mig-profiles.md)
P1G, P2G, P3G, P4G, P7G, P1G_ME = 19, 14, 9, 5, 0, 20


def code_of(fn, *args) -> NvmlCode:
    with pytest.raises(GpuError) as err:
        fn(*args)
    return err.value.code


def test_mode_change_pending_until_reset(sim):
    assert sim.set_mig_mode(0, True) is False
    g = sim.gpu(0)
    assert (g.mig_current, g.mig_pending) == (False, True)
    assert code_of(sim.create_gpu_instance, 0, P3G, 0) is NvmlCode.NOT_SUPPORTED  # not active yet
    sim.reset_gpu(0)
    g = sim.gpu(0)
    assert (g.mig_current, g.mig_pending) == (True, True)
    assert sim.set_mig_mode(0, True) is True  # idempotent


def test_mode_applies_at_once_when_no_reset_needed(clock):
    b = SimBackend.from_scenario({"version": 1, "gpus": [{"model": "h100-80gb", "mode_change_needs_reset": False}]},
                                 clock=clock)
    assert b.set_mig_mode(0, True) is True
    assert b.gpu(0).mig_current is True


def test_mode_change_and_reset_refused_while_processes_run(sim, clock):
    sim.start_process(0, pid=99, memory_bytes=1 << 30)
    assert code_of(sim.set_mig_mode, 0, True) is NvmlCode.IN_USE
    sim.end_process(99)
    sim.set_mig_mode(0, True)
    sim.start_process(0, pid=100, memory_bytes=1 << 30)
    assert code_of(sim.reset_gpu, 0) is NvmlCode.IN_USE
    assert sim.gpu(0).mig_current is False
    sim.end_process(100)
    sim.reset_gpu(0)
    assert sim.gpu(0).mig_current is True


def test_driver_busy_keeps_mode_pending(clock):
    b = SimBackend.from_scenario({"version": 1, "gpus": [{"model": "a100-40gb", "driver_busy": True}]}, clock=clock)
    assert b.set_mig_mode(0, True) is False
    assert code_of(b.reset_gpu, 0) is NvmlCode.IN_USE
    b.set_knobs(0, driver_busy=False)
    b.reset_gpu(0)
    assert b.gpu(0).mig_current is True


def test_not_mig_capable(sim):
    assert sim.gpu(1).mig_current.__class__.__name__ == "_NAType"
    assert code_of(sim.set_mig_mode, 1, True) is NvmlCode.NOT_SUPPORTED
    assert code_of(sim.gi_profiles, 1) is NvmlCode.NOT_SUPPORTED
    assert sim.mig_devices(1) == []


def test_profiles_come_from_the_catalogue(mig_sim):
    profiles = {p.name: p for p in mig_sim.gi_profiles(0)}
    assert profiles["3g.20gb"].id == P3G and [pl.start for pl in profiles["3g.20gb"].placements] == [0, 4]
    assert profiles["1g.5gb"].max_count == 7 and profiles["7g.40gb"].placements[0].size == 8


def test_create_with_explicit_placement_and_conflicts(mig_sim):
    gi = mig_sim.create_gpu_instance(0, P3G, 4)
    assert (gi.profile_name, gi.placement.start, gi.placement.size) == ("3g.20gb", 4, 4)
    assert code_of(mig_sim.create_gpu_instance, 0, P2G, 4) is NvmlCode.INSUFFICIENT_RESOURCES  # overlap
    assert code_of(mig_sim.create_gpu_instance, 0, P2G, 1) is NvmlCode.INVALID_ARGUMENT  # not a legal start
    assert code_of(mig_sim.create_gpu_instance, 0, 99, 0) is NvmlCode.INVALID_ARGUMENT  # unknown profile
    mig_sim.create_gpu_instance(0, P2G, 0)
    mig_sim.create_gpu_instance(0, P1G, 2)
    mig_sim.create_gpu_instance(0, P1G, 3)
    # 3g+2g+1g+1g = 7 compute slices: the GPU is full
    assert code_of(mig_sim.create_gpu_instance, 0, P1G, 3) is NvmlCode.INSUFFICIENT_RESOURCES
    assert sorted(g.profile_name for g in mig_sim.gpu_instances(0)) == ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]


def test_compute_slice_and_count_limits(mig_sim):
    mig_sim.create_gpu_instance(0, P4G, 0)
    mig_sim.create_gpu_instance(0, P3G, 4)  # 4g+3g is legal since R510
    assert code_of(mig_sim.create_gpu_instance, 0, P4G, 0) is NvmlCode.INSUFFICIENT_RESOURCES
    mig_sim.destroy_gpu_instance(0, mig_sim.gpu_instances(0)[-1].id)
    mig_sim.create_gpu_instance(0, P1G_ME, 4)
    assert code_of(mig_sim.create_gpu_instance, 0, P1G_ME, 5) is NvmlCode.INSUFFICIENT_RESOURCES  # max 1 +me


def test_full_gpu_instance_is_gi_0(mig_sim):
    assert mig_sim.create_gpu_instance(0, P7G, 0).id == 0
    assert code_of(mig_sim.create_gpu_instance, 0, P1G, 0) is NvmlCode.INSUFFICIENT_RESOURCES


def test_compute_instance_and_teardown_order(mig_sim):
    gi = mig_sim.create_gpu_instance(0, P3G, 0)
    ci = mig_sim.create_compute_instance(0, gi.id)
    assert (ci.gpu_instance_id, ci.id, ci.slices, ci.profile_id) == (gi.id, 0, 3, 2)
    assert code_of(mig_sim.create_compute_instance, 0, gi.id) is NvmlCode.INSUFFICIENT_RESOURCES
    assert code_of(mig_sim.destroy_gpu_instance, 0, gi.id) is NvmlCode.IN_USE  # compute first
    mig_sim.destroy_compute_instance(0, gi.id, ci.id)
    assert mig_sim.compute_instances(0, gi.id) == []
    mig_sim.destroy_gpu_instance(0, gi.id)
    assert mig_sim.gpu_instances(0) == []
    assert code_of(mig_sim.destroy_gpu_instance, 0, gi.id) is NvmlCode.NOT_FOUND
    assert code_of(mig_sim.create_compute_instance, 0, 5) is NvmlCode.NOT_FOUND


def test_busy_compute_instance_cannot_be_destroyed(mig_sim):
    gi = mig_sim.create_gpu_instance(0, P2G, 2)
    mig_sim.create_compute_instance(0, gi.id)
    mig_sim.start_process(0, pid=5, memory_bytes=1 << 30, gi=gi.id)
    assert code_of(mig_sim.destroy_compute_instance, 0, gi.id, 0) is NvmlCode.IN_USE
    [p] = mig_sim.processes(0)
    assert (p.gpu_instance_id, p.compute_instance_id) == (gi.id, 0)
    mig_sim.end_process(5)
    mig_sim.destroy_compute_instance(0, gi.id, 0)


def test_disable_with_instances_is_in_use_and_reset_clears_instances(mig_sim):
    mig_sim.create_gpu_instance(0, P3G, 0)
    assert code_of(mig_sim.set_mig_mode, 0, False) is NvmlCode.IN_USE
    mig_sim.reset_gpu(0)  # MIG instances do not survive a reset
    assert mig_sim.gpu_instances(0) == []


def test_mig_devices_uuids_and_cap_minors(mig_sim):
    for profile, start in ((P3G, 0), (P2G, 4), (P1G, 6)):
        gi = mig_sim.create_gpu_instance(0, profile, start)
        mig_sim.create_compute_instance(0, gi.id)
    devices = mig_sim.mig_devices(0)
    assert len(devices) == 3 and len({d.uuid for d in devices}) == 3
    for d in devices:
        assert d.uuid.startswith("MIG-") and len(d.uuid) == 40
        assert d.gi_cap_minor == gi_cap_minor(0, d.gpu_instance_id)
        assert d.ci_cap_minor == ci_cap_minor(0, d.gpu_instance_id, 0)
    assert mig_sim.mig_devices(0) == devices  # stable


def test_cap_minor_formula_matches_the_driver():
    # /proc/driver/nvidia-caps/mig-minors: gpu0/gi1/access 12, gpu0/gi2/access 21, gpu1/gi0/access 138
    assert gi_cap_minor(0, 0) == 3 and ci_cap_minor(0, 0, 0) == 4 and ci_cap_minor(0, 0, 7) == 11
    assert gi_cap_minor(0, 1) == 12 and gi_cap_minor(0, 2) == 21 and gi_cap_minor(1, 0) == 138


def test_a30_has_its_own_ids(clock):
    b = SimBackend.from_scenario({"version": 1, "gpus": [{"model": "a30-24gb", "mig_mode": True}]}, clock=clock)
    names = {p.id: p.name for p in b.gi_profiles(0)}
    assert names[14] == "1g.6gb" and names[0] == "4g.24gb"
    b.create_gpu_instance(0, 5, 2)
    assert code_of(b.create_gpu_instance, 0, 14, 3) is NvmlCode.INSUFFICIENT_RESOURCES


def test_lost_gpu_refuses_mig_operations(mig_sim, clock):
    mig_sim.set_knobs(0, lost_at_s=5)
    mig_sim.create_gpu_instance(0, P3G, 0)
    clock.advance(10)
    assert code_of(mig_sim.create_gpu_instance, 0, P3G, 4) is NvmlCode.GPU_IS_LOST
    assert code_of(mig_sim.gpu_instances, 0) is NvmlCode.GPU_IS_LOST


def test_process_needs_an_existing_compute_instance(mig_sim):
    assert code_of(mig_sim.start_process, 0, 1, 1 << 20, 0.0, 0.0, 0.0, 3) is NvmlCode.NOT_FOUND
    gi = mig_sim.create_gpu_instance(0, P1G, 0)
    assert code_of(mig_sim.start_process, 0, 1, 1 << 20, 0.0, 0.0, 0.0, gi.id) is NvmlCode.NOT_FOUND
    mig_sim.create_compute_instance(0, gi.id)
    mig_sim.start_process(0, 1, 1 << 20, gi=gi.id)
