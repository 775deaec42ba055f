"""The staging buffer of PyTorch's CUDA reduction kernel: when a ``sum``/``mean`` allocates one, and its size.

Why: a reduction over a long dimension with few outputs (the bias gradient of a ``Linear``: a column sum
of the ``[batch, features]`` output gradient) is split across thread blocks, which combine their partial
results through global memory. PyTorch allocates that memory **through the caching allocator** for each
call and frees it when the call returns (``aten/src/ATen/native/cuda/Reduce.cuh``, ``gpu_reduce_kernel``:
``buffer = allocator.allocate(config.global_memory_size())`` then ``semaphores =
allocator.allocate(config.semaphore_size())``). The buffer is large: ``ReduceConfig::global_memory_size``
is ``sizeof(acc) × num_outputs × ctas_per_output``, times ``block.x × output_vec_size`` when the reduced
dimension is not the fastest-moving one, so a ``[8192, 1024]`` column sum on an H200 stages 64 MiB for a
2 KiB result. Measured on an H200 (PyTorch 2.11, ``benchmarks/results/gpu_ground_truth_h200_history.json``):
``amp_train.py`` allocated a 64 MiB block and a 32-byte block right after each 1024-wide bias gradient and
freed both at once, 7 per step, exactly as this module computes (``grid.x`` = 8 blocks of semaphores).

How big it is depends on the target GPU (``setReduceConfig`` sizes the grid from the device's
``multiProcessorCount`` and ``maxThreadsPerMultiProcessor``), so the capture records only the
device-independent part of the decision (:func:`geometry_of`, from the tensor iterator's view of the
input) and the orchestrator finishes it for the target (:func:`staging_bytes`). The element type enters
only through the accumulator size (4 bytes for float16, bfloat16 and float32 sums alike) and through the
vector width the input's alignment allows.

Covered: ``aten.sum`` and ``aten.mean`` (the reductions behind bias gradients, ``sum_to_size`` in
autograd, and loss means). Not covered: the other ``gpu_reduce_kernel`` users (``var``/``std``, ``norm``,
``amax``, ``argmax``...), and the iterator split of inputs over 2³¹ elements.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

from gpushare.gpus import MAX_THREADS_PER_SM, max_threads_per_sm

if TYPE_CHECKING:  # torch only where a capture runs: staging_bytes is the orchestrator's (a torch-free parent)
    import torch

REDUCE_OPS = ("sum", "mean")
MAX_NUM_THREADS = 512  # mnt_wrapper<T>::MAX_NUM_THREADS; 256 for complex<double>
WARP_SIZE = 32
VT0 = 4  # gpu_reduce_kernel's default vt0 and input_vec_size
MIN_VALUES_PER_THREAD = 16
MAX_VALUES_PER_THREAD = 256
# maxThreadsPerMultiProcessor is a figure of the GPU model: gpushare.gpus (torch-free, like this module's top).
__all__ = ["MAX_THREADS_PER_SM", "geometry_of", "max_threads_per_sm", "staging_bytes"]


def _acc_size(dtype: torch.dtype) -> int:
    """sizeof(acc_t) of the sum/mean kernels: float for half, bfloat16 and float; 8 bytes for
    double, integers (int64 accumulation) and complex64; 16 for complex128."""
    import torch

    if dtype == torch.complex128:
        return 16
    if dtype in (torch.float64, torch.complex64) or not (dtype.is_floating_point or dtype.is_complex):
        return 8
    return 4


def _reduced_dims(func_name: str, args: Sequence[Any], ndim: int) -> set[int] | None:
    """The dimensions a sum/mean call reduces (all of them for the no-``dim`` overloads)."""
    dim = args[1] if len(args) > 1 and not func_name.endswith(".default") else None
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return set(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not all(isinstance(d, int) for d in dims):
        return None
    return {d % ndim for d in dims} if ndim else set()


def geometry_of(func_name: str, args: Sequence[Any]) -> list[int] | None:
    """The device-independent part of ``setReduceConfig`` for a sum/mean call, or None.

    Returns ``[num_outputs, inputs_per_output, on_fastest, dim0, dim1, output_vec_size, acc_size, mnt]``
    as the CUDA ``TensorIterator`` would present the input: size-1 dimensions dropped, reduced dimensions
    first (``reorder_dimensions`` moves the output's zero-stride dimensions to the front), each group
    ordered fastest-moving first, neighbours that are contiguous in memory coalesced.
    """
    import torch

    if func_name.split(".")[0] not in REDUCE_OPS or not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    if x.layout != torch.strided:
        return None
    shape, strides, offset = list(x.shape), list(x.stride()), x.storage_offset()
    if not all(type(v) is int for v in (*shape, *strides, offset)):
        return None  # symbolic sizes (a compiled region's fake tensors): no guess, and no guards added
    if math.prod(shape) <= 1:
        return None
    reduced = _reduced_dims(func_name, args, len(shape))
    if reduced is None:
        return None
    dims = [(shape[d], strides[d], d in reduced) for d in range(len(shape)) if shape[d] != 1]
    dims.sort(key=lambda s: (not s[2], s[1], s[0]))
    merged: list[list[Any]] = []
    for size, stride, red in dims:
        if merged and merged[-1][2] == red and merged[-1][0] * merged[-1][1] == stride:
            merged[-1][0] *= size
        else:
            merged.append([size, stride, red])
    nrd = sum(1 for m in merged if m[2])
    if nrd == 0:
        return None
    num_outputs = math.prod(m[0] for m in merged if not m[2])
    inputs = math.prod(m[0] for m in merged if m[2])
    on_fastest = nrd == len(merged) or merged[0][1] < merged[nrd][1]
    if on_fastest:
        dim0, dim1, fastest = inputs, num_outputs, merged[0][1]
    else:
        dim0, dim1, fastest = num_outputs, inputs, merged[nrd][1]
    out_vec = 1
    if fastest == 1:
        if on_fastest and dim0 > 128 and nrd == 1:
            dim0 //= VT0  # "vectorize along input"
        elif not on_fastest:  # "vectorize along output": get_output_vec_size
            out_vec = 4
            checks = [offset, merged[nrd][0]] + [m[1] for i, m in enumerate(merged) if i != nrd]
            for n in checks:
                while n % out_vec:
                    out_vec //= 2
            dim0 //= out_vec
    mnt = MAX_NUM_THREADS // 2 if x.dtype == torch.complex128 else MAX_NUM_THREADS
    return [num_outputs, inputs, int(on_fastest), dim0, dim1, out_vec, _acc_size(x.dtype), mnt]


def _last_pow2(n: int) -> int:
    """floor to a power of two, at least 1 (Reduce.cuh's ``last_pow2``)."""
    return max(1, 1 << (n.bit_length() - 1)) if n > 0 else 1


def staging_bytes(geometry: Sequence[int], sm_count: int, threads_per_sm: int) -> tuple[int, int]:
    """(global buffer, semaphores) in bytes that the reduction allocates on a GPU with ``sm_count`` SMs;
    (0, 0) when it reduces within thread blocks. ``setReduceConfig`` followed step by step."""
    num_outputs, inputs, on_fastest, dim0, dim1, out_vec, acc, mnt = geometry
    max_threads = mnt // out_vec
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(dim0_pow2, WARP_SIZE)
    height = min(dim1_pow2, max_threads // width)
    width = min(dim0_pow2, max_threads // height)
    step_input = step_output = 1
    if on_fastest:
        step_input *= width  # input_mult[BLOCK_X]: block_x_reduce
    else:
        step_output *= width
    values_per_thread = -(-inputs // step_input)
    if values_per_thread < min(height * 16, MAX_VALUES_PER_THREAD):
        return 0, 0  # each warp handles its own outputs: no split across warps, hence none across blocks
    step_input *= height
    values_per_thread = -(-inputs // step_input)
    target_grid = sm_count * (threads_per_sm // (width * height))
    grid_x = max(1, -(-(num_outputs // out_vec) // step_output))
    if values_per_thread < MAX_VALUES_PER_THREAD or grid_x > target_grid:
        return 0, 0
    ctas = max(min(-(-target_grid // grid_x), -(-values_per_thread // MIN_VALUES_PER_THREAD)),
               -(-values_per_thread // MAX_VALUES_PER_THREAD))
    if ctas <= 1:
        return 0, 0
    size = acc * num_outputs * ctas
    if not on_fastest:
        size *= width * out_vec
    return size, 4 * grid_x
