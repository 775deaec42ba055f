"""Gradient accumulation (docs/estimator.md, "Gradient accumulation"): once a micro-step after the first
optimizer step repeats the one before it, the capture stops there, and the estimate is the one the whole
run gives."""

from __future__ import annotations

import pytest
from estimator_run import estimate

from gpushare.estimator_cli.cli import EXIT_OK

pytestmark = pytest.mark.torch

# An MLP trained with AdamW and gradient accumulation ACCUM (argv[1]); the batch of micro-step k has
# BATCHES[k % len(BATCHES)] rows (argv[2], comma-separated), so a list of one size repeats exactly.
ACCUMULATING = """
    import sys, torch, torch.nn as nn
    accum, batches = int(sys.argv[1]), [int(b) for b in sys.argv[2].split(",")]
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(),
                          nn.Linear(2048, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for micro in range(1000):
        rows = batches[micro % len(batches)]
        x, y = torch.randn(rows, 512).cuda(), torch.randint(0, 10, (rows,)).cuda()
        loss = nn.functional.cross_entropy(model(x), y) / accum
        loss.backward()
        if (micro + 1) % accum == 0:
            opt.step()
            opt.zero_grad()
"""


def _run(capsys, tmp_path, accum: int, batches: str) -> dict:
    code, doc, err = estimate(capsys, tmp_path, ACCUMULATING, "--mode", "fake", script_args=(str(accum), batches))
    assert code == EXIT_OK, err
    assert doc is not None
    return doc


def _peaks(doc: dict) -> tuple[int, int, int, int]:
    t = doc["targets"][0]
    return t["peak_allocated_bytes"], t["peak_reserved_bytes"], t["peak_total_bytes"], t["persistent_bytes"]


def test_an_accumulating_job_stops_at_its_first_repeated_micro_step_after_step_one(capsys, tmp_path):
    """16 micro-steps per step: the first window (16), then the second one's first three, the third repeating
    the second; the estimate equals that of accumulation 2, whose capture runs all three steps (6 passes)
    and has the same memory pattern: the same allocated, reserved and total peaks."""
    long = _run(capsys, tmp_path, 16, "256")
    assert long["micro_steps"] == 19 and long.get("stopped_on_repeat") and long["iterations"] == 1
    short = _run(capsys, tmp_path, 2, "256")
    assert short["micro_steps"] == 6 and not short.get("stopped_on_repeat") and short["iterations"] == 3
    assert _peaks(long)[:3] == _peaks(short)[:3]
    # one steady-state boundary instead of three: what stays between iterations can only be judged larger
    assert _peaks(long)[3] >= _peaks(short)[3]


def test_micro_steps_that_differ_run_to_the_requested_steps(capsys, tmp_path):
    """Batches of changing size never repeat: all 3 × 4 micro-steps are seen, and the largest batch, which
    comes last in each window, sets the peak."""
    varying = _run(capsys, tmp_path, 4, "64,128,192,256")
    assert varying["micro_steps"] == 12 and not varying.get("stopped_on_repeat") and varying["iterations"] == 3
    assert _peaks(varying)[0] >= _peaks(_run(capsys, tmp_path, 4, "256"))[0]


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
