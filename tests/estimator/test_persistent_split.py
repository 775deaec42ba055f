"""The persistent/ephemeral split on synthetic allocation traces with known answers, and its schema checks."""

from __future__ import annotations

from gpushare.estimator_cli.allocator import AllocatorConfig, replay
from gpushare.estimator_cli.events import Alloc, Capture
from gpushare.estimator_cli.orchestrate import orchestrate
from gpushare.estimator_cli.persistent import MemorySplit, iteration_boundaries, persistent_keys, split_peak
from gpushare.estimator_cli.report import render_text
from gpushare.estimate.schema import validate
from gpushare.gpus import MiB

CAPACITY = 80 << 30


class Trace:
    """Builds a capture event by event: ``alloc`` names a block and its iteration, ``free`` drops it."""

    def __init__(self) -> None:
        self.allocs: dict[int, Alloc] = {}
        self.events: list[tuple[str, int]] = []
        self.ids: dict[str, int] = {}

    def alloc(self, name: str, size: int, iteration: int, kind: str = "activation") -> None:
        self.ids[name] = len(self.ids)
        self.allocs[self.ids[name]] = Alloc(self.ids[name], size, "", "forward", iteration, "empty", kind)
        self.events.append(("alloc", self.ids[name]))

    def free(self, name: str) -> None:
        self.events.append(("free", self.ids[name]))

    def capture(self, steps: int) -> Capture:
        return Capture(mode="fake", steps=steps, stopped=True, events=self.events, allocs=self.allocs)


def _training(steps: int, grads_kept: bool = False) -> Trace:
    """Parameters and optimizer state live throughout; batch, activations and gradients per iteration
    (gradients zeroed in place and kept with ``grads_kept``, as ``zero_grad(set_to_none=False)`` does)."""
    t = Trace()
    t.alloc("param", 32 * MiB, 0, "parameter")
    for it in range(steps):
        t.alloc(f"batch{it}", 12 * MiB, it, "data")
        if it:
            t.free(f"batch{it - 1}")  # the loop variable is rebound after the next batch exists
            if not grads_kept:
                t.free(f"grad{it - 1}")  # zero_grad(set_to_none=True) at the top of the loop
        t.alloc(f"act{it}", 40 * MiB, it)
        if not (grads_kept and it):
            t.alloc(f"grad{it}", 32 * MiB, it, "gradient")
        t.free(f"act{it}")
        if it == 0:
            t.alloc("state", 64 * MiB, 0, "optimizer_state")  # created in step 1, kept
    return t


def _split(trace: Trace, steps: int) -> tuple[MemorySplit, int]:
    orch = orchestrate(trace.capture(steps), cublas_workspace_bytes=0)
    result = replay(orch.events, CAPACITY)
    split = split_peak(orch, steps, (result.peak_allocated_bytes, result.peak_reserved_bytes), CAPACITY,
                       AllocatorConfig(), 0, result.oom)
    return split, result.peak_reserved_bytes


def test_boundaries_sit_after_each_step_and_the_frees_before_the_next_iteration():
    trace = _training(3)
    orch = orchestrate(trace.capture(3), cublas_workspace_bytes=0)
    boundaries = iteration_boundaries(orch, 3)
    assert boundaries[-1] == len(orch.events) - 1  # the capture stops at the last step
    names = {v: k for k, v in trace.ids.items()}
    live = [{names[k] for k in persistent_keys(orch, [b])} for b in boundaries]
    assert live == [{"param", "state", "batch0", "grad0"}, {"param", "state", "batch1", "grad1"},
                    {"param", "state", "batch2", "grad2"}]
    assert {names[k] for k in persistent_keys(orch, boundaries)} == {"param", "state"}


def test_persistent_is_parameters_and_state_and_the_two_parts_add_up_to_the_peak():
    split, peak = _split(_training(3), 3)
    assert split.persistent_allocated_bytes == split.persistent_bytes == 96 * MiB  # own segments, no slack
    assert split.persistent_bytes + split.ephemeral_bytes == peak
    assert split.ephemeral_bytes >= (12 + 40 + 32) * MiB  # one iteration's batch, activations and grads


def test_gradients_kept_across_iterations_are_persistent():
    split, peak = _split(_training(3, grads_kept=True), 3)
    assert split.persistent_bytes == (32 + 64 + 32) * MiB
    assert split.persistent_bytes + split.ephemeral_bytes == peak


def test_a_small_persistent_block_keeps_its_whole_segment():
    """The reserved counterpart: a 512-byte block alive between iterations pins its 2 MiB small segment,
    which the iterations' own small blocks shared with it."""
    t = Trace()
    t.alloc("bias", 512, 0, "parameter")
    for it in range(2):
        t.alloc(f"tmp{it}", 64 * 1024, it)
        t.free(f"tmp{it}")
    split, peak = _split(t, 2)
    assert (split.persistent_allocated_bytes, split.persistent_bytes, split.ephemeral_bytes) == (512, 2 * MiB, 0)
    assert peak == 2 * MiB


def test_no_iteration_boundary_counts_the_whole_peak_as_persistent():
    t = Trace()
    t.alloc("param", 32 * MiB, 0, "parameter")
    t.alloc("act", 40 * MiB, 0)
    t.free("act")
    split, peak = _split(t, 0)
    assert (split.persistent_bytes, split.ephemeral_bytes) == (peak, 0) and peak == 72 * MiB


def test_an_out_of_memory_target_still_splits_its_peak():
    trace = _training(3)
    orch = orchestrate(trace.capture(3), cublas_workspace_bytes=0)
    small = 150 * MiB
    result = replay(orch.events, small)
    assert result.oom
    split = split_peak(orch, 3, (result.peak_allocated_bytes, result.peak_reserved_bytes), small,
                       AllocatorConfig(), 0, result.oom)
    assert split.persistent_bytes + split.ephemeral_bytes == result.peak_reserved_bytes


# -- the document -------------------------------------------------------------------------------------
def _doc(**target_over):
    target = {"gpu": "a100-80gb", "capacity_bytes": 80 << 30, "peak_allocated_bytes": 90 * MiB,
              "peak_reserved_bytes": 100 * MiB, "context_bytes": 3, "other_driver_bytes": 0,
              "peak_total_bytes": 100 * MiB + 3, "fits": True, "oom": False, "share_of_gpu": 0.0,
              "recommendation": {"kind": "shared", "request": "shard:1", "margin_bytes": 1 << 30,
                                 "mig_profile": None},
              "top_modules": [], "by_phase": [], "by_kind": []}
    target.update(target_over)
    return {"schema_version": 1, "tool_version": "0", "script": "t.py", "args": [], "mode": "fake",
            "requested_mode": "auto", "fallback_reason": None, "iterations": 3, "requested_iterations": 3,
            "stopped": True, "item_placeholders": 0, "value_reads": {}, "elapsed_s": 1.0,
            "capture_process": "cold", "dependencies": [], "cached": False, "torch_version": "x",
            "cache_key": "k", "allocator_config": "", "targets": [target]}


def test_documents_without_the_split_still_validate_and_render():
    doc = _doc()
    assert validate(doc) == []
    assert "persistent" not in render_text(doc)


def test_the_split_must_add_up_to_the_reserved_peak():
    good = {"persistent_bytes": 60 * MiB, "ephemeral_bytes": 40 * MiB, "persistent_allocated_bytes": 58 * MiB}
    assert validate(_doc(**good)) == []
    assert "persistent 60 MiB (kept between iterations) + ephemeral 40 MiB" in render_text(_doc(**good))
    assert any("persistent + ephemeral" in p for p in validate(_doc(**dict(good, ephemeral_bytes=1))))
    assert any("allocated above" in p for p in validate(_doc(**dict(good, persistent_allocated_bytes=61 * MiB))))
    assert any("missing 'ephemeral_bytes'" in p for p in validate(_doc(persistent_bytes=100 * MiB)))
    assert any("non-negative" in p for p in validate(_doc(**dict(good, persistent_bytes=-1))))
