"""What a PyTorch process holds on a GPU outside its caching allocator: the CUDA context and library kernels.

Why in the core: two parts need the same number. The estimator adds it to the replayed allocator peak to
predict what ``nvidia-smi`` shows (gpushare.estimator_cli.device_model); the node agent subtracts it from a
job's need before turning the need into PyTorch's ``per_process_memory_fraction``, which bounds only the
allocator (gpushare.agent.caps). If the two disagreed, a job that stays inside its framework cap could still
be stopped by the backstop, which compares the process's whole device memory with the need.

Numbers (MiB), by compute capability:

* Measured on an NVIDIA H200 (sm 9.0; driver 580.159.04, CUDA 13.0, PyTorch 2.11.0+cu130, cuDNN 9.19;
  ``benchmarks/gpu_ground_truth.py measure``, docs/benchmarks.md *Ground truth on a real GPU*): NVML's
  per-process used memory minus ``torch.cuda.memory_reserved()`` is 610 MiB after CUDA initialisation and one
  tensor; the first GEMM adds 66 MiB, a GEMM on a second thread (autograd's backward thread gets its own
  cuBLAS handle) 64 MiB more, a convolution with batch norm 8 MiB. Over 37 real training workloads it is
  742 MiB (8 scripts, none convolutional) or 758-762 MiB (26, all convolutional ones among them), 630 MiB
  for convolutional models without a GEMM, 812 MiB with a second CUDA stream. So sm 9.0 has its own
  library row: 610 + 132 (cuBLAS, two handles) + 20 (cuDNN) gives 742 and 762 MiB, and 630 without cuBLAS.
  An H100 80GB HBM3 with the same software gave the same numbers to the byte.
* Other architectures are not measured here: their context figures come from PyTorch's own published reports
  (docs/estimator.md, *CUDA context*), growing with the SM count, and the library sizes are rough figures for
  what a training step loads. The accuracy benchmarks calibrate them.
"""

from __future__ import annotations

import re

from gpushare.gpus import MiB

# Compute capability per catalogue model (not part of the catalogue, which only describes memory and MIG).
SM_ARCH_BY_NAME: dict[str, tuple[int, int]] = {
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

# CUDA context with lazy module loading, by compute capability major.minor (see the module docstring).
_CONTEXT_MIB: dict[tuple[int, int], int] = {
    (7, 0): 310,
    (7, 5): 300,
    (8, 0): 420,
    (8, 6): 300,
    (8, 9): 426,
    (9, 0): 610,  # measured, H200
    (10, 0): 560,
}
_DEFAULT_CONTEXT_MIB = 450
# (cuBLAS + cuBLASLt kernels and handles, cuDNN kernels) a training step loads.
_LIB_MIB: dict[tuple[int, int], tuple[int, int]] = {
    (9, 0): (132, 20),  # measured, H200
}
_DEFAULT_LIB_MIB = (64, 128)


def sm_arch_of(name: str | None, marketing_name: str = "") -> tuple[int, int]:
    """Compute capability of a catalogue model by key, or of a site-added one by its NVML marketing name."""
    if name in SM_ARCH_BY_NAME:
        return SM_ARCH_BY_NAME[name]
    for pattern, arch in _SM_ARCH_BY_MARKETING:
        if pattern.search(marketing_name or name or ""):
            return arch
    return DEFAULT_SM_ARCH


def context_bytes_for(sm_arch: tuple[int, int], *, uses_cublas: bool = True, uses_cudnn: bool = True) -> int:
    """CUDA context plus the library kernels a training step loads lazily."""
    mib = _CONTEXT_MIB.get(sm_arch, _DEFAULT_CONTEXT_MIB)
    cublas, cudnn = _LIB_MIB.get(sm_arch, _DEFAULT_LIB_MIB)
    if uses_cublas:
        mib += cublas
    if uses_cudnn:
        mib += cudnn
    return mib * MiB
