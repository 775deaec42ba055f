"""The device interface: what every node-side part may ask of a GPU, as plain records and one Protocol.

Why a Protocol with two implementations (docs/style.md #3): the agent, the MIG executor and the simulator are
written once against :class:`GpuBackend`; ``gpushare.gres.nvml_backend`` answers from the driver and
``gpushare.gres.sim_backend`` from a scenario with NVML's own semantics and error codes, so the same code is
tested here without a GPU and runs unchanged on a node.

Conventions for every method:
- GPUs are addressed by their NVML index (``nvmlDeviceGetHandleByIndex``), MIG GPU instances by
  ``(gpu index, GI id)`` and compute instances by ``(gpu index, GI id, CI id)``, as NVML does.
- Units: memory in bytes, power in watts (float), energy in millijoules (int, NVML's unit
  and origin: since the driver was loaded), utilisation as fractions 0..1.
- A metric the GPU does not support is :data:`gpushare.gres.na.NA`; a real fault raises
  :class:`gpushare.gres.errors.GpuError` with NVML's code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, TypeAlias, runtime_checkable

from gpushare.gres.na import NaType

if TYPE_CHECKING:
    from gpushare.gres.memlimits import MemoryLimit
    from gpushare.gres.mps import MpsControl

# Explicit aliases: mypy sees ``NaType`` only through the installed ``gpushare.gres`` name, which it cannot
# resolve (package-dir mapping), so an implicit alias of ``int | <Any>`` would not count as a type.
Number: TypeAlias = int | NaType
Fraction: TypeAlias = float | NaType
UtilSource: TypeAlias = Literal["dcgm", "nvml"]


@dataclass(frozen=True)
class GpuInfo:
    """Static-ish facts about one GPU (inventory)."""

    index: int  # NVML index
    uuid: str  # "GPU-…"
    name: str  # nvmlDeviceGetName, e.g. "NVIDIA A100-SXM4-40GB"
    model: str | None  # gpushare catalogue key ("a100-40gb") when the name matches one, else None
    total_bytes: int
    minor: int  # /dev/nvidia<minor>
    mig_current: bool | NaType  # NA on GPUs without MIG
    mig_pending: bool | NaType  # differs from current until the GPU is reset


@dataclass(frozen=True)
class MemoryInfo:
    total: int
    used: Number
    free: Number


@dataclass(frozen=True)
class ProcessInfo:
    """A running compute process (nvmlDeviceGetComputeRunningProcesses)."""

    pid: int
    used_bytes: Number  # NA when the driver cannot attribute memory (e.g. some MIG/MPS setups)
    gpu_instance_id: int | None = None  # set on MIG GPUs
    compute_instance_id: int | None = None


@dataclass(frozen=True)
class ProcessUtil:
    """One per-process utilisation sample (nvmlDeviceGetProcessUtilization): SM activity of one process.

    ``sm`` > 0 means the process ran kernels in the sampling interval ending at ``timestamp_us`` (CPU
    time, µs since the epoch, NVML's clock). The driver samples every few hundred ms; under MPS the
    samples belong to the MPS server, not to its clients.
    """

    pid: int
    sm: float  # fraction 0..1
    timestamp_us: int


@dataclass(frozen=True)
class Utilization:
    """One utilisation sample. ``source`` says which fields are real.

    ``dcgm``: SMACT (fraction of time ≥1 warp was resident on an SM, averaged over SMs), SMOCC (resident
    warps / max warps) and DRAMA (fraction of cycles the memory interface was busy) — the fields CARMA's
    risk score uses; ``gpu``/``memory`` may be filled too. ``nvml``: only ``gpu`` (fraction of time a kernel
    ran) and ``memory`` (fraction of time memory was read or written), SMACT/SMOCC/DRAMA are NA.
    """

    source: UtilSource
    smact: Fraction
    smocc: Fraction
    drama: Fraction
    gpu: Fraction
    memory: Fraction


@dataclass(frozen=True)
class Placement:
    """Where a GPU instance sits: ``start`` and ``size`` in memory slices (nvmlGpuInstancePlacement_t)."""

    start: int
    size: int


@dataclass(frozen=True)
class GiProfile:
    """A GPU-instance profile as NVML reports it for this GPU (ids differ between models)."""

    id: int  # nvmlGpuInstanceProfileInfo_t.id
    name: str  # "3g.20gb"
    compute_slices: int  # sliceCount
    memory_bytes: int  # memorySizeMB * MiB
    max_count: int  # instanceCount on an empty GPU
    placements: tuple[Placement, ...]  # nvmlDeviceGetGpuInstancePossiblePlacements


@dataclass(frozen=True)
class GpuInstance:
    gpu_index: int
    id: int  # GI id
    profile_id: int
    profile_name: str
    placement: Placement


@dataclass(frozen=True)
class ComputeInstance:
    gpu_index: int
    gpu_instance_id: int
    id: int  # CI id within its GI
    profile_id: int  # NVML_COMPUTE_INSTANCE_PROFILE_* index
    slices: int


@dataclass(frozen=True)
class MigDevice:
    """A usable MIG device (one compute instance) with what Slurm's gres.conf and CUDA need."""

    gpu_index: int
    gpu_minor: int
    gpu_instance_id: int
    compute_instance_id: int
    uuid: str  # "MIG-…", what CUDA_VISIBLE_DEVICES accepts
    profile_name: str
    memory_bytes: int
    gi_cap_minor: int  # /dev/nvidia-caps/nvidia-cap<minor> granting access to the GI
    ci_cap_minor: int  # … and to the CI


# /proc/driver/nvidia-caps/mig-minors: "config 1", "monitor 2", then per GPU minor g, GI i (0..14) and
# CI c (0..7): gpu<g>/gi<i>/access = 3 + g*135 + i*9 and gpu<g>/gi<i>/ci<c>/access = that + 1 + c.
_MINORS_PER_GI = 9
_GIS_PER_GPU = 15


def gi_cap_minor(gpu_minor: int, gi_id: int) -> int:
    """The nvidia-caps minor the driver assigns to ``gpu<minor>/gi<gi_id>/access``."""
    return 3 + gpu_minor * _GIS_PER_GPU * _MINORS_PER_GI + gi_id * _MINORS_PER_GI


def ci_cap_minor(gpu_minor: int, gi_id: int, ci_id: int) -> int:
    """The nvidia-caps minor for ``gpu<minor>/gi<gi_id>/ci<ci_id>/access``."""
    return gi_cap_minor(gpu_minor, gi_id) + 1 + ci_id


@runtime_checkable
class GpuBackend(Protocol):
    """The device interface. Both backends implement all of it; see the module docstring for units."""

    name: str  # "nvml" or "sim"

    # inventory
    def gpu_count(self) -> int: ...
    def gpu(self, index: int) -> GpuInfo: ...
    def gpus(self) -> list[GpuInfo]: ...

    # telemetry
    def memory(self, index: int) -> MemoryInfo: ...
    def processes(self, index: int) -> list[ProcessInfo]: ...
    def utilization(self, index: int) -> Utilization: ...
    # per-process samples newer than since_us; NA where the GPU cannot report them, [] when none are new
    def process_utilization(self, index: int, since_us: int = 0) -> "list[ProcessUtil] | NaType": ...
    def power_watts(self, index: int) -> Fraction: ...
    def energy_mj(self, index: int) -> Number: ...

    # MIG mode (changes stay pending until reset_gpu on GPUs that need it)
    def set_mig_mode(self, index: int, enabled: bool) -> bool: ...  # True when already active
    def reset_gpu(self, index: int) -> None: ...

    # MIG instances: create GI with explicit placement, then CI; destroy CI first, then GI
    def gi_profiles(self, index: int) -> list[GiProfile]: ...
    def create_gpu_instance(self, index: int, profile_id: int, start: int) -> GpuInstance: ...
    def create_compute_instance(self, index: int, gi_id: int) -> ComputeInstance: ...
    def gpu_instances(self, index: int) -> list[GpuInstance]: ...
    def compute_instances(self, index: int, gi_id: int) -> list[ComputeInstance]: ...
    def destroy_compute_instance(self, index: int, gi_id: int, ci_id: int) -> None: ...
    def destroy_gpu_instance(self, index: int, gi_id: int) -> None: ...
    def mig_devices(self, index: int) -> list[MigDevice]: ...

    # MPS daemons (real binary, or recorded in the simulated state)
    def mps(self, run_dir: str) -> "MpsControl": ...

    # per-cgroup device memory limits (NVIDIA r615+, gpushare.gres.memlimits): GpuError FUNCTION_NOT_FOUND when
    # the driver has none, NOT_SUPPORTED when its accounting is off or the GPU is in MIG mode, NOT_FOUND for a
    # cgroup that does not exist; ``cgroup`` is the cgroup's absolute sysfs path
    def set_memory_limit(self, index: int, cgroup: str, hard_bytes: int, soft_bytes: int = 0) -> None: ...
    def clear_memory_limit(self, index: int, cgroup: str) -> None: ...
    def memory_limit(self, index: int, cgroup: str) -> "MemoryLimit": ...

    def close(self) -> None: ...
