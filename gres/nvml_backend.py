"""The real backend: :class:`gpushare.gres.device.GpuBackend` on nvidia-ml-py (``import pynvml``).

Why this shape: every NVML call goes through :class:`gpushare.gres.nvml_query.Nvml` (lazy init, shutdown at exit,
versioned-function fallback, NOT_SUPPORTED → ``NA``), so this module only translates NVML structs into our
records. It imports without a GPU, a driver or even pynvml installed; the first call raises
``GpuError(…, "NVML not available: <reason>")``.

Utilisation: NVML has no SM activity/occupancy/DRAM activity; DCGM does (fields 1002 SMACT, 1003 SMOCC,
1005 DRAMA). Pass ``dcgm=`` a callable ``index -> (smact, smocc, drama) | None`` (``gpushare.gres.dcgm.dcgm_source()``
wraps DCGM's ``DcgmReader``) and samples say ``source="dcgm"``; without it, or while it answers None, they
come from ``nvmlDeviceGetUtilizationRates`` with ``source="nvml"``.
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from gpushare.gpus import BUILTIN_GPUS, GpuModel, MiB
from gpushare.gres.device import (ComputeInstance, GiProfile, GpuInfo, GpuInstance, MemoryInfo, MigDevice, Placement,
                         ProcessInfo, ProcessUtil, Utilization, ci_cap_minor, gi_cap_minor)
from gpushare.gres.errors import GpuError, NvmlCode
from gpushare.gres.memlimits import GET_FN, LIMIT_MAX, SET_FN, GetLimits, MemoryLimit, SetLimits, check_limits, nvml_call
from gpushare.gres.mps import DaemonMps
from gpushare.gres.na import NA, NaType
from gpushare.gres.nvml_query import RAISE, Nvml

GI_PROFILE_COUNT = 0x12  # NVML_GPU_INSTANCE_PROFILE_COUNT (nvml.h, R570)
CI_PROFILE_BY_SLICES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}  # NVML_COMPUTE_INSTANCE_PROFILE_*
MAX_PLACEMENTS = 32  # > memory slices of any GPU (8)
MIG_MINORS = Path("/proc/driver/nvidia-caps/mig-minors")
DcgmFields = Callable[[int], "tuple[float, float, float] | None"]  # index -> (smact, smocc, drama)
_NO_ID = 0xFFFFFFFF  # what NVML puts in gpuInstanceId/computeInstanceId outside MIG


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def match_model(name: str, catalogue: dict[str, GpuModel] | None = None) -> str | None:
    """Catalogue key whose marketing name is a prefix of NVML's name (longest wins), else None."""
    table = BUILTIN_GPUS if catalogue is None else catalogue
    hits = [m for m in table.values() if name.startswith(m.marketing_name)]
    return max(hits, key=lambda m: len(m.marketing_name)).name if hits else None


def read_mig_minors(path: Path = MIG_MINORS) -> dict[str, int]:
    """``/proc/driver/nvidia-caps/mig-minors`` as {"gpu0/gi1/access": 12, …}; {} when unreadable."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    return {name: int(minor) for name, minor in (ln.split() for ln in lines if len(ln.split()) == 2)}


class NvmlBackend:
    """GPUs as the driver reports them."""

    name = "nvml"

    def __init__(self, module: ModuleType | None = None, dcgm: DcgmFields | None = None,
                 catalogue: dict[str, GpuModel] | None = None) -> None:
        self.nvml = Nvml(module)
        self.dcgm = dcgm
        self.catalogue = catalogue

    def _q(self, func: str, *args: Any, default: Any = NA) -> Any:
        return self.nvml.query(func, *args, default=default)

    def _h(self, index: int) -> Any:
        return self._q("nvmlDeviceGetHandleByIndex_v2", index, default=RAISE)

    # -- inventory ---------------------------------------------------------------------------------
    def gpu_count(self) -> int:
        return int(self._q("nvmlDeviceGetCount_v2", default=RAISE))

    def gpu(self, index: int) -> GpuInfo:
        h = self._h(index)
        name = _text(self._q("nvmlDeviceGetName", h, default=RAISE))
        mode = self._q("nvmlDeviceGetMigMode", h)
        current, pending = (NA, NA) if mode is NA else (bool(mode[0]), bool(mode[1]))
        return GpuInfo(index, _text(self._q("nvmlDeviceGetUUID", h, default=RAISE)), name,
                       match_model(name, self.catalogue), int(self._q("nvmlDeviceGetMemoryInfo", h, default=RAISE).total),
                       int(self._q("nvmlDeviceGetMinorNumber", h, default=RAISE)), current, pending)

    def gpus(self) -> list[GpuInfo]:
        return [self.gpu(i) for i in range(self.gpu_count())]

    # -- telemetry ---------------------------------------------------------------------------------
    def memory(self, index: int) -> MemoryInfo:
        info = self._q("nvmlDeviceGetMemoryInfo", self._h(index))
        if info is NA:
            return MemoryInfo(NA, NA, NA)
        return MemoryInfo(int(info.total), int(info.used), int(info.free))

    def processes(self, index: int) -> list[ProcessInfo]:
        procs = self._q("nvmlDeviceGetComputeRunningProcesses_v3", self._h(index), default=[])
        out = []
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            gi = getattr(p, "gpuInstanceId", _NO_ID)
            ci = getattr(p, "computeInstanceId", _NO_ID)
            out.append(ProcessInfo(int(p.pid), NA if used is None else int(used),
                                   None if gi in (None, _NO_ID) else int(gi), None if ci in (None, _NO_ID) else int(ci)))
        return out

    def utilization(self, index: int) -> Utilization:
        rates = self._q("nvmlDeviceGetUtilizationRates", self._h(index))
        gpu_u, mem_u = (NA, NA) if rates is NA else (rates.gpu / 100.0, rates.memory / 100.0)
        fields = self.dcgm(index) if self.dcgm is not None else None
        if fields is not None:
            smact, smocc, drama = fields
            return Utilization("dcgm", smact, smocc, drama, gpu_u, mem_u)
        return Utilization("nvml", NA, NA, NA, gpu_u, mem_u)

    def process_utilization(self, index: int, since_us: int = 0) -> list[ProcessUtil] | NaType:
        """nvmlDeviceGetProcessUtilization: NA when unsupported, [] when NVML has no sample newer than since_us."""
        try:
            samples = self._q("nvmlDeviceGetProcessUtilization", self._h(index), int(since_us))
        except GpuError as exc:
            if exc.code is NvmlCode.NOT_FOUND:  # NVML's answer when no sample is newer than since_us
                return []
            raise
        if samples is NA:
            return NA
        return [ProcessUtil(int(p.pid), max(0.0, min(1.0, float(p.smUtil) / 100.0)), int(p.timeStamp))
                for p in samples]

    def power_watts(self, index: int) -> float:
        mw = self._q("nvmlDeviceGetPowerUsage", self._h(index))
        return NA if mw is NA else mw / 1000.0

    def energy_mj(self, index: int) -> int:
        mj = self._q("nvmlDeviceGetTotalEnergyConsumption", self._h(index))
        return NA if mj is NA else int(mj)

    # -- MIG mode ----------------------------------------------------------------------------------
    def set_mig_mode(self, index: int, enabled: bool) -> bool:
        h = self._h(index)
        self._q("nvmlDeviceSetMigMode", h, 1 if enabled else 0, default=RAISE)
        current, pending = self._q("nvmlDeviceGetMigMode", h, default=RAISE)
        return current == pending

    def reset_gpu(self, index: int) -> None:
        """``nvidia-smi -r`` (NVML exposes no reset); IN_USE when the GPU is held."""
        try:
            done = subprocess.run(["nvidia-smi", "-r", "-i", str(index)], capture_output=True, text=True,
                                  timeout=120, check=False)
        except FileNotFoundError:
            raise GpuError(NvmlCode.NOT_SUPPORTED, "reset GPU: nvidia-smi not found") from None
        if done.returncode != 0:
            text = (done.stdout + done.stderr).strip()
            code = NvmlCode.IN_USE if "in use" in text.lower() else NvmlCode.UNKNOWN
            raise GpuError(code, f"reset GPU {index}: {text}")

    # -- MIG instances -----------------------------------------------------------------------------
    def _gi_profile_info(self, h: Any, profile: int) -> Any:
        lib = self.nvml.lib
        try:
            return lib.nvmlDeviceGetGpuInstanceProfileInfo(h, profile, 2)
        except lib.NVMLError as exc:
            code = NvmlCode.parse(exc.value)
            if code is NvmlCode.FUNCTION_NOT_FOUND:
                return self._q(lib.nvmlDeviceGetGpuInstanceProfileInfo, h, profile, 1, default=None)
            if code in (NvmlCode.NOT_SUPPORTED, NvmlCode.INVALID_ARGUMENT):
                return None  # this profile does not exist on this GPU
            raise GpuError(code, "nvmlDeviceGetGpuInstanceProfileInfo") from exc

    def _placements(self, h: Any, info: Any) -> tuple[Placement, ...]:
        lib = self.nvml.lib
        # Sized by memory slices, not instanceCount: "+me" profiles allow 1 instance at any of 7 places.
        arr = (lib.c_nvmlGpuInstancePlacement_t * MAX_PLACEMENTS)()
        count = ctypes.c_uint(len(arr))  # in: array size, out: placements written
        self._q("nvmlDeviceGetGpuInstancePossiblePlacements", h, info.id, arr, ctypes.byref(count), default=RAISE)
        return tuple(Placement(int(arr[i].start), int(arr[i].size)) for i in range(count.value))

    def _profiles(self, h: Any) -> dict[int, tuple[Any, str]]:
        out = {}
        for p in range(GI_PROFILE_COUNT):
            info = self._gi_profile_info(h, p)
            if info is not None and info.id not in out:
                name = _text(getattr(info, "name", b"")) or f"{info.sliceCount}g.{info.memorySizeMB // 1024}gb"
                out[int(info.id)] = (info, name.removeprefix("MIG "))
        return out

    def gi_profiles(self, index: int) -> list[GiProfile]:
        h = self._h(index)
        return [GiProfile(pid, name, int(info.sliceCount), int(info.memorySizeMB) * MiB, int(info.instanceCount),
                          self._placements(h, info)) for pid, (info, name) in sorted(self._profiles(h).items())]

    def _gi(self, h: Any, gi_id: int) -> Any:
        return self._q("nvmlDeviceGetGpuInstanceById", h, gi_id, default=RAISE)

    def _gi_record(self, index: int, gi: Any, names: dict[int, tuple[Any, str]]) -> GpuInstance:
        info = self._q("nvmlGpuInstanceGetInfo", gi, default=RAISE)
        name = names.get(int(info.profileId), (None, str(info.profileId)))[1]
        return GpuInstance(index, int(info.id), int(info.profileId), name,
                           Placement(int(info.placement.start), int(info.placement.size)))

    def create_gpu_instance(self, index: int, profile_id: int, start: int) -> GpuInstance:
        h = self._h(index)
        profiles = self._profiles(h)
        if profile_id not in profiles:
            raise GpuError(NvmlCode.INVALID_ARGUMENT, f"GPU {index} has no GPU-instance profile id {profile_id}")
        sizes = {p.start: p.size for p in self._placements(h, profiles[profile_id][0])}
        if start not in sizes:
            raise GpuError(NvmlCode.INVALID_ARGUMENT, f"profile {profile_id} may start only at {sorted(sizes)}")
        placement = self.nvml.lib.c_nvmlGpuInstancePlacement_t(start, sizes[start])
        gi = self._q("nvmlDeviceCreateGpuInstanceWithPlacement", h, profile_id, placement, default=RAISE)
        return self._gi_record(index, gi, profiles)

    def gpu_instances(self, index: int) -> list[GpuInstance]:
        h = self._h(index)
        profiles = self._profiles(h)
        lib = self.nvml.lib
        out = []
        for pid, (info, _) in profiles.items():
            arr = (lib.c_nvmlGpuInstance_t * max(1, int(info.instanceCount)))()
            count = ctypes.c_uint(0)
            self._q("nvmlDeviceGetGpuInstances", h, pid, arr, ctypes.byref(count), default=RAISE)
            out += [self._gi_record(index, arr[i], profiles) for i in range(count.value)]
        return sorted(out, key=lambda gi: gi.id)

    def _ci_profile(self, gi: Any, slices: int) -> Any:
        lib = self.nvml.lib
        engine = getattr(lib, "NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED", 0)
        return self._q(lib.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi, CI_PROFILE_BY_SLICES[slices], engine,
                       default=RAISE)

    def create_compute_instance(self, index: int, gi_id: int) -> ComputeInstance:
        h = self._h(index)
        gi = self._gi(h, gi_id)
        gi_info = self._q("nvmlGpuInstanceGetInfo", gi, default=RAISE)
        slices = int(self._profiles(h)[int(gi_info.profileId)][0].sliceCount)
        ci_profile = self._ci_profile(gi, slices)
        ci = self._q("nvmlGpuInstanceCreateComputeInstance", gi, ci_profile.id, default=RAISE)
        info = self._q("nvmlComputeInstanceGetInfo", ci, default=RAISE)
        return ComputeInstance(index, gi_id, int(info.id), int(info.profileId), slices)

    def compute_instances(self, index: int, gi_id: int) -> list[ComputeInstance]:
        gi = self._gi(self._h(index), gi_id)
        lib = self.nvml.lib
        out = []
        for slices, _ in sorted(CI_PROFILE_BY_SLICES.items()):
            try:
                prof = self._ci_profile(gi, slices)
            except GpuError as exc:
                if exc.code in (NvmlCode.NOT_SUPPORTED, NvmlCode.INVALID_ARGUMENT):
                    continue
                raise
            arr = (lib.c_nvmlComputeInstance_t * max(1, int(prof.instanceCount)))()
            count = ctypes.c_uint(0)
            self._q("nvmlGpuInstanceGetComputeInstances", gi, prof.id, arr, ctypes.byref(count), default=RAISE)
            for i in range(count.value):
                info = self._q("nvmlComputeInstanceGetInfo", arr[i], default=RAISE)
                out.append(ComputeInstance(index, gi_id, int(info.id), int(info.profileId), slices))
        return out

    def destroy_compute_instance(self, index: int, gi_id: int, ci_id: int) -> None:
        gi = self._gi(self._h(index), gi_id)
        ci = self._q("nvmlGpuInstanceGetComputeInstanceById", gi, ci_id, default=RAISE)
        self._q("nvmlComputeInstanceDestroy", ci, default=RAISE)

    def destroy_gpu_instance(self, index: int, gi_id: int) -> None:
        self._q("nvmlGpuInstanceDestroy", self._gi(self._h(index), gi_id), default=RAISE)

    def mig_devices(self, index: int) -> list[MigDevice]:
        h = self._h(index)
        mode = self._q("nvmlDeviceGetMigMode", h)
        if mode is NA or not mode[0]:
            return []
        minor = int(self._q("nvmlDeviceGetMinorNumber", h, default=RAISE))
        names = {gi.id: gi.profile_name for gi in self.gpu_instances(index)}
        caps = read_mig_minors()
        out = []
        for i in range(int(self._q("nvmlDeviceGetMaxMigDeviceCount", h, default=0))):
            try:
                mh = self._q("nvmlDeviceGetMigDeviceHandleByIndex", h, i, default=RAISE)
            except GpuError as exc:
                if exc.code is NvmlCode.NOT_FOUND:
                    continue
                raise
            gi = int(self._q("nvmlDeviceGetGpuInstanceId", mh, default=RAISE))
            ci = int(self._q("nvmlDeviceGetComputeInstanceId", mh, default=RAISE))
            out.append(MigDevice(index, minor, gi, ci, _text(self._q("nvmlDeviceGetUUID", mh, default=RAISE)),
                                 names.get(gi, "?"), int(self._q("nvmlDeviceGetMemoryInfo", mh, default=RAISE).total),
                                 caps.get(f"gpu{minor}/gi{gi}/access", gi_cap_minor(minor, gi)),
                                 caps.get(f"gpu{minor}/gi{gi}/ci{ci}/access", ci_cap_minor(minor, gi, ci))))
        return out

    # -- MPS / lifecycle ---------------------------------------------------------------------------
    def mps(self, run_dir: str) -> DaemonMps:
        return DaemonMps(run_dir)

    # -- per-cgroup memory limits (ctypes: gpushare.gres.memlimits) ------------------------------------
    def set_memory_limit(self, index: int, cgroup: str, hard_bytes: int, soft_bytes: int = 0) -> None:
        check_limits(cgroup, hard_bytes, soft_bytes)
        nvml_call(self.nvml.lib, self._h(index), SET_FN, SetLimits(cgroup.encode(), soft_bytes, hard_bytes))

    def clear_memory_limit(self, index: int, cgroup: str) -> None:
        self.set_memory_limit(index, cgroup, LIMIT_MAX, 0)

    def memory_limit(self, index: int, cgroup: str) -> MemoryLimit:
        got = GetLimits(cgroup.encode(), 0, 0, 0)
        nvml_call(self.nvml.lib, self._h(index), GET_FN, got)
        hard = int(got.hardLimit)
        return MemoryLimit(cgroup, int(got.softLimit), None if hard == LIMIT_MAX else hard, int(got.currentUsed))

    def close(self) -> None:
        self.nvml.shutdown()
