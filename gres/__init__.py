"""gres — the GPU device interface every node-side part uses (agent, MIG executor, simulator).

API (small on purpose; details in docs/device-interface.md):

    from gpushare.gres import open_backend, NA, GpuError, NvmlCode
    dev = open_backend()            # "nvml" or "sim:<state.json>"; default from $GPUSHARE_DEVICE_BACKEND

    inventory   dev.gpu_count(), dev.gpus(), dev.gpu(i) -> GpuInfo(index, uuid, name, model, total_bytes,
                minor, mig_current, mig_pending)
    telemetry   dev.memory(i) -> MemoryInfo(total, used, free); dev.processes(i) -> [ProcessInfo(pid,
                used_bytes, gpu_instance_id, compute_instance_id)]; dev.utilization(i) -> Utilization(source
                "dcgm"|"nvml", smact, smocc, drama, gpu, memory); dev.power_watts(i); dev.energy_mj(i)
    MIG mode    dev.set_mig_mode(i, enabled) -> True if active now (else pending until dev.reset_gpu(i))
    MIG         dev.gi_profiles(i) -> [GiProfile(id, name, compute_slices, memory_bytes, max_count,
                placements)]; dev.create_gpu_instance(i, profile_id, start) -> GpuInstance;
                dev.create_compute_instance(i, gi_id) -> ComputeInstance (whole GI);
                dev.gpu_instances(i); dev.compute_instances(i, gi_id);
                dev.destroy_compute_instance(i, gi_id, ci_id); dev.destroy_gpu_instance(i, gi_id);
                dev.mig_devices(i) -> [MigDevice(uuid "MIG-…", gi/ci ids, profile, gi/ci cap minors)]
    MPS         dev.mps(run_dir) -> MpsControl: start/stop/running(device),
                set_default_pinned_mem_limit(device, mib), set_default_active_thread_percentage(device, pct);
                gpushare.gres.mps.job_env(pipe_dir, device, mem_limit_mib, thread_percentage) -> env for TaskProlog
    mem limits  dev.set_memory_limit(i, cgroup, hard_bytes), dev.clear_memory_limit(i, cgroup), dev.memory_limit(i, cgroup)
                -> MemoryLimit (NVIDIA r615+ per-cgroup limits; gpushare.gres.memlimits)
    gres.conf   gpushare.gres.gres_conf.node_gpus(dev) -> [NodeGpu]; gres_conf_lines(gpus, dev_dir); node_gres(gpus)

Units: bytes, watts, millijoules (since driver load), fractions 0..1. Unsupported metrics are ``NA``
(NaN-like, prints ``N/A``); faults raise ``GpuError`` whose ``.code`` is NVML's (``NvmlCode.IN_USE``…).
Simulated backend: ``gpushare.gres.sim_backend.SimBackend.from_scenario(scenario, state_path=None, clock=…)`` or
``SimBackend.open(state_path)``; scenario control (``gpushare.gres.sim_control``): ``start_process``,
``update_process``, ``end_process``, ``set_knobs``, ``inject_error``, ``now``.

Modules: device (records, Protocol, cap minors), na, errors, nvml_query (the NVML choke point),
nvml_backend, dcgm (SMACT/SMOCC/DRAMA for it), sim_backend, sim_control, sim_mig (MIG rules), sim_timeline (activity, power, energy),
memlimits and sim_memlimits (per-cgroup memory limits),
sim_scenario (scenario files), sim_state (state file + locking), mps, gres_conf, factory.
"""

from gpushare.gres.device import (ComputeInstance, GiProfile, GpuBackend, GpuInfo, GpuInstance, MemoryInfo, MigDevice,
                         Placement, ProcessInfo, Utilization)
from gpushare.gres.errors import GpuError, NvmlCode
from gpushare.gres.factory import open_backend
from gpushare.gres.na import NA, is_na

__all__ = [
    "NA", "is_na", "GpuError", "NvmlCode", "open_backend", "GpuBackend", "GpuInfo", "MemoryInfo",
    "ProcessInfo", "Utilization", "Placement", "GiProfile", "GpuInstance", "ComputeInstance", "MigDevice",
]
