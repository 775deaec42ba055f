"""What keeps an estimate fast (docs/benchmarks.md, "Estimator latency guard"): the gpu-estimate process
itself never imports torch (only the capture child or the warm worker does), and a capture wakes no lazy
module (the lazy ``torch._dynamo`` stand-in, estimator_cli/lazy_dynamo.py, costs 1.6 s when woken)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Everything the gpu-estimate process imports on its way through an estimate (cli.py → pipeline.py).
PARENT_MODULES = ("cli", "pipeline", "estimate", "orchestrate", "launcher", "report", "recommend", "cache",
                  "annotate", "launch_line", "command_line", "warm_worker", "reduced_batch", "interpreter")


def _python(code: str, cwd: Path = ROOT) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=cwd, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_parents_import_path_is_torch_free():
    seen = _python(f"""
        import importlib, json, sys
        for name in {PARENT_MODULES!r}:
            try:
                importlib.import_module("gpushare.estimator_cli." + name)
            except ModuleNotFoundError as exc:
                if exc.name != "gpushare.estimator_cli." + name:
                    raise
        print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
    """)
    assert seen == []


@pytest.mark.torch
def test_a_warm_estimate_never_imports_torch_in_the_parent(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(textwrap.dedent("""
        import torch
        model = torch.nn.Linear(64, 64).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(8, 64, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
    """))
    seen = _python(f"""
        import contextlib, io, json, sys
        from gpushare.estimator_cli.cli import main
        processes = []
        for _ in range(2):  # the first may start the warm worker; the second is forked by it
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert main(["--json", "--no-cache", "--gpu", "a100-40gb", {str(script)!r}]) == 0
            processes.append(json.loads(out.getvalue())["capture_process"])
        print(json.dumps({{"processes": processes, "torch": "torch" in sys.modules}}))
    """, cwd=tmp_path)
    assert seen == {"processes": [seen["processes"][0], "warm"], "torch": False}


@pytest.mark.torch
def test_the_safetensors_scan_wakes_no_lazy_module():
    seen = _python("""
        import importlib.abc, importlib.util, json, sys, types
        import safetensors
        import torch
        from gpushare.estimator_cli.lazy_dynamo import lazy_dynamo
        from gpushare.estimator_cli.weight_files import header_only_weights

        class Exploding(importlib.abc.Loader):
            def create_module(self, spec):
                return None
            def exec_module(self, module):
                raise RuntimeError("a lazy module was woken")

        lazy = importlib.util.LazyLoader(Exploding())
        spec = importlib.util.spec_from_loader("gpushare_lazy_probe", lazy)
        probe = importlib.util.module_from_spec(spec)
        sys.modules["gpushare_lazy_probe"] = probe
        lazy.exec_module(probe)
        holder = types.ModuleType("gpushare_holder_probe")
        original = safetensors.safe_open
        holder.safe_open = original  # as `from safetensors import safe_open` in a loaded library
        sys.modules["gpushare_holder_probe"] = holder
        with lazy_dynamo():
            with header_only_weights():
                replaced = holder.safe_open is not original
                dynamo = type(sys.modules["torch._dynamo"]).__name__
        print(json.dumps({"replaced": replaced, "restored": holder.safe_open is original, "dynamo": dynamo}))
    """)
    assert seen == {"replaced": True, "restored": True, "dynamo": "_LazyDynamo"}
