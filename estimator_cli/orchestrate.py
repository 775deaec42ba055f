"""Turn a capture into the allocation sequence the GPU would see (xMem §3.3, docs/estimator.md).

Lifetimes: the capture runs the script's real Python, so parameters and buffers persist, optimizer state
exists from step 1 on, batches live for their iteration, and gradients live until the next ``zero_grad``
(freed there with ``set_to_none=True``, zeroed in place and kept with ``False``) — exactly as on the GPU,
because the same references hold them. :func:`check_lifetimes` verifies those rules on every capture
instead of rewriting timestamps as xMem has to for a CPU trace.

What the GPU adds that the capture cannot see, from the device model:
- cuBLAS workspaces, allocated *through the caching allocator* on a handle's first GEMM and kept:
  one for the thread running forward and one for the autograd engine's device thread that runs backward
  (``torch/csrc/autograd/engine.cpp`` runs CUDA backward on a per-device worker thread;
  ``aten/src/ATen/cuda/CublasHandlePool.cpp`` keys workspaces by (handle, stream) and handles are per thread).
- The cuBLASLt workspace (when not unified with the cuBLAS one, :mod:`gpushare.estimator_cli.device_model`):
  allocated right after the cuBLAS workspace on a thread's first ``addmm`` (the bias GEMM goes through
  cuBLASLt's ``gemm_and_bias``) and kept.
- cuDNN convolution workspaces: a temporary block right after each output of a convolution op, released
  at once (``Conv_v8.cpp``'s ``run_conv_plan`` allocates it through the caching allocator once the output
  exists). Its size comes from the convolution's geometry (:mod:`gpushare.estimator_cli.conv_workspace`); a
  convolution captured without geometry (not 2-D) keeps the older proportional guess,
  :data:`CUDNN_WORKSPACE_FRACTION` of the output, at most :data:`CUDNN_WORKSPACE_CAP`.
- The staging buffer and semaphores of a CUDA reduction split across thread blocks (the bias gradient's
  column sum): two temporary blocks right after the ``sum``/``mean`` output, released at once, sized for
  the target's SM count (:mod:`gpushare.estimator_cli.reduce_buffer`).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpushare.estimator_cli.conv_workspace import workspace_bytes
from gpushare.estimator_cli.events import Alloc, Capture, ConvGeometry, Kind, Phase
from gpushare.estimator_cli.reduce_buffer import staging_bytes

# Ops whose GPU kernels are cuBLAS GEMMs (their output allocation marks the first use of a handle).
LT_OPS = ("addmm", "_addmm_activation")  # a bias epilogue: at::cuda::blas::gemm_and_bias (cuBLASLt)
GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm", "linear", "matmul", "addmv", "mv")
CONV_OPS = ("convolution", "convolution_backward", "cudnn_convolution", "_convolution")
# Fallback for convolutions captured without geometry (not 2-D): a workspace of the order of the output
# tensor; assumed, calibrated by nothing, and capped.
CUDNN_WORKSPACE_FRACTION = 0.5
CUDNN_WORKSPACE_CAP = 1 << 30
WORKSPACE_KEY_BASE = -1_000_000  # keys below this are orchestrator-made blocks, never capture ids


@dataclass
class Orchestrated:
    """Replay input plus what the report needs to attribute each event."""

    events: list[tuple[str, int, int, int]]  # ("alloc", key, size, stream) / ("free", key, 0, stream)
    allocs: dict[int, Alloc]  # by key, including orchestrator-made blocks
    uses_cudnn: bool
    uses_cublas: bool


def _base_op(op: str) -> str:
    return op.split(".")[0]


def orchestrate(capture: Capture, cublas_workspace_bytes: int,
                reduce_target: tuple[int, int] | None = None, cublaslt_workspace_bytes: int = 0) -> Orchestrated:
    """The replay events of ``capture``; ``reduce_target`` = (SM count, max threads per SM) of the target
    GPU sizes the reductions' staging buffers (None: none added)."""
    allocs = dict(capture.allocs)
    events: list[tuple[str, int, int, int]] = []
    next_key = WORKSPACE_KEY_BASE
    gemm_threads: set[str] = set()
    lt_threads: set[str] = set()
    uses_cudnn = False
    uses_cublas = False

    def add_block(size: int, like: Alloc, name: str, keep: bool) -> None:
        nonlocal next_key
        key = next_key
        next_key -= 1
        allocs[key] = Alloc(key, size, name, like.phase, like.iteration, name, Kind.WORKSPACE.value)
        events.append(("alloc", key, size, 0))
        if not keep:
            pending_frees.append(key)

    for op, alloc_id in capture.events:
        pending_frees: list[int] = []
        if op == "free":
            events.append(("free", alloc_id, 0, 0))
            continue
        alloc = allocs[alloc_id]
        base = _base_op(alloc.op)
        thread = "backward" if alloc.phase == Phase.BACKWARD.value else "forward"
        is_gemm = base in GEMM_OPS or (capture.mode == "profile" and alloc.phase == Phase.FORWARD.value)
        if is_gemm and thread not in gemm_threads and cublas_workspace_bytes > 0:
            gemm_threads.add(thread)
            uses_cublas = True
            add_block(cublas_workspace_bytes, alloc, f"cuBLAS workspace ({thread} thread)", keep=True)
        if base in LT_OPS and thread not in lt_threads and cublaslt_workspace_bytes > 0:
            lt_threads.add(thread)
            add_block(cublaslt_workspace_bytes, alloc, f"cuBLASLt workspace ({thread} thread)", keep=True)
        events.append(("alloc", alloc_id, alloc.size, 0))
        if base in CONV_OPS:
            uses_cudnn = True
            size = _cudnn_workspace(alloc)
            if size > 0:
                add_block(size, alloc, "cuDNN workspace", keep=False)
        if alloc.reduce is not None and reduce_target is not None:
            buffer, semaphores = staging_bytes(alloc.reduce, *reduce_target)
            if buffer > 0:
                add_block(buffer, alloc, "reduction staging buffer", keep=False)
                add_block(semaphores, alloc, "reduction semaphores", keep=False)
                pending_frees.reverse()  # PyTorch frees the semaphores first (reverse declaration order)
        events.extend(("free", key, 0, 0) for key in pending_frees)
    return Orchestrated(events, allocs, uses_cudnn, uses_cublas)


def _cudnn_workspace(alloc: Alloc) -> int:
    """Workspace of the cuDNN call that produced ``alloc`` (a convolution output or gradient)."""
    if alloc.conv is not None:
        return workspace_bytes(ConvGeometry.from_list(alloc.conv))
    return min(int(alloc.size * CUDNN_WORKSPACE_FRACTION), CUDNN_WORKSPACE_CAP)


def check_lifetimes(capture: Capture) -> list[str]:
    """Problems with the captured lifetimes (empty when the GPU rules hold); for tests and --verbose."""
    problems = []
    freed_at: dict[int, int] = {i: n for n, (op, i) in enumerate(capture.events) if op == "free"}
    for alloc in capture.allocs.values():
        if alloc.kind in (Kind.PARAMETER.value, Kind.BUFFER.value, Kind.OPTIMIZER_STATE.value):
            if alloc.id in freed_at and capture.stopped:
                problems.append(f"{alloc.kind} block {alloc.id} ({alloc.module}) freed before the stop")
    zero_events = sorted(z["event"] for z in capture.zero_grads if z.get("set_to_none", True))
    born_at: dict[int, int] = {i: n for n, (op, i) in enumerate(capture.events) if op == "alloc"}
    for alloc in capture.allocs.values():
        if alloc.kind != Kind.GRADIENT.value or alloc.id not in freed_at:
            continue
        born = born_at[alloc.id]
        later_zero = [z for z in zero_events if z > born]
        if later_zero and freed_at[alloc.id] < later_zero[0] and alloc.phase != Phase.OPTIMIZER.value:
            problems.append(f"gradient block {alloc.id} ({alloc.module}) freed before the next zero_grad")
    return problems
