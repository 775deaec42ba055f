"""The device level of the estimate: how much of a target GPU a PyTorch process can give its allocator.

Why: the caching-allocator model says how much memory PyTorch *reserves*; what ``nvidia-smi`` shows, and
what decides whether a job fits a shared GPU or a MIG slice, also holds the CUDA context (driver, runtime,
lazily loaded kernels of PyTorch, cuBLAS and cuDNN) and any memory other tenants hold. The GPU itself comes
from the one catalogue, :mod:`gpushare.gpus`; this module only adds what the catalogue does not know.

Numbers and their sources (all MiB unless said otherwise):

* CUDA context and lazily loaded library kernels (cuBLAS/cuBLASLt on the first GEMM, cuDNN on the first
  convolution), outside the caching allocator: :mod:`gpushare.cuda_context`, which the node agent reads too
  (measured on an H200 for compute capability 9.0; sources for the others there).
* cuBLAS workspace: ``at::cuda::getChosenWorkspaceSize`` (aten/src/ATen/cuda/CublasHandlePool.cpp):
  ``:4096:2:16:8`` = 2 x 4096 KiB + 8 x 16 KiB = 8,519,680 bytes by default, 32 MiB (``:4096:8``) on
  Hopper and Blackwell (compute capability 9.x/10.x/12.x; torch 2.4-2.5 only checked sm_90);
  ``CUBLAS_WORKSPACE_CONFIG=:SIZE_KiB:COUNT[:SIZE:COUNT...]`` overrides it. It is allocated **through the
  caching allocator** (``getNewWorkspace``/``allocateCUDABlasWorkspace``), once per (handle, stream), so
  the orchestrator adds it to the replayed events rather than to ``reserved_elsewhere``.
* cuBLASLt workspace: ``getCUDABlasLtWorkspace`` (same file) keeps one more block per (handle, stream),
  of ``getCUDABlasLtWorkspaceSize()`` = ``CUBLASLT_WORKSPACE_SIZE`` KiB, 1024 KiB by default, allocated
  through the caching allocator on the first cuBLASLt call (``addmm`` with a bias goes through
  ``gemm_and_bias``) and kept. It is served from the cuBLAS workspace instead only when
  ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` unifies the two. Measured on an H200 with PyTorch 2.11 (all 20
  traces of ``benchmarks/results/gpu_ground_truth_h200_history.json``): one never-freed 1 MiB block right
  after the forward thread's first 32 MiB cuBLAS workspace, none for the backward thread (plain ``mm``).
* MIG: the capacity is the profile's usable memory from the catalogue; the context is the same order of
  size inside a slice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpushare.cuda_context import context_bytes_for
from gpushare.gpus import KiB, GpuModel, MigProfile, capacity_bytes, parse_target


# getChosenWorkspaceSize defaults.
CUBLAS_WORKSPACE_DEFAULT = 4096 * KiB * 2 + 16 * KiB * 8  # ":4096:2:16:8" = 8,519,680 bytes
CUBLAS_WORKSPACE_LARGE = 4096 * KiB * 8  # ":4096:8" = 32 MiB on Hopper/Blackwell
_LARGE_WORKSPACE_MAJORS = frozenset({9, 10, 11, 12})
CUBLASLT_WORKSPACE_DEFAULT = 1024 * KiB  # parseCUDABlasLtWorkspaceSize default
_TRUE = frozenset({"1", "true", "yes", "on", "y"})


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
    """Compute capability of a catalogue model (a site-added one's comes from the config file or its marketing
    name: :class:`gpushare.gpus.GpuModel`)."""
    return model.sm_arch


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


def cublaslt_workspace_bytes(size_env: str | None = None, unified_env: str | None = None) -> int:
    """The extra cuBLASLt workspace per (handle, stream): 0 when ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` is set
    true, else ``CUBLASLT_WORKSPACE_SIZE`` KiB (1024 by default; an unparsable value keeps the default, as
    PyTorch does after a warning)."""
    if unified_env is not None and unified_env.strip().lower() in _TRUE:
        return 0
    if size_env is not None:
        try:
            return int(size_env.strip()) * KiB
        except ValueError:
            pass
    return CUBLASLT_WORKSPACE_DEFAULT


def device_for(
    target: str,
    catalogue: dict[str, GpuModel] | None = None,
    *,
    uses_cublas: bool = True,
    uses_cudnn: bool = True,
    cublas_workspace_config: str | None = None,
    cublaslt_workspace_size: str | None = None,
    cublaslt_unified: str | None = None,
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
        context_bytes=model.context_bytes(uses_cublas=uses_cublas, uses_cudnn=uses_cudnn),
        cublas_workspace_bytes=cublas_workspace_bytes(arch, cublas_workspace_config),
        cublaslt_workspace_bytes=cublaslt_workspace_bytes(cublaslt_workspace_size, cublaslt_unified),
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
    "cublaslt_workspace_bytes",
    "device_for",
    "sm_arch_for",
]
