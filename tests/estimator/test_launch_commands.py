"""Any command that starts Python training, as a user types it (docs/estimator.md, "Launcher lines and
commands"): a console script found on PATH (``litgpt``, ``tune``, ``yolo``), ``python -m pkg``, torchrun /
accelerate launch / deepspeed with a module, and Lightning Fabric's ``lightning run model`` / ``fabric run``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpushare.estimator_cli.cli import EXIT_OK, EXIT_USAGE, main
from gpushare.estimator_cli.launch_line import LaunchLineError, command_script, module_file, parse, python_of

TRAIN = """
    import sys, torch

    def main():
        width = int(sys.argv[sys.argv.index("--width") + 1]) if "--width" in sys.argv else 256
        model = torch.nn.Linear(width, width).cuda()
        opt = torch.optim.Adam(model.parameters())
        for _ in range(5):
            model(torch.randn(16, width, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
"""


@pytest.mark.parametrize("line, script, args, world, local, module", [
    ("python -m tinytrain --width 8", "tinytrain", ["--width", "8"], 1, 1, True),
    ("python3 -u -m tiny.train", "tiny.train", [], 1, 1, True),
    ("torchrun --nproc_per_node=2 -m tinytrain --x", "tinytrain", ["--x"], 2, 2, True),
    ("accelerate launch --num_processes 4 -m tinytrain", "tinytrain", [], 4, 4, True),
    ("deepspeed --num_gpus 2 --module tinytrain", "tinytrain", ["--local_rank=0"], 2, 2, True),
    ("lightning run model --devices 2 --precision bf16-mixed train.py --x 1", "train.py", ["--x", "1"], 2, 2, False),
    ("fabric run --devices=4 --num-nodes=2 --strategy ddp train.py", "train.py", [], 8, 4, False),
    ("fabric run model --devices 0,1,2 train.py", "train.py", [], 3, 3, False),
])
def test_module_and_fabric_lines(line, script, args, world, local, module):
    parsed = parse(line.split())
    assert (parsed.script, parsed.args, parsed.world_size, parsed.local_world_size, parsed.module) == \
        (script, args, world, local, module)


def test_fabric_settings_reach_the_script_as_its_launcher_passes_them():
    env = parse("lightning run model --devices 2 --precision bf16-mixed --accelerator gpu t.py".split()).env
    assert env == {"LT_CLI_USED": "1", "LT_DEVICES": "2", "LT_NUM_NODES": "1", "LT_ACCELERATOR": "gpu",
                   "LT_PRECISION": "bf16-mixed"}
    with pytest.raises(LaunchLineError, match="run model"):
        parse("lightning train.py".split())


def test_console_scripts_are_found_and_other_commands_refused(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pip_style = bin_dir / "trainer"
    pip_style.write_text(f"#!{sys.executable}\nimport sys\nfrom pkg.cli import main\nsys.exit(main())\n")
    long_path = bin_dir / "trainer-long"  # pip's form when the interpreter's path is too long for #!
    long_path.write_text("#!/bin/sh\n'''exec' \"/opt/a b/python3.11\" \"$0\" \"$@\"\n' '''\nimport sys\n")
    shell = bin_dir / "run.sh"
    shell.write_text("#!/bin/bash\nexec python train.py\n")
    for path in (pip_style, long_path, shell):
        path.chmod(0o755)
    search = str(bin_dir)
    assert command_script("trainer", search_path=search) == str(pip_style)
    assert python_of(str(pip_style)) == sys.executable and python_of(str(long_path)) == "/opt/a b/python3.11"
    with pytest.raises(LaunchLineError, match="not a Python program"):
        command_script("run.sh", search_path=search)
    with pytest.raises(LaunchLineError, match="neither a file nor a command on PATH"):
        command_script("no-such-trainer", search_path=search)


def test_module_file_is_found_without_importing_the_package(tmp_path):
    package = tmp_path / "tinypkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (package / "__main__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "train.py").write_text("")
    assert module_file("tinypkg", [str(tmp_path)]) == str(package / "__main__.py")
    assert module_file("tinypkg.sub.train", [str(tmp_path)]) == str(package / "sub" / "train.py")
    assert module_file("tinypkg.nothing", [str(tmp_path)]) is None


def _estimate(capsys, *line: str) -> tuple[int, dict | None, str]:
    capsys.readouterr()
    code = main(["--json", "--no-cache", "--no-warm", "--gpu", "a100-40gb", *line])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == EXIT_OK else None), err


@pytest.mark.torch
def test_a_console_script_installed_with_pip_is_estimated(capsys, tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "src" / "tinytrain").mkdir(parents=True)
    (project / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "tinytrain"
        version = "0.1"
        [project.scripts]
        tinytrain-cli = "tinytrain.cli:main"
    """))
    (project / "src" / "tinytrain" / "__init__.py").write_text("")
    (project / "src" / "tinytrain" / "cli.py").write_text(textwrap.dedent(TRAIN))
    target = tmp_path / "target"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(target), str(project)], check=True, capture_output=True, timeout=300)
    monkeypatch.setenv("PATH", f"{target / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", str(target))
    monkeypatch.chdir(tmp_path)
    code, doc, err = _estimate(capsys, "tinytrain-cli", "--width", "1024")
    assert code == EXIT_OK, err
    assert doc["iterations"] == 3 and doc["targets"][0]["peak_allocated_bytes"] >= 3 * 1024 * 1024 * 4
    assert doc["script"] == str(target / "bin" / "tinytrain-cli")


@pytest.mark.torch
def test_python_dash_m_of_a_local_package(capsys, tmp_path, monkeypatch):
    package = tmp_path / "tinypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(textwrap.dedent(TRAIN) + "\nmain()\n")
    monkeypatch.chdir(tmp_path)
    code, doc, err = _estimate(capsys, "python", "-m", "tinypkg", "--width", "1024")
    assert code == EXIT_OK, err
    assert doc["iterations"] == 3 and doc["targets"][0]["peak_allocated_bytes"] >= 3 * 1024 * 1024 * 4
    code, _, err = _estimate(capsys, "python", "-m", "no_such_package_here")
    assert code != EXIT_OK and "no_such_package_here" in err


def test_a_word_that_is_no_command_is_a_usage_error(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["--no-cache", "litgpt-not-installed", "finetune"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "neither a file nor a command on PATH" in err


def test_the_module_form_runs_under_its_own_name(tmp_path):
    """The capture runs a module as python -m does: __main__, argv[0] its file, the working directory first
    on sys.path (checked through the runner's ScriptRun, without torch's capture)."""
    package = tmp_path / "probe_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text("")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import json, os, sys
        from gpushare.estimator_cli.capture import ScriptRun
        run = ScriptRun("probe_pkg", [], 3, None, module=True)
        print(json.dumps(run.main_file()))
    """)], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Path(json.loads(proc.stdout.splitlines()[-1])) == package / "__main__.py"
