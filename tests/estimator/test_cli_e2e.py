"""End-to-end runs of ``gpu-estimate`` on the examples: modes, fallback, failures, exit codes, outputs.

Each run starts a real child process that imports torch, so the tests share runs through module-scoped
fixtures where they can.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import textwrap
from pathlib import Path

import pytest

from gpushare.estimator_cli.cli import EXIT_LIMIT, EXIT_OK, EXIT_SCRIPT, EXIT_UNSUPPORTED, EXIT_USAGE, main
from gpushare.estimate.schema import SCHEMA_VERSION, validate

pytestmark = pytest.mark.torch  # starts gpu-estimate captures: torch in a child process or the warm worker

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *args: str) -> dict:
    code, out, err = run(capsys, "--json", "--no-cache", *args)
    assert code == EXIT_OK, err
    return json.loads(out)


@pytest.fixture(scope="module")
def resnet_run(tmp_path_factory):
    """One ResNet-50 estimate with every output: JSON, plot and snapshot (shared by several tests)."""
    tmp = tmp_path_factory.mktemp("resnet")
    plot, snap = tmp / "t.png", tmp / "s.pickle"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):  # module scope: no capsys here
        code = main(["--json", "--no-cache", "--gpu", "a100-40gb", "--gpu", "a100-40gb:3g.20gb",
                     "--plot", str(plot), "--snapshot", str(snap), str(EXAMPLES / "resnet50_train.py"),
                     "--batch-size", "16"])
    return code, json.loads(buf.getvalue()), plot, snap


def test_resnet_json_matches_schema(resnet_run):
    code, doc, _, _ = resnet_run
    assert code == EXIT_OK
    assert validate(doc) == []
    assert doc["schema_version"] == SCHEMA_VERSION and doc["mode"] == "fake" and doc["fallback_reason"] is None
    assert doc["iterations"] == 3 and doc["stopped"] is True
    assert [t["gpu"] for t in doc["targets"]] == ["a100-40gb", "a100-40gb:3g.20gb"]
    whole, mig = doc["targets"]
    # ResNet-50 + Adam at batch 16: ~100 MB weights, 4x for grads+states, ~1.3 GB of activations
    assert 1.0e9 < whole["peak_allocated_bytes"] < 3.0e9
    assert whole["peak_reserved_bytes"] >= whole["peak_allocated_bytes"]
    assert whole["recommendation"]["kind"] == "shared" and mig["recommendation"]["kind"] == "mig"
    assert any(row["name"].startswith("ResNet") for row in whole["top_modules"])
    assert {r["name"] for r in whole["by_kind"]} >= {"parameter", "optimizer_state", "activation"}


def test_plot_is_a_png(resnet_run):
    _, _, plot, _ = resnet_run
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_snapshot_renders_with_torch_memory_viz(resnet_run):
    from torch.cuda import _memory_viz

    _, doc, _, snap = resnet_run
    with open(snap, "rb") as handle:
        snapshot = pickle.load(handle)
    assert {"segments", "device_traces"} <= set(snapshot)
    assert snapshot["device_traces"][0], "the allocation trace is recorded"
    html = _memory_viz.trace_plot(snapshot)
    assert "<html" in html.lower() or len(html) > 1000
    reserved = sum(seg["total_size"] for seg in snapshot["segments"])
    assert reserved <= doc["targets"][0]["peak_reserved_bytes"]


def test_cache_hit_returns_the_same_estimate(capsys, tmp_path):
    script = str(EXAMPLES / "forward_only.py")
    code, out, _ = run(capsys, "--json", "--cache-dir", str(tmp_path), script, "--batches", "2")
    first = json.loads(out)
    assert code == EXIT_OK and first["cached"] is False
    code, out, _ = run(capsys, "--json", "--cache-dir", str(tmp_path), script, "--batches", "2")
    second = json.loads(out)
    assert second["cached"] is True and second["cache_key"] == first["cache_key"]
    assert second["targets"] == first["targets"]
    assert list(tmp_path.glob("*.json")) == [tmp_path / f"{first['cache_key']}.json"]


def test_cache_notices_the_scripts_own_modules_and_file_arguments(capsys, tmp_path):
    """A cached estimate is not served after a module the script imports from its project, or a file
    named by an argument, changed: both change what the GPU run would allocate."""
    project, cache = tmp_path / "project", tmp_path / "cache"
    project.mkdir()
    (project / "mymodel.py").write_text("import torch\nWIDTH = 64\n"
                                        "def build():\n    return torch.nn.Linear(WIDTH, WIDTH)\n")
    (project / "cfg.json").write_text('{"batch": 8}')
    script = project / "train.py"
    script.write_text(textwrap.dedent("""
        import argparse, json, torch
        from mymodel import WIDTH, build
        parser = argparse.ArgumentParser()
        parser.add_argument("--config")
        batch = json.load(open(parser.parse_args().config))["batch"]
        model = build().cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):
            model(torch.randn(batch, WIDTH, device="cuda")).sum().backward()
            opt.step()
    """))

    def estimate() -> dict:
        code, out, err = run(capsys, "--json", "--cache-dir", str(cache), str(script),
                             f"--config={project / 'cfg.json'}")
        assert code == EXIT_OK, err
        return json.loads(out)

    first = estimate()
    assert [d["path"] for d in first["dependencies"]] == [str(project / "mymodel.py")]
    assert estimate()["cached"] is True
    (project / "mymodel.py").write_text((project / "mymodel.py").read_text().replace("64", "4096"))
    wider = estimate()
    assert wider["cached"] is False
    assert wider["targets"][0]["peak_allocated_bytes"] > first["targets"][0]["peak_allocated_bytes"]
    assert estimate()["cached"] is True
    (project / "cfg.json").write_text('{"batch": 4096}')
    bigger = estimate()
    assert bigger["cached"] is False and bigger["cache_key"] != wider["cache_key"]


def test_forward_only_script_gives_forward_peak(capsys):
    doc = run_json(capsys, str(EXAMPLES / "forward_only.py"))
    assert doc["iterations"] == 0 and doc["stopped"] is False
    kinds = {r["name"] for r in doc["targets"][0]["by_kind"]}
    assert "optimizer_state" not in kinds and "gradient" not in kinds


def test_data_dependent_script_falls_back_to_profile_and_says_why(capsys):
    doc = run_json(capsys, str(EXAMPLES / "data_dependent.py"))
    assert doc["mode"] == "profile" and doc["requested_mode"] == "auto"
    assert "nonzero" in doc["fallback_reason"]
    assert doc["iterations"] == 3


def test_fake_mode_alone_refuses_data_dependent_script(capsys):
    code, out, err = run(capsys, "--no-cache", "--mode", "fake", str(EXAMPLES / "data_dependent.py"))
    assert code == EXIT_UNSUPPORTED and out == "" and "--mode profile" in err


def test_crashing_script_reports_traceback_never_an_estimate(capsys):
    code, out, err = run(capsys, "--no-cache", str(EXAMPLES / "crash.py"))
    assert code == EXIT_SCRIPT and out == ""
    assert "crash.py" in err and "mat1 and mat2 shapes cannot be multiplied" in err
    assert "estimator_cli" not in err.split("script traceback")[1]  # our frames are not the user's problem


def test_zero_grad_before_backward_peaks_higher_than_at_top(capsys):
    script = str(EXAMPLES / "zero_grad_placement.py")
    top = run_json(capsys, script, "--placement", "top")["targets"][0]
    late = run_json(capsys, script, "--placement", "before-backward")["targets"][0]
    assert late["peak_allocated_bytes"] > top["peak_allocated_bytes"]


def test_autocast_lowers_the_peak(capsys):
    script = str(EXAMPLES / "amp_train.py")
    amp = run_json(capsys, script)["targets"][0]
    fp32 = run_json(capsys, script, "--no-amp")["targets"][0]
    assert amp["peak_allocated_bytes"] < 0.9 * fp32["peak_allocated_bytes"]


def test_script_output_only_with_verbose(capsys):
    script = str(EXAMPLES / "forward_only.py")
    code, out, err = run(capsys, "--no-cache", "--progress", script, "--batches", "1")
    assert code == EXIT_OK and "batches predicted" not in out + err
    assert "capturing on a100-80gb" in err  # --progress forces the progress line without a terminal
    code, out, err = run(capsys, "--no-cache", "--verbose", script, "--batches", "1")
    assert code == EXIT_OK and "1 batches predicted" in err
    assert "forward-only" in out and "a100-80gb" in out  # human report: default target from the config


def test_script_arguments_pass_through_untouched(capsys, tmp_path):
    script = tmp_path / "args.py"
    script.write_text("import sys, torch\nprint('ARGS', sys.argv[1:])\nm = torch.nn.Linear(4, 4).cuda()\n"
                      "opt = torch.optim.SGD(m.parameters())\nm(torch.ones(2, 4).cuda()).sum().backward()\nopt.step()\n")
    code, _, err = run(capsys, "--no-cache", "--verbose", str(script), "--gpu", "x", "--json", "-v")
    assert code == EXIT_OK and "ARGS ['--gpu', 'x', '--json', '-v']" in err


@pytest.mark.parametrize("args", [["--gpu", "b300-999gb", "x.py"], ["/nonexistent/script.py"],
                                  ["--max-cpu-memory", "lots", "x.py"], ["--mode", "quantum", "x.py"]])
def test_usage_errors_exit_2(capsys, args):
    code, out, err = run(capsys, *args)
    assert code == EXIT_USAGE and out == "" and err


def test_timeout_exit_4(capsys, tmp_path):
    script = tmp_path / "forever.py"
    script.write_text("import time\nwhile True:\n    time.sleep(0.1)\n")
    code, out, err = run(capsys, "--no-cache", "--timeout", "3", str(script))
    assert code == EXIT_LIMIT and "--timeout" in err


def test_memory_limit_exit_4(capsys, tmp_path):
    script = tmp_path / "hog.py"
    script.write_text("blocks = [bytearray(1 << 30) for _ in range(8)]\n")
    code, out, err = run(capsys, "--no-cache", "--max-cpu-memory", "2G", str(script))
    assert code == EXIT_LIMIT and "--max-cpu-memory" in err


def test_lifetimes_in_the_capture(tmp_path):
    """Gradients: freed at zero_grad(set_to_none=True), kept with False; parameters and state persist."""
    import subprocess
    import sys

    from gpushare.estimator_cli.events import Capture, Kind
    from gpushare.estimator_cli.orchestrate import check_lifetimes

    script = tmp_path / "lifetimes.py"
    script.write_text(textwrap.dedent("""
        import sys, torch
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
        opt = torch.optim.Adam(model.parameters())
        for _ in range(5):
            opt.zero_grad(set_to_none=sys.argv[1] == "none")
            model(torch.randn(32, 64, device="cuda")).sum().backward()
            opt.step()
    """))
    gpu = '{"name": "NVIDIA A100-SXM4-80GB", "total_memory": 85899345920, "major": 8, "minor": 0, ' \
          '"multi_processor_count": 108}'
    captures = {}
    for how in ("none", "zero"):
        out = tmp_path / f"{how}.json"
        subprocess.run([sys.executable, "-m", "gpushare.estimator_cli.runner", "--mode", "fake", "--out", str(out),
                        "--gpu", gpu, str(script), "--", how], check=True, capture_output=True)
        result = json.loads(out.read_text())
        assert result["status"] == "ok", result
        captures[how] = Capture.from_json(result["capture"])
    for how, cap in captures.items():
        assert check_lifetimes(cap) == [], how
        freed = {i for op, i in cap.events if op == "free"}
        grads = [a for a in cap.allocs.values() if a.kind == Kind.GRADIENT.value]
        params = [a for a in cap.allocs.values() if a.kind == Kind.PARAMETER.value]
        states = [a for a in cap.allocs.values() if a.kind == Kind.OPTIMIZER_STATE.value]
        assert len(params) == 4 and len(states) == 8  # Adam: exp_avg + exp_avg_sq per parameter (step on CPU)
        assert not any(a.id in freed for a in params + states)
        assert all(a.iteration == 0 for a in states)  # state is created in step 1 and kept
        if how == "none":
            assert len(grads) == 12 and sum(a.id in freed for a in grads) == 8  # 3 steps; last grads alive
        else:
            assert len(grads) == 4 and not any(a.id in freed for a in grads)  # zeroed in place, kept


@pytest.fixture(scope="module")
def split_runs():
    """The zero_grad example (4 × Linear(2048, 2048) + Linear(2048, 10), Adam) at two placements and batch
    sizes: what stays between iterations is the same model and state in both."""
    docs = {}
    for placement, batch in (("top", "64"), ("before-backward", "256")):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = main(["--json", "--no-cache", "--gpu", "a100-40gb", str(EXAMPLES / "zero_grad_placement.py"),
                         "--placement", placement, "--batch-size", batch])
        assert code == EXIT_OK
        docs[placement] = json.loads(buf.getvalue())
    return docs


def test_persistent_memory_is_the_model_and_its_optimizer_state(split_runs):
    """Persistent blocks = parameters + Adam's two moments (its step counters stay on the CPU) + the two cuBLAS
    workspaces (forward and backward threads, device_model.py) + the forward thread's cuBLASLt workspace
    (its first addmm), exactly up to 1 MiB of allocator rounding.
    Persistent *reserved* bytes add the segments those blocks sit in — a workspace (1-10 MiB) pins a 20 MiB
    segment that the iteration's blocks shared, the biases 2 MiB small segments: tolerance 48 MiB above the
    blocks. Gradients, batches and activations are per-iteration blocks: ephemeral."""
    from gpushare.estimator_cli.device_model import CUBLAS_WORKSPACE_DEFAULT, CUBLASLT_WORKSPACE_DEFAULT

    params = 4 * (2048 * 2048 + 2048) * 4 + (2048 * 10 + 10) * 4
    expected = 3 * params + 2 * CUBLAS_WORKSPACE_DEFAULT + CUBLASLT_WORKSPACE_DEFAULT
    for placement, doc in split_runs.items():
        assert validate(doc) == []
        target = doc["targets"][0]
        assert 0 <= target["persistent_allocated_bytes"] - expected <= 1 << 20, placement
        assert 0 <= target["persistent_bytes"] - target["persistent_allocated_bytes"] <= 48 << 20, placement
        assert target["persistent_bytes"] + target["ephemeral_bytes"] == target["peak_reserved_bytes"]
        assert target["ephemeral_bytes"] >= params  # this iteration's gradients at least
    top, before = (split_runs[p]["targets"][0] for p in ("top", "before-backward"))
    assert top["persistent_allocated_bytes"] == before["persistent_allocated_bytes"]  # same model and state
