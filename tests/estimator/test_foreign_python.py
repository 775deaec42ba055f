"""``gpu-estimate --python``: the capture under the user's interpreter, with nothing installed into it.

The environments are real virtualenvs made from Debian's Python: one borrows this project's PyTorch through a
``.pth`` line and holds a package nothing else has (what a researcher's venv looks like to the capture), one
holds no PyTorch, and two carry only a ``torch`` distribution record whose version is outside the supported
range (the refusal reads the version from the package metadata, before importing anything). The other
PyTorch releases (2.4.1 and 2.14.1, CUDA builds) are the cached venvs ``make python-envs`` builds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from gpushare.estimator_cli.cli import EXIT_OK, EXIT_SCRIPT, EXIT_USAGE, main
from gpushare.estimator_cli.interpreter import InterpreterError, resolve
from gpushare.estimate.schema import validate

BASE_PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
PYTHON_ENVS = Path(os.environ.get("GPUSHARE_PYTHON_ENVS", "/var/cache/gpushare/python-envs"))
ONLY_HERE = """import torch
import torch.nn as nn
import onlyhere  # present only in the user's environment

model = nn.Sequential(nn.Linear(256, onlyhere.WIDTH), nn.ReLU(), nn.Linear(onlyhere.WIDTH, 10)).cuda()
opt = torch.optim.Adam(model.parameters())
for step in range(3):
    loss = model(torch.randn(32, 256, device="cuda")).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def make_venv(path: Path, torch_version: str | None = None, borrow_torch: bool = False) -> Path:
    """A virtualenv from Debian's Python (no pip: a fraction of a second); ``torch_version`` adds only a
    distribution record; ``borrow_torch`` puts this project's site-packages on its path and a package
    ``onlyhere`` into it."""
    subprocess.run([BASE_PYTHON, "-m", "venv", "--without-pip", str(path)], check=True)
    site = next((path / "lib").glob("python3*/site-packages"))
    if torch_version:
        record = site / f"torch-{torch_version}.dist-info"
        record.mkdir()
        (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n")
    if borrow_torch:
        (site / "borrowed_torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        (site / "onlyhere").mkdir()
        (site / "onlyhere" / "__init__.py").write_text("WIDTH = 384\n")
    return path / "bin" / "python"


@pytest.fixture(autouse=True)
def site_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A site file (empty: the defaults), as a login node has one: without it gpu-estimate adds a line saying
    so (docs/configuration.md), and these tests count the lines of a refusal."""
    (tmp_path / "gpushare.toml").write_text("")
    monkeypatch.setenv("GPUSHARE_CONFIG", str(tmp_path / "gpushare.toml"))


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# --- which interpreter: resolution and refusal (no torch imported) ------------------------------------------
def test_resolve_follows_paths_commands_and_first_lines(tmp_path: Path) -> None:
    python = make_venv(tmp_path / "venv")
    bin_dir = python.parent
    console = bin_dir / "torchrun"  # what pip writes for a console script
    console.write_text(f"#!{python}\nimport sys\n")
    long_form = bin_dir / "accelerate"  # pip's form for interpreter paths too long for a #! line
    long_form.write_text(f"#!/bin/sh\n'''exec' \"{python}\" \"$0\" \"$@\"\n' '''\n")
    by_env = tmp_path / "train.py"
    by_env.write_text("#!/usr/bin/env python3\nprint(1)\n")
    shell = bin_dir / "run.sh"
    shell.write_text("#!/bin/bash\necho\n")
    for script in (console, long_form, by_env, shell):
        script.chmod(0o755)
    search = str(bin_dir)
    assert resolve(str(python)) == str(python)  # a venv's python keeps its path (resolving it loses the venv)
    assert resolve("python3", search) == str(bin_dir / "python3")
    assert resolve("torchrun", search) == str(python)
    assert resolve("accelerate", search) == str(python)
    assert resolve(str(by_env), search) == str(bin_dir / "python3")
    with pytest.raises(InterpreterError, match="run by /bin/bash, not by Python"):
        resolve(str(shell))
    with pytest.raises(InterpreterError, match="no such file on PATH"):
        resolve("python3.99", search)


@pytest.mark.parametrize(("torch_version", "expected"), [
    (None, "PyTorch is not installed there"),
    ("2.3.1", "PyTorch 2.3.1 is outside the supported range 2.4–2.15"),
    ("2.16.0", "PyTorch 2.16.0 is outside the supported range 2.4–2.15"),
])
def test_unusable_interpreter_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          torch_version: str | None, expected: str) -> None:
    python = make_venv(tmp_path / "venv", torch_version)
    script = tmp_path / "train.py"
    script.write_text(ONLY_HERE)
    code, out, err = run(capsys, "--no-cache", "--python", str(python), str(script))
    assert code == EXIT_USAGE and out == ""
    assert err.count("\n") == 1 and err.startswith(f"gpu-estimate: --python {python}: ") and expected in err, err


@pytest.mark.parametrize(("python", "torch", "expected"), [
    ("3.10.12", "2.5.1", "Python 3.10.12 is outside the supported range 3.11–3.13"),
    ("3.14.0", "2.15.0", "Python 3.14.0 is outside the supported range 3.11–3.13"),
    ("3.13.1", "2.15.0+cu128", None), ("3.11.2", "2.4.0", None), ("3.12.3", "unknown", None),
])
def test_supported_range(python: str, torch: str, expected: str | None) -> None:
    """The Python bound (no second Python is at hand to probe: the check on the probe's answer)."""
    from gpushare.estimator_cli.interpreter import Interpreter, check

    found = Interpreter("/opt/env/bin/python", python, torch, "/opt/env")
    if expected is None:
        check(found)
    else:
        with pytest.raises(InterpreterError, match=expected):
            check(found)


def test_not_a_python_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(ONLY_HERE)
    code, _, err = run(capsys, "--python", "/bin/true", str(script))
    assert code == EXIT_USAGE and err.count("\n") == 1 and "not a Python 3 interpreter" in err, err


# --- the capture in the user's environment --------------------------------------------------------------------
@pytest.fixture(scope="module")
def user_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("foreign")
    script = tmp / "train.py"
    script.write_text(ONLY_HERE)
    return make_venv(tmp / "venv", borrow_torch=True), script


@pytest.mark.torch
def test_capture_runs_in_the_users_environment(user_env: tuple[Path, Path], capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    python, script = user_env
    code, _, err = run(capsys, "--no-cache", "--no-warm", "--gpu", "a100-40gb", str(script))
    assert code == EXIT_SCRIPT and "No module named 'onlyhere'" in err  # gpushare's own Python lacks it
    code, out, err = run(capsys, "--json", "--cache-dir", str(tmp_path), "--gpu", "a100-40gb", "--python",
                         str(python), str(script))
    assert code == EXIT_OK, err
    doc = json.loads(out)
    assert validate(doc) == []
    import torch

    assert doc["python"] == {"executable": str(python), "python_version": "%d.%d.%d" % sys.version_info[:3],
                             "torch_version": torch.__version__, "prefix": str(python.parent.parent), "own": False}
    assert doc["capture_process"] == "cold" and doc["dependencies"] == []  # the capture code is not the script's
    # two 8 MiB cuBLAS workspaces + the 1 MiB cuBLASLt one + 256x384 + 384x10 weights and two Adam moments
    # (3 x 103,264 floats; the gradients are freed by zero_grad between iterations)
    kept = doc["targets"][0]["persistent_allocated_bytes"] - (16 << 20) - (1 << 20)
    assert 1_200_000 < kept < 1_600_000, kept
    code, out, _ = run(capsys, "--json", "--cache-dir", str(tmp_path), "--gpu", "a100-40gb", "--python",
                       str(python), str(script))
    assert json.loads(out)["cached"] is True and json.loads(out)["python"]["executable"] == str(python)
    code, out, _ = run(capsys, "--cache-dir", str(tmp_path), "--gpu", "a100-40gb", "--python", str(python), str(script))
    assert f"python: {python} (yours): Python {doc['python']['python_version']}, PyTorch {torch.__version__}" in out


FLASH_ATTENTION = """import torch
import torch.nn.functional as F

proj = torch.nn.Linear(512, 3 * 512).cuda()
opt = torch.optim.AdamW(proj.parameters())
for step in range(3):
    x = torch.randn(8, 1024, 512, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        q, k, v = proj(x).view(8, 1024, 3, 8, 64).permute(2, 0, 3, 1, 4)
        loss = F.scaled_dot_product_attention(q, k, v, is_causal=True).float().square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.parametrize("version", ["2.4.1", "2.14.1"])  # the oldest supported, the newest at hand
def test_another_pytorch_gives_the_same_estimate(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                 version: str) -> None:
    """Another PyTorch (a CUDA build, no GPU here) against this project's 2.13, fake mode: a convnet, and
    attention on the memory-efficient (float32) and the flash (float16 autocast on sm80) kernels, whose
    forwards PyTorch 2.4 has no meta kernels for (estimator_cli/cuda_paths.py supplies them)."""
    python = PYTHON_ENVS / f"torch-{version}" / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{python.parent.parent} missing: 'make python-envs' builds it (5 GB, 2-3 minutes)")
    examples = Path(__file__).resolve().parents[2] / "examples"
    flash = tmp_path / "flash.py"
    flash.write_text(FLASH_ATTENTION)
    for script in ([str(examples / "resnet50_train.py"), "--batch-size", "8"],
                   [str(examples / "gpt2_train.py"), "--seq-len", "128"], [str(flash)]):
        docs = []
        for extra in ([], ["--python", str(python)]):
            code, out, err = run(capsys, "--json", "--no-cache", "--no-warm", "--mode", "fake", "--gpu", "a100-40gb",
                                 "--gpu", "v100-32gb", *extra, *script)
            assert code == EXIT_OK, err
            docs.append(json.loads(out))
        ours, theirs = docs
        assert theirs["torch_version"].startswith(version) and theirs["python"]["own"] is False
        assert ours["python"]["own"] is True and ours["torch_version"] != theirs["torch_version"]
        assert [t["peak_total_bytes"] for t in theirs["targets"]] == [t["peak_total_bytes"] for t in ours["targets"]]


CHECKPOINT_AUTOCAST = """import torch
from torch.utils.checkpoint import checkpoint
dev = torch.device("cuda")
emb = torch.nn.Embedding(128, 512).to(device=dev)
body = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 512)).to(device=dev)
opt = torch.optim.SGD([*emb.parameters(), *body.parameters()], lr=0.1)
for step in range(3):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = checkpoint(body, emb.weight[:16] * 2, use_reentrant=False)
    y.float().sum().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.torch
@pytest.mark.slow
def test_checkpoint_recompute_keeps_autocast_on_the_newest_pytorch(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path) -> None:
    """PyTorch 2.14 reaches the non-reentrant checkpoint's generator by a new name (``..._impl``); the
    recomputation must still run under the capture's presenter (CUDA autocast), or every Trainer job with
    gradient checkpointing and bf16 fails with "Recomputed values ... different metadata"."""
    python = PYTHON_ENVS / "torch-2.14.1" / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{python.parent.parent} missing: 'make python-envs' builds it (5 GB, 2-3 minutes)")
    script = tmp_path / "checkpointed.py"
    script.write_text(CHECKPOINT_AUTOCAST)
    code, out, err = run(capsys, "--json", "--no-cache", "--no-warm", "--mode", "fake", "--gpu", "a100-40gb",
                         "--python", str(python), str(script))
    assert code == EXIT_OK, err
    doc = json.loads(out)
    assert doc["torch_version"].startswith("2.14") and doc["mode"] == "fake", doc.get("mode")
