"""A Python program that starts its training script as a child Python process (TRL's ``trl sft``: accelerate's
``launch_command`` -> ``simple_launcher`` -> ``subprocess.Popen([sys.executable, sft.py, ...])``). The child
ran outside the capture, failed without a GPU, and the estimate saw only "returned non-zero exit status 1";
now it runs in the capture and is estimated as the training script itself."""

from __future__ import annotations

import textwrap

import pytest
from estimator_run import estimate

from gpushare.estimator_cli.child_python import python_child
from gpushare.estimator_cli.cli import EXIT_OK

torch = pytest.importorskip("torch")

TRAIN = """
import os
import sys
import torch

assert sys.argv[1:] == ["--width", "512"], sys.argv
assert os.environ.get("CHILD_SETTING") == "on"
width = int(sys.argv[2])
model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)).cuda()
opt = torch.optim.AdamW(model.parameters())
for step in range(4):
    model(torch.randn(32, width, device="cuda")).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""

BY_HAND = """
import os, subprocess, sys
child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child_train.py")
process = subprocess.Popen([sys.executable, child, "--width", "512"], env=dict(os.environ, CHILD_SETTING="on"))
if process.wait() != 0:
    raise subprocess.CalledProcessError(process.returncode, process.args)
"""

THROUGH_ACCELERATE = """
import os
from accelerate.commands.launch import launch_command, launch_command_parser
os.environ["CHILD_SETTING"] = "on"
child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child_train.py")
launch_command(launch_command_parser().parse_args([child, "--width", "512"]))
"""


@pytest.mark.torch
@pytest.mark.parametrize("parent", [BY_HAND, THROUGH_ACCELERATE], ids=["popen", "accelerate-launch-command"])
def test_a_training_script_started_as_a_python_child_is_estimated(capsys, tmp_path, parent):
    if parent is THROUGH_ACCELERATE:
        pytest.importorskip("accelerate")
    (tmp_path / "child_train.py").write_text(textwrap.dedent(TRAIN))
    code, direct, err = estimate(capsys, tmp_path, TRAIN.replace("sys.argv[1:] ==", "True or sys.argv[1:] ==")
                                 .replace('os.environ.get("CHILD_SETTING") == "on"', "True")
                                 .replace("int(sys.argv[2])", "512"), "--mode", "fake")
    assert code == EXIT_OK, err
    code, doc, err = estimate(capsys, tmp_path, parent, "--mode", "fake")
    assert code == EXIT_OK, err
    assert doc["mode"] == "fake" and doc["iterations"] == 3
    assert [t["peak_allocated_bytes"] for t in doc["targets"]] == \
        [t["peak_allocated_bytes"] for t in direct["targets"]]


def test_only_this_interpreter_on_a_script_or_module_is_taken_in(tmp_path):
    import sys

    script = tmp_path / "s.py"
    script.write_text("pass\n")
    assert python_child([sys.executable, str(script), "--a"]) == ("path", str(script), ["--a"])
    assert python_child([sys.executable, "-u", "-m", "pkg.train", "x"]) == ("module", "pkg.train", ["x"])
    assert python_child([sys.executable, "-c", "print(1)"]) is None
    assert python_child(["/bin/echo", str(script)]) is None
    assert python_child(f"{sys.executable} {script}") is None  # a shell string is left to the shell
    assert python_child([sys.executable, str(tmp_path / "absent.py")]) is None
