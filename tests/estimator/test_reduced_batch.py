"""Reduced-batch fallback of profile mode (estimator_cli/reduced_batch.py): the batch knob, the fit, the
schema fields, and end-to-end runs where the full batch does not fit ``--max-cpu-memory``."""

from __future__ import annotations

import argparse
import json
import textwrap

import pytest

from gpushare.estimator_cli.cli import EXIT_LIMIT, EXIT_OK, main
from gpushare.estimator_cli.reduced_batch import BatchKnob, fit, schedule, uncertainty
from gpushare.estimator_cli.report import render_text
from gpushare.estimate.schema import validate
from gpushare.gpus import MiB


def _parse(knob: BatchKnob, parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    ns = parser.parse_args(argv)
    knob.after_parse(parser, ns)
    return ns


def test_argparse_batch_is_divided_whether_given_or_default():
    knob = BatchKnob(4)
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    assert _parse(knob, parser, []).batch_size == 16
    assert knob.to_json() == {"knob": "argument --batch-size", "full": 64, "used": 16, "divisor": 4}
    knob = BatchKnob(2)
    ns = _parse(knob, parser, ["--batch-size", "7"])
    assert ns.batch_size == 3 and ns.lr == 0.1 and knob.full == 7


@pytest.mark.parametrize("spelling", ["--batch_size", "-b", "--per_device_train_batch_size", "--micro-batch-size"])
def test_other_batch_spellings(spelling):
    knob = BatchKnob(2)
    parser = argparse.ArgumentParser()
    parser.add_argument(spelling, type=int, default=10)
    ns = _parse(knob, parser, [])
    assert vars(ns)[parser._actions[-1].dest] == 5 and knob.knob == f"argument {spelling}"


def test_a_namespace_is_reduced_once_and_non_batch_arguments_never():
    knob = BatchKnob(2)
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("-b", "--beta", type=float, default=0.5)  # -b, but not an int: not a batch
    ns = _parse(knob, parser, [])
    knob.after_parse(parser, ns)  # a parent parser seeing a subparser's namespace again
    assert (ns.batch_size, ns.batches, ns.beta) == (4, 8, 0.5)


def test_dataloader_batch_only_without_an_argparse_knob_and_not_twice():
    knob = BatchKnob(4)
    assert knob.dataloader_batch(32) == 8 and knob.knob == "DataLoader(batch_size=...)"
    assert knob.dataloader_batch(8) == 8  # a framework re-creating the loader with the reduced size
    assert knob.dataloader_batch(None) is None and knob.dataloader_batch(1) == 1
    parsed = BatchKnob(2)
    parsed.knob = "argument --batch-size"
    assert parsed.dataloader_batch(16) == 16  # already reduced through args.batch_size


def test_schedule_halves_down_to_one():
    assert schedule(8) == [2, 4, 8] and schedule(3) == [2] and schedule(1) == []


def test_fit_uses_the_two_largest_and_the_third_sets_the_uncertainty():
    line_points = [(1, 100 * MiB + 1 * MiB), (2, 100 * MiB + 2 * MiB), (4, 100 * MiB + 4 * MiB)]
    assert fit(line_points).at(16) == 116 * MiB
    extra, method = uncertainty(line_points, 16, 20 * MiB)
    assert extra == 20 * MiB and "spread" in method  # on a line: only the allocator's segment
    bent = [(1, 0), (2, 10 * MiB), (4, 12 * MiB)]
    assert fit(bent).at(8) == 16 * MiB
    assert uncertainty(bent, 8, 0)[0] == 70 * MiB - 16 * MiB  # the (1, 2) line says 70 MiB
    assert fit([(1, 50), (2, 40)]).slope == 0  # never less memory for more samples
    extra, method = uncertainty([(2, 0), (4, 40 * MiB)], 8, 0)
    assert extra == 20 * MiB and "two points" in method


def _doc() -> dict:
    """A minimal valid document as an older estimator wrote it (no optional fields)."""
    target = {"gpu": "a100-40gb", "capacity_bytes": 40 << 30, "peak_allocated_bytes": 90 * MiB,
              "peak_reserved_bytes": 100 * MiB, "context_bytes": 500 * MiB, "other_driver_bytes": 0,
              "peak_total_bytes": 600 * MiB, "fits": True, "oom": False, "share_of_gpu": 0.01,
              "recommendation": {}, "top_modules": [], "by_phase": [], "by_kind": []}
    doc = {k: None for k in ("tool_version", "script", "args", "requested_mode", "fallback_reason", "iterations",
                             "requested_iterations", "stopped", "item_placeholders", "value_reads", "elapsed_s",
                             "capture_process", "dependencies", "cached", "torch_version", "cache_key",
                             "allocator_config")}
    doc.update(schema_version=1, mode="profile", targets=[target])
    return doc


def test_schema_keeps_old_documents_valid_and_checks_the_extrapolation():
    doc = _doc()
    assert validate(doc) == []
    doc["reduced_batch"] = {"knob": "argument --batch-size", "full_batch": 64, "measured_batches": [16, 32]}
    assert validate(doc) == ["reduced_batch without any extrapolated target"]
    doc["targets"][0]["extrapolation"] = {"extrapolated_reserved_bytes": 80 * MiB, "uncertainty_bytes": 20 * MiB,
                                          "measured": [{}, {}]}
    assert validate(doc) == []
    doc["targets"][0]["extrapolation"]["uncertainty_bytes"] = 10 * MiB  # not what the peak includes
    doc["reduced_batch"]["measured_batches"] = [32, 16]
    assert validate(doc) == ["targets[0]: extrapolation: peak_reserved != extrapolated + uncertainty",
                             "reduced_batch.measured_batches: not ascending below full_batch"]


WIDE = """\
    import argparse

    import torch
    import torch.nn as nn


    class Scale(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(width))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x * self.w)


    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=512)
    args = parser.parse_args()
    model = nn.Sequential(*[Scale(1 << 16) for _ in range(4)]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(args.batch_size, 1 << 16, device="cuda")
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
"""
# WIDE is elementwise: memory grows ~1.25 MiB per sample at little compute. Address-space limit of the
# capture child: interpreter, torch and the profiler take about 1 GiB (one OpenMP thread, two malloc
# arenas); batch 512 needs about 1.9 GB in all, batch 256 about 1.35 GB.
TIGHT = "1500M"


def _estimate(capsys, script, *extra: str) -> tuple[int, dict | None, str]:
    capsys.readouterr()
    code = main(["--json", "--no-cache", "--no-warm", "--mode", "profile", "--iterations", "1",
                 "--gpu", "a100-40gb", *extra, str(script)])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == EXIT_OK else None), err


@pytest.fixture
def small_threads(monkeypatch):
    """The child's address space depends on its threads and malloc arenas: pin them so TIGHT means the same
    on any machine."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")


@pytest.mark.torch
@pytest.mark.slow
def test_full_batch_over_the_limit_is_extrapolated_from_reduced_batches(capsys, tmp_path, small_threads):
    script = tmp_path / "wide.py"
    script.write_text(textwrap.dedent(WIDE))
    code, doc, err = _estimate(capsys, script, "--max-cpu-memory", TIGHT)
    assert code == EXIT_OK, err
    assert validate(doc) == []
    block = doc["reduced_batch"]
    assert block["knob"] == "argument --batch-size" and block["full_batch"] == 512
    batches = block["measured_batches"]
    assert len(batches) >= 2 and all(b in (256, 128, 64, 32, 16, 8) for b in batches)
    target = doc["targets"][0]
    ex = target["extrapolation"]
    assert [m["batch"] for m in ex["measured"]] == batches
    assert target["peak_reserved_bytes"] == ex["extrapolated_reserved_bytes"] + ex["uncertainty_bytes"] > 0
    assert "EXTRAPOLATED" in render_text(doc)

    code, direct, err = _estimate(capsys, script)  # the same full batch, without the tight limit
    assert code == EXIT_OK, err
    assert "reduced_batch" not in direct
    measured = direct["targets"][0]["peak_total_bytes"]
    assert 0.8 * measured <= ex["extrapolated_total_bytes"] <= 1.25 * measured
    assert target["peak_total_bytes"] >= 0.95 * measured  # the uncertainty keeps the job from being under-sized
    print(f"direct {measured / MiB:.0f} MiB, extrapolated {ex['extrapolated_total_bytes'] / MiB:.0f} "
          f"± {ex['uncertainty_bytes'] / MiB:.0f} MiB from batches {batches}")


@pytest.mark.torch
def test_no_reducible_batch_still_exits_4_with_the_message(capsys, tmp_path, small_threads):
    script = tmp_path / "fixed.py"
    source = textwrap.dedent(WIDE).replace("args.batch_size", "512")
    script.write_text(source.replace('parser.add_argument("--batch-size", type=int, default=512)\n', ""))
    code, doc, err = _estimate(capsys, script, "--max-cpu-memory", TIGHT)
    assert code == EXIT_LIMIT and doc is None
    assert "--max-cpu-memory" in err and "no batch size to reduce" in err
