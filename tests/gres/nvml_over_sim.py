"""A fake ``pynvml`` module answering from a SimBackend, so NvmlBackend's translation code (structs,
ctypes arrays, handles, error codes) runs in tests without a GPU. Loaded by conftest.py."""

from __future__ import annotations

import ctypes
import types
from typing import Any

import pynvml  # only for its ctypes structs; nothing here touches a driver

from gpushare.gres.errors import GpuError
from gpushare.gres.na import NA
from gpushare.gres.sim_mig import CI_PROFILE_BY_SLICES


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


def build(sim: Any) -> types.ModuleType:
    mod = types.ModuleType("nvml_over_sim")
    mod.NVMLError = NVMLError
    mod.c_nvmlGpuInstancePlacement_t = pynvml.c_nvmlGpuInstancePlacement_t
    mod.c_nvmlGpuInstance_t = ctypes.py_object  # arrays of handles hold Python tuples here
    mod.c_nvmlComputeInstance_t = ctypes.py_object
    mod.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0

    def wrap(fn):
        def call(*args):
            try:
                return fn(*args)
            except GpuError as exc:
                raise NVMLError(int(exc.code)) from exc
        return call

    def profiles(h):
        return sim._model(sim._gpu(sim.store.read(), h)).mig_profiles

    def gi_info(h, k, version=2):
        sim.gi_profiles(h)  # NOT_SUPPORTED unless MIG is on
        if k >= len(profiles(h)):
            raise NVMLError(3)
        p = profiles(h)[k]
        return types.SimpleNamespace(id=p.gi_profile_id, sliceCount=p.compute_slices, instanceCount=p.max_count,
                                     memorySizeMB=p.usable_bytes >> 20, name=f"MIG {p.name}".encode())

    def placements(h, pid, arr, count_ref):
        [p] = [p for p in sim.gi_profiles(h) if p.id == pid]
        if count_ref._obj.value < len(p.placements):
            raise NVMLError(7)  # INSUFFICIENT_SIZE, as the driver answers
        for i, pl in enumerate(p.placements):
            arr[i].start, arr[i].size = pl.start, pl.size
        count_ref._obj.value = len(p.placements)

    def gpu_instances(h, pid, arr, count_ref):
        found = [gi for gi in sim.gpu_instances(h) if gi.profile_id == pid]
        for i, gi in enumerate(found):
            arr[i] = ("gi", h, gi.id)
        count_ref._obj.value = len(found)

    def gi_by_id(h, gi_id):
        sim.compute_instances(h, gi_id)  # NOT_FOUND if absent
        return ("gi", h, gi_id)

    def gi_get_info(gi):
        [rec] = [g for g in sim.gpu_instances(gi[1]) if g.id == gi[2]]
        return types.SimpleNamespace(id=rec.id, profileId=rec.profile_id, placement=rec.placement)

    def gi_slices(gi):
        [rec] = [g for g in sim._gpu(sim.store.read(), gi[1])["gpu_instances"] if g["id"] == gi[2]]
        return rec["compute_slices"]

    def ci_profile_info(gi, k, engine, version=2):
        if CI_PROFILE_BY_SLICES.get(gi_slices(gi)) != k:
            raise NVMLError(3)
        return types.SimpleNamespace(id=k, instanceCount=1, sliceCount=gi_slices(gi))

    def compute_instances(gi, prof, arr, count_ref):
        cis = sim.compute_instances(gi[1], gi[2])
        for i, ci in enumerate(cis):
            arr[i] = ("ci", gi[1], gi[2], ci.id)
        count_ref._obj.value = len(cis)

    def ci_by_id(gi, ci_id):
        if ci_id not in [ci.id for ci in sim.compute_instances(gi[1], gi[2])]:
            raise NVMLError(6)
        return ("ci", gi[1], gi[2], ci_id)

    def mig_handle(h, k):
        devices = sim.mig_devices(h)
        if k >= len(devices):
            raise NVMLError(6)
        return ("mig", h, k)

    def uuid(h):
        return sim.mig_devices(h[1])[h[2]].uuid if isinstance(h, tuple) else sim.gpu(h).uuid

    def memory(h):
        if isinstance(h, tuple):
            total = sim.mig_devices(h[1])[h[2]].memory_bytes
            return types.SimpleNamespace(total=total, used=0, free=total)
        m = sim.memory(h)
        return types.SimpleNamespace(total=m.total, used=m.used, free=m.free)

    def mig_mode(h):
        g = sim.gpu(h)
        if not isinstance(g.mig_current, bool):
            raise NVMLError(3)
        return [int(g.mig_current), int(g.mig_pending)]

    def set_mig_mode(h, mode):
        sim.set_mig_mode(h, bool(mode))
        return 0

    def processes(h):
        return [types.SimpleNamespace(pid=p.pid, usedGpuMemory=p.used_bytes,
                                      gpuInstanceId=0xFFFFFFFF if p.gpu_instance_id is None else p.gpu_instance_id,
                                      computeInstanceId=0xFFFFFFFF) for p in sim.processes(h)]

    def utilization(h):
        u = sim.utilization(h)
        return types.SimpleNamespace(gpu=round(u.gpu * 100), memory=round(u.memory * 100))

    def process_utilization(h, since):
        samples = sim.process_utilization(h, since)
        if samples is NA:
            raise NVMLError(3)
        if not samples:
            raise NVMLError(6)  # NVML_ERROR_NOT_FOUND: no sample newer than ``since``
        return [types.SimpleNamespace(pid=u.pid, smUtil=round(u.sm * 100), memUtil=0, encUtil=0, decUtil=0,
                                      timeStamp=u.timestamp_us) for u in samples]

    funcs = dict(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount_v2=sim.gpu_count,
        nvmlDeviceGetHandleByIndex_v2=lambda i: sim.gpu(i).index, nvmlDeviceGetName=lambda h: sim.gpu(h).name,
        nvmlDeviceGetUUID=uuid, nvmlDeviceGetMinorNumber=lambda h: sim.gpu(h).minor,
        nvmlDeviceGetMemoryInfo=memory, nvmlDeviceGetMigMode=mig_mode, nvmlDeviceSetMigMode=set_mig_mode,
        nvmlDeviceGetComputeRunningProcesses_v3=processes, nvmlDeviceGetUtilizationRates=utilization,
        nvmlDeviceGetProcessUtilization=process_utilization,
        nvmlDeviceGetPowerUsage=lambda h: round(sim.power_watts(h) * 1000),
        nvmlDeviceGetTotalEnergyConsumption=sim.energy_mj,
        nvmlDeviceGetGpuInstanceProfileInfo=gi_info, nvmlDeviceGetGpuInstancePossiblePlacements=placements,
        nvmlDeviceCreateGpuInstanceWithPlacement=lambda h, pid, pl: ("gi", h, sim.create_gpu_instance(h, pid, pl.start).id),
        nvmlDeviceGetGpuInstances=gpu_instances, nvmlDeviceGetGpuInstanceById=gi_by_id,
        nvmlGpuInstanceGetInfo=gi_get_info, nvmlGpuInstanceGetComputeInstanceProfileInfo=ci_profile_info,
        nvmlGpuInstanceCreateComputeInstance=lambda gi, prof: ("ci", gi[1], gi[2], sim.create_compute_instance(gi[1], gi[2]).id),
        nvmlComputeInstanceGetInfo=lambda ci: types.SimpleNamespace(
            id=ci[3], profileId=CI_PROFILE_BY_SLICES[gi_slices(ci)]),
        nvmlGpuInstanceGetComputeInstances=compute_instances,
        nvmlGpuInstanceGetComputeInstanceById=ci_by_id,
        nvmlComputeInstanceDestroy=lambda ci: sim.destroy_compute_instance(ci[1], ci[2], ci[3]),
        nvmlGpuInstanceDestroy=lambda gi: sim.destroy_gpu_instance(gi[1], gi[2]),
        nvmlDeviceGetMaxMigDeviceCount=lambda h: 7, nvmlDeviceGetMigDeviceHandleByIndex=mig_handle,
        nvmlDeviceGetGpuInstanceId=lambda mh: sim.mig_devices(mh[1])[mh[2]].gpu_instance_id,
        nvmlDeviceGetComputeInstanceId=lambda mh: sim.mig_devices(mh[1])[mh[2]].compute_instance_id,
    )
    for name, fn in funcs.items():
        setattr(mod, name, wrap(fn))
    return mod
