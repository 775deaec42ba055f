"""What a PyTorch process holds on a GPU outside its caching allocator: the CUDA context and library kernels.

Why in the core: two parts need the same number. The estimator adds it to the replayed allocator peak to
predict what ``nvidia-smi`` shows (gpushare.estimator_cli.device_model); the node agent subtracts it from a
job's need before turning the need into PyTorch's ``per_process_memory_fraction``, which bounds only the
allocator (gpushare.node.caps). If the two disagreed, a job that stays inside its framework cap could still
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

from gpushare.gpus import DEFAULT_SM_ARCH, MiB, sm_arch_of

# The compute capability is a figure of the GPU model (gpushare.gpus); ``sm_arch_of`` and ``DEFAULT_SM_ARCH``
# are re-exported for the node's callers that hold only NVML's names.
__all__ = ["DEFAULT_SM_ARCH", "context_bytes_for", "sm_arch_of"]

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


def context_bytes_for(sm_arch: tuple[int, int], *, uses_cublas: bool = True, uses_cudnn: bool = True) -> int:
    """CUDA context plus the library kernels a training step loads lazily."""
    mib = _CONTEXT_MIB.get(sm_arch, _DEFAULT_CONTEXT_MIB)
    cublas, cudnn = _LIB_MIB.get(sm_arch, _DEFAULT_LIB_MIB)
    if uses_cublas:
        mib += cublas
    if uses_cudnn:
        mib += cudnn
    return mib * MiB
