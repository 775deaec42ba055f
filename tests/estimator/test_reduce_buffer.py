"""CUDA reductions' staging buffers (estimator_cli/reduce_buffer.py): captured from real PyTorch ops on
the CPU, sized for the target GPU, and placed in the replay the way ``gpu_reduce_kernel`` allocates them.

The expected sizes are the ones PyTorch 2.11 allocated on an H200 (132 SMs, 2048 threads per SM) for
``examples/amp_train.py`` (docs/benchmarks.md, "What the allocator model misses on Hopper"): a 64 MiB
buffer and 32 bytes of semaphores for each 1024-wide bias gradient at batch 8192, and 1,638,400 bytes
and 8 bytes for the 100-wide one.
"""

from __future__ import annotations

import torch

from gpushare.estimator_cli.events import Alloc, Capture, Phase
from gpushare.estimator_cli.fake_capture import FakeRecorder
from gpushare.estimator_cli.orchestrate import orchestrate
from gpushare.estimator_cli.reduce_buffer import geometry_of, max_threads_per_sm, staging_bytes

H200 = (132, max_threads_per_sm((9, 0)))
A100 = (108, max_threads_per_sm((8, 0)))
MiB = 1 << 20


def _linear_step(dtype: torch.dtype, batch: int, width: int = 1024, backward: bool = True) -> Capture:
    """One Linear-with-bias step on ``meta`` (fake mode's GPU) under the recorder, in ``dtype``."""
    phase = [Phase.FORWARD]
    recorder = FakeRecorder(lambda: (phase[0], 0, "fc"))
    layer = torch.nn.Linear(1024, width, device="meta", dtype=dtype)
    x = torch.empty(batch, 1024, device="meta", dtype=dtype)
    with recorder:
        out = layer(x)
        if backward:
            phase[0] = Phase.BACKWARD
            out.backward(torch.empty_like(out))  # a dense gradient, as a loss's backward hands a Linear
    recorder.finish()
    return Capture(mode="fake", steps=1, stopped=True, events=recorder.events, allocs=recorder.allocs)


def _staging(cap: Capture, target: tuple[int, int] | None = H200) -> list[tuple[str, int]]:
    orch = orchestrate(cap, 0, reduce_target=target)
    return [(op, orch.allocs[key].size) for op, key, _size, _s in orch.events
            if key in orch.allocs and orch.allocs[key].op.startswith("reduction")]


def test_bias_gradient_of_a_half_precision_linear_gets_the_measured_buffer_on_sm90() -> None:
    cap = _linear_step(torch.float16, 8192)
    assert _staging(cap) == [("alloc", 64 * MiB), ("alloc", 32), ("free", 32), ("free", 64 * MiB)]
    orch = orchestrate(cap, 0, reduce_target=H200)
    ops = [orch.allocs[key].op for op, key, _size, _s in orch.events if op == "alloc"]
    at = ops.index("reduction staging buffer")
    assert ops[at - 1].startswith("sum") and ops[at + 1] == "reduction semaphores"  # right after the bias grad
    assert Capture.from_json(cap.to_json()).allocs == cap.allocs  # the geometry travels in the capture JSON


def test_float32_gets_the_same_buffer_because_the_accumulator_is_float_either_way() -> None:
    assert _staging(_linear_step(torch.float32, 8192)) == _staging(_linear_step(torch.float16, 8192))


def test_forward_only_addmm_and_short_batches_get_none() -> None:
    assert _staging(_linear_step(torch.float16, 8192, backward=False)) == []  # no per-call block for addmm
    assert _staging(_linear_step(torch.float16, 64)) == []  # 64 rows: reduced inside one thread block
    assert _staging(_linear_step(torch.float16, 8192), target=None) == []


def test_sizes_follow_the_h200_trace_and_the_target() -> None:
    narrow = geometry_of("sum.dim_IntList", (torch.empty(8192, 100, dtype=torch.float16, device="meta"), [0], True))
    assert narrow is not None and staging_bytes(narrow, *H200) == (1_638_400, 8)
    wide = geometry_of("sum.dim_IntList", (torch.empty(8192, 16384, device="meta"), [0], True))
    assert wide is not None
    # 128 output blocks: the grid fills the GPU, so ctas_per_output follows the SM count
    assert staging_bytes(wide, *H200) == (4 * 16384 * 17 * 32 * 4, 4 * 128)
    assert staging_bytes(wide, *A100) == (4 * 16384 * 14 * 32 * 4, 4 * 128)
    row = geometry_of("sum.dim_IntList", (torch.empty(8192, 1024, device="meta"), [1], False))
    assert row is not None and staging_bytes(row, *H200) == (0, 0)  # one output per warp row
    full = geometry_of("mean.default", (torch.empty(8192, 1024, device="meta"),))
    assert full is not None and staging_bytes(full, *H200)[0] < 4096  # a scalar: a few bytes per block
    assert geometry_of("relu.default", (torch.empty(4, device="meta"),)) is None
    assert geometry_of("sum.dim_DimnameList", (torch.empty(4, 4, device="meta"), ["n"])) is None
    assert geometry_of("sum.dim_IntList", (torch.empty(2, 3, 8192, 1024, device="meta"), [0, 1, 2], True)) == \
        geometry_of("sum.dim_IntList", (torch.empty(6 * 8192, 1024, device="meta"), [0], True))  # coalesced


def test_an_older_capture_without_reduce_geometry_still_loads() -> None:
    row = [0, 100, "m", "forward", 0, "sum.dim_IntList", "activation"]
    cap = Capture.from_json({"version": 1, "mode": "fake", "steps": 1, "stopped": True,
                             "events": [["alloc", 0]], "allocs": [row]})
    assert cap.allocs[0] == Alloc(0, 100, "m", "forward", 0, "sum.dim_IntList", "activation")
    assert _staging(cap) == []


def test_cublaslt_workspace_follows_the_first_bias_gemm_of_a_thread_and_is_kept() -> None:
    """H200, PyTorch 2.11: a never-freed 1 MiB block right after the forward thread's 32 MiB cuBLAS
    workspace, and none for the backward thread, whose GEMMs are plain ``mm``."""
    orch = orchestrate(_linear_step(torch.float16, 64), 32 * MiB, cublaslt_workspace_bytes=MiB)
    made = [orch.allocs[key].op for op, key, _size, _s in orch.events if op == "alloc" and key < 0]
    assert made == ["cuBLAS workspace (forward thread)", "cuBLASLt workspace (forward thread)",
                    "cuBLAS workspace (backward thread)"]
    freed = {key for op, key, _size, _s in orch.events if op == "free"}
    assert not any(key in freed for key, a in orch.allocs.items() if a.op.startswith("cuBLAS"))
    assert [a.op for a in orchestrate(_linear_step(torch.float16, 64), 32 * MiB).allocs.values()
            if a.op.startswith("cuBLASLt")] == []
