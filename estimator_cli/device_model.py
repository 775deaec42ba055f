"""The device level of the estimate: how much of a target GPU a PyTorch process can give its allocator.

Why: the caching-allocator model says how much memory PyTorch *reserves*; what ``nvidia-smi`` shows, and
what decides whether a job fits a shared GPU or a MIG slice, also holds the CUDA context (driver, runtime,
lazily loaded kernels of PyTorch, cuBLAS and cuDNN) and any memory other tenants hold. The GPU itself comes
from the one catalogue, :mod:`gpushare.gpus`; this module only adds what the catalogue does not know.

Numbers and their sources (all MiB unless said otherwise):

* CUDA context with ``CUDA_MODULE_LOADING=LAZY`` (PyTorch sets it by default since 1.13,
  pytorch/pytorch#86509; CUDA >= 11.7): about 274 MiB measured in that PR (287,047,680 bytes, against
  666 MB with eager loading); "around 300 MB" and "around 400 MB" for torch 2.x according to PyTorch's CUDA
  maintainer (pytorch/pytorch#107667, #109888); 426 MiB for torch 2.10 + CUDA 13.0 on an RTX 6000 Ada
  (unslothai/unsloth-zoo#1053, ``mem_get_info`` only, no kernels run). The context grows with the number
  of SMs (per-SM local-memory reserve), hence the per-architecture table ``_CONTEXT_MIB`` below; treat
  these as starting points that the accuracy benchmark calibrates, not as measurements of ours.
* Lazily loaded library kernels: the first GEMM loads cuBLAS/cuBLASLt kernels, the first convolution
  cuDNN's; ``_CUBLAS_LIB_MIB`` / ``_CUDNN_LIB_MIB`` are rough sizes of what a training step pulls in.
* cuBLAS workspace: ``at::cuda::getChosenWorkspaceSize`` (aten/src/ATen/cuda/CublasHandlePool.cpp):
  ``:4096:2:16:8`` = 2 x 4096 KiB + 8 x 16 KiB = 8,519,680 bytes by default, 32 MiB (``:4096:8``) on
  Hopper and Blackwell (compute capability 9.x/10.x/12.x; torch 2.4-2.5 only checked sm_90);
  ``CUBLAS_WORKSPACE_CONFIG=:SIZE_KiB:COUNT[:SIZE:COUNT...]`` overrides it. It is allocated **through the
  caching allocator** (``getNewWorkspace``/``allocateCUDABlasWorkspace``), once per (handle, stream), so
  the orchestrator adds it to the replayed events rather than to ``reserved_elsewhere``. The cuBLASLt
  workspace (``CUBLASLT_WORKSPACE_SIZE``, 1024 KiB default) is served from the cuBLAS one in recent torch
  (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``), so it adds nothing by default.
* MIG: the capacity is the profile's usable memory from the catalogue; the context is the same order of
  size inside a slice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpushare.gpus import GpuModel, MigProfile, capacity_bytes, parse_target

MiB = 1 << 20
KiB = 1 << 10

# Compute capability per catalogue model (not part of the catalogue, which only describes memory and MIG).
_SM_ARCH_BY_NAME: dict[str, tuple[int, int]] = {
    "a100-40gb": (8, 0),
    "a100-80gb": (8, 0),
    "a30-24gb": (8, 0),
    "h100-80gb": (9, 0),
    "h200-141gb": (9, 0),
    "l40s-48gb": (8, 9),
    "v100-32gb": (7, 0),
    "rtx3060-12gb": (8, 6),
    "rtx4060-8gb": (8, 9),
}
# Fallback for site-added models: the marketing name NVML reports.
_SM_ARCH_BY_MARKETING = (
    (re.compile(r"\b(B100|B200|GB200)\b"), (10, 0)),
    (re.compile(r"\b(H100|H200|H800|GH200)\b"), (9, 0)),
    (re.compile(r"\b(L4|L40S?|RTX 40\d\d|RTX 6000 Ada)\b"), (8, 9)),
    (re.compile(r"\b(A100|A30|A800)\b"), (8, 0)),
    (re.compile(r"\b(A10|A40|A16|A2|RTX 30\d\d|RTX A\d000)\b"), (8, 6)),
    (re.compile(r"\b(T4|RTX 20\d\d)\b"), (7, 5)),
    (re.compile(r"\bV100\b"), (7, 0)),
)
DEFAULT_SM_ARCH = (8, 0)

# CUDA context with lazy module loading, by compute capability major.minor (see module docstring).
_CONTEXT_MIB: dict[tuple[int, int], int] = {
    (7, 0): 310,
    (7, 5): 300,
    (8, 0): 420,
    (8, 6): 300,
    (8, 9): 426,
    (9, 0): 520,
    (10, 0): 560,
}
_DEFAULT_CONTEXT_MIB = 450
_CUBLAS_LIB_MIB = 64  # cuBLAS + cuBLASLt kernels a training step loads
_CUDNN_LIB_MIB = 128  # cuDNN convolution/normalisation kernels

# getChosenWorkspaceSize defaults.
CUBLAS_WORKSPACE_DEFAULT = 4096 * KiB * 2 + 16 * KiB * 8  # ":4096:2:16:8" = 8,519,680 bytes
CUBLAS_WORKSPACE_LARGE = 4096 * KiB * 8  # ":4096:8" = 32 MiB on Hopper/Blackwell
_LARGE_WORKSPACE_MAJORS = frozenset({9, 10, 11, 12})
CUBLASLT_WORKSPACE_DEFAULT = 1024 * KiB  # parseCUDABlasLtWorkspaceSize default


@dataclass(frozen=True)
class DeviceModel:
    """A target GPU (or MIG slice) as the allocator replay and the report see it. Sizes in bytes."""

    name: str  # the target as given, normalised: "a100-40gb" or "a100-40gb:3g.20gb"
    model: GpuModel
    mig_profile: MigProfile | None
    capacity_bytes: int  # what cudaMemGetInfo reports as total: whole card or MIG usable memory
    context_bytes: int  # CUDA context + lazily loaded library kernels, outside the caching allocator
    cublas_workspace_bytes: int  # one per (cuBLAS handle, stream), allocated through the caching allocator
    cublaslt_workspace_bytes: int  # extra cuBLASLt workspace per (handle, stream); 0 when unified
    sm_arch: tuple[int, int]  # compute capability, e.g. (8, 0) for A100, (9, 0) for H100/H200
    sm_count: int

    @property
    def is_mig(self) -> bool:
        return self.mig_profile is not None

    @property
    def allocatable_bytes(self) -> int:
        """Memory left for the caching allocator once the context is loaded (one tenant)."""
        return max(self.capacity_bytes - self.context_bytes, 0)


def sm_arch_for(model: GpuModel) -> tuple[int, int]:
    """Compute capability of a catalogue model; site-added models are matched by marketing name."""
    if model.name in _SM_ARCH_BY_NAME:
        return _SM_ARCH_BY_NAME[model.name]
    for pattern, arch in _SM_ARCH_BY_MARKETING:
        if pattern.search(model.marketing_name):
            return arch
    return DEFAULT_SM_ARCH


def context_bytes_for(sm_arch: tuple[int, int], *, uses_cublas: bool = True, uses_cudnn: bool = True) -> int:
    """CUDA context plus the library kernels a training step loads lazily."""
    mib = _CONTEXT_MIB.get(sm_arch, _DEFAULT_CONTEXT_MIB)
    if uses_cublas:
        mib += _CUBLAS_LIB_MIB
    if uses_cudnn:
        mib += _CUDNN_LIB_MIB
    return mib * MiB


def cublas_workspace_bytes(sm_arch: tuple[int, int], env: str | None = None) -> int:
    """at::cuda::getChosenWorkspaceSize for a device of ``sm_arch`` and a ``CUBLAS_WORKSPACE_CONFIG`` value.

    Like PyTorch, an unparsable value falls back to the default (PyTorch warns); ``:SIZE:COUNT`` pairs add up.
    """
    default = CUBLAS_WORKSPACE_LARGE if sm_arch[0] in _LARGE_WORKSPACE_MAJORS else CUBLAS_WORKSPACE_DEFAULT
    if env is None:
        return default
    pairs = re.findall(r":([0-9]+):([0-9]+)", env)
    if not pairs:
        return default
    return sum(int(size) * KiB * int(count) for size, count in pairs)


def device_for(
    target: str,
    catalogue: dict[str, GpuModel] | None = None,
    *,
    uses_cublas: bool = True,
    uses_cudnn: bool = True,
    cublas_workspace_config: str | None = None,
    cublaslt_unified: bool = True,
) -> DeviceModel:
    """The device model of a target name such as ``"h100-80gb"`` or ``"a100-40gb:3g.20gb"``.

    Raises ValueError (from :func:`gpushare.gpus.parse_target`) for unknown GPUs or profiles, naming the
    known ones.
    """
    model, profile = parse_target(target, catalogue)
    arch = sm_arch_for(model)
    name = model.name if profile is None else f"{model.name}:{profile.name}"
    return DeviceModel(
        name=name,
        model=model,
        mig_profile=profile,
        capacity_bytes=capacity_bytes(model, profile),
        context_bytes=context_bytes_for(arch, uses_cublas=uses_cublas, uses_cudnn=uses_cudnn),
        cublas_workspace_bytes=cublas_workspace_bytes(arch, cublas_workspace_config),
        cublaslt_workspace_bytes=0 if cublaslt_unified else CUBLASLT_WORKSPACE_DEFAULT,
        sm_arch=arch,
        sm_count=model.sms if profile is None else profile.sms,
    )


__all__ = [
    "CUBLASLT_WORKSPACE_DEFAULT",
    "CUBLAS_WORKSPACE_DEFAULT",
    "CUBLAS_WORKSPACE_LARGE",
    "DeviceModel",
    "context_bytes_for",
    "cublas_workspace_bytes",
    "device_for",
    "sm_arch_for",
]
