"""Gradient accumulation (docs/estimator.md, "Gradient accumulation"): once a micro-step after the first
optimizer step repeats the one before it, the capture stops there, and the estimate is the one the whole
run gives."""

from __future__ import annotations

import pytest
from estimator_run import estimate

from gpushare.estimator_cli.cli import EXIT_OK

pytestmark = pytest.mark.torch

# An MLP trained with AdamW and gradient accumulation ACCUM (argv[1]); the batch of micro-step k has
# BATCHES[k % len(BATCHES)] rows (argv[2], comma-separated), so a list of one size repeats exactly. With
# argv[3] = "grow" micro-step k has k more rows; with "vary" it first makes and drops a (k + 1)-element block,
# which keeps any two micro-steps from matching without moving the peak; with "once" the second micro-step
# makes a scalar it keeps (the Trainer's loss accumulator), so window 1 rose a few bytes further than any later.
ACCUMULATING = """
    import sys, torch, torch.nn as nn
    accum, batches = int(sys.argv[1]), [int(b) for b in sys.argv[2].split(",")]
    how = sys.argv[3] if len(sys.argv) > 3 else ""
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(),
                          nn.Linear(2048, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for micro in range(1000):
        rows = batches[micro % len(batches)] + (micro if how == "grow" else 0)
        if how == "vary":
            torch.empty(micro + 1, device="cuda")
        if how == "once" and micro == 1:
            kept = torch.zeros((), device="cuda")
        x, y = torch.randn(rows, 512).cuda(), torch.randint(0, 10, (rows,)).cuda()
        loss = nn.functional.cross_entropy(model(x), y) / accum
        loss.backward()
        if (micro + 1) % accum == 0:
            opt.step()
            opt.zero_grad()
"""


def _run(capsys, tmp_path, accum: int, batches: str, how: str = "") -> dict:
    code, doc, err = estimate(capsys, tmp_path, ACCUMULATING, "--mode", "fake",
                              script_args=(str(accum), batches) + ((how,) if how else ()))
    assert code == EXIT_OK, err
    assert doc is not None
    return doc


def _peaks(doc: dict) -> tuple[int, int, int, int]:
    t = doc["targets"][0]
    return t["peak_allocated_bytes"], t["peak_reserved_bytes"], t["peak_total_bytes"], t["persistent_bytes"]


def test_an_accumulating_job_stops_at_its_first_repeated_micro_step_after_step_one(capsys, tmp_path):
    """16 micro-steps per step: the first window (16), then the second one's first three, the third repeating
    the second; the estimate equals that of the same job whose micro-steps never match (all 48 run): the
    same allocated, reserved and total peaks."""
    long = _run(capsys, tmp_path, 16, "256")
    assert long["micro_steps"] == 19 and long.get("stopped_on_repeat") and long["iterations"] == 1
    whole = _run(capsys, tmp_path, 16, "256", "vary")
    assert whole["micro_steps"] == 48 and not whole.get("stopped_on_repeat") and whole["iterations"] == 3
    assert _peaks(long)[:3] == _peaks(whole)[:3]
    # one steady-state boundary instead of three: what stays between iterations can only be judged larger
    assert _peaks(long)[3] >= _peaks(whole)[3]


def test_a_scalar_made_once_in_the_first_window_does_not_keep_the_capture_from_stopping(capsys, tmp_path):
    """Window 1 rose one scalar further than the micro-steps after step 1 ever will: less than a small-pool
    segment short counts as as far, so the capture still stops at the repeat; its peak is the plain job's and
    the scalar's block."""
    once = _run(capsys, tmp_path, 16, "256", "once")
    assert once["micro_steps"] == 19 and once.get("stopped_on_repeat")
    plain = _peaks(_run(capsys, tmp_path, 16, "256"))
    assert _peaks(once)[0] == plain[0] + 512 and _peaks(once)[1:3] == plain[1:3]


def test_a_kind_of_micro_step_seen_before_step_one_is_seen_again_with_the_state_alive(capsys, tmp_path):
    """Accumulation 8, the eighth batch of each window twice as large: the second window's small micro-steps
    repeat at once, but the capture goes on until the large one has run with the optimizer state alive, so
    the allocated peak is that of a job whose every batch is large."""
    mixed = _run(capsys, tmp_path, 8, "256,256,256,256,256,256,256,512")
    assert mixed.get("stopped_on_repeat") and mixed["micro_steps"] > 16
    assert _peaks(mixed)[0] == _peaks(_run(capsys, tmp_path, 8, "512"))[0]


def test_micro_steps_that_differ_run_to_the_requested_steps(capsys, tmp_path):
    """A batch one row larger each micro-step never repeats: all 3 × 4 micro-steps are seen."""
    growing = _run(capsys, tmp_path, 4, "256", "grow")
    assert growing["micro_steps"] == 12 and not growing.get("stopped_on_repeat") and growing["iterations"] == 3


def test_micro_steps_that_free_the_same_blocks_in_another_order_repeat():
    """Frees with no allocation between them are compared as a set: their order, which follows the order in
    which Python drops references, changes neither the live memory nor the allocator's free blocks."""
    from gpushare.estimator_cli.events import Alloc, Phase
    from gpushare.estimator_cli.fake_capture import FakeRecorder

    recorder = FakeRecorder(lambda: (Phase.OTHER, 0, ""))
    sizes = {0: 512, 1: 1024, 2: 2048, 3: 512, 4: 1024, 5: 2048}
    recorder.allocs = {i: Alloc(i, size, "m", "forward", 0, "mm.default") for i, size in sizes.items()}
    first = [("alloc", 0), ("alloc", 1), ("alloc", 2), ("free", 1), ("free", 0), ("free", 2)]
    second = [("alloc", 3), ("alloc", 4), ("alloc", 5), ("free", 5), ("free", 3), ("free", 4)]
    recorder.events = first + second
    assert recorder.segment_fingerprint(6) == _fingerprint_of(recorder, first)
    recorder.events = first + [("alloc", 3), ("alloc", 4), ("free", 3), ("alloc", 5), ("free", 4), ("free", 5)]
    assert recorder.segment_fingerprint(6) != _fingerprint_of(recorder, first)  # a free moved past an allocation


def _fingerprint_of(recorder, events) -> tuple:
    saved = recorder.events
    recorder.events = list(events)
    try:
        return recorder.segment_fingerprint(0)
    finally:
        recorder.events = saved
