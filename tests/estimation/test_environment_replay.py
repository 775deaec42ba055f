"""The batch script's environment lines: found (root side, text only) and replayed by real bash (user side).

The replay runs the estimation job's real wrapper script with bash, with a stand-in estimator that reports
what it was given (its arguments, PATH, the variables the replay set, its directory), so the order, the
failures and the line that ends the shell are checked without a cluster; tests/estimation/test_user_env_slurm.py
runs the same on real Slurm with the real gpu-estimate.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

from gpushare.config import parse_config
from gpushare.slurm_plugins import estimation_result
from gpushare.estimate.environment_replay import Environment, Unreproducible, find_environment
from gpushare.slurm_plugins.estimation_plan import HeldJob
from gpushare.slurm_plugins.estimationd import EstimationService
from gpushare.estimate.script_discovery import TrainingCommand, find_training_command

SITE_SCRIPT = """#!/bin/bash -l
#SBATCH --gres=gpu:1
set -euo pipefail
module purge
module load cuda/12.4 pytorch/2.5
source ~/venvs/llm/bin/activate
eval "$(conda shell.bash hook)"
conda activate proj
export HF_HOME=/scratch/$USER/hf
DATA=/scratch/$USER/data
cd $SLURM_SUBMIT_DIR
cp -r /datasets/imagenet $TMPDIR/
if [ -n "${DEBUG:-}" ]; then
  export TORCH_SHOW_CPP_STACKTRACES=1
fi
cat > config.yaml <<EOF
export NOT_A_LINE=1
EOF
srun python train.py --data $DATA
export AFTER=1
"""


def test_environment_lines_in_order_up_to_the_training() -> None:
    command = find_training_command(SITE_SCRIPT)
    assert isinstance(command, TrainingCommand) and command.interpreter == "python" and command.line == 19
    found = find_environment(SITE_SCRIPT, command.line)
    assert isinstance(found, Environment) and found.login
    assert [(line.number, line.text.split()[0]) for line in found.lines] == [
        (3, "set"), (4, "module"), (5, "module"), (6, "source"), (7, "eval"), (8, "conda"), (9, "export"),
        (10, "DATA=/scratch/$USER/data"), (11, "cd")]
    assert found.notes == ("line 14 inside a block: not replayed",)


def test_launcher_words_name_the_interpreter() -> None:
    for line, word in [("torchrun --standalone train.py", "torchrun"), ("$VENV/bin/python -u train.py", "$VENV/bin/python"),
                       ("srun -n1 accelerate launch --num_processes 1 train.py", "accelerate"),
                       ("OMP_NUM_THREADS=4 exec python3 -m torch.distributed.run train.py", "python3")]:
        command = find_training_command(f"#!/bin/sh\n{line}\n")
        assert isinstance(command, TrainingCommand) and command.interpreter == word, line


def test_environments_that_cannot_be_replayed_name_the_line() -> None:
    nested = "#!/bin/bash\nif [ -d ~/venv ]; then\n  source ~/venv/bin/activate\nfi\npython train.py\n"
    found = find_environment(nested, 5)
    assert isinstance(found, Unreproducible) and found.reason.startswith("line 3 (source ~/venv/bin/activate)")
    zsh = "#!/bin/zsh\nsource ~/venv/bin/activate\npython train.py\n"
    found = find_environment(zsh, 3)
    assert isinstance(found, Unreproducible) and "line 2" in found.reason and "zsh" in found.reason
    many = "#!/bin/sh\n" + "export A=1\n" * 65 + "python train.py\n"
    found = find_environment(many, 67)
    assert isinstance(found, Unreproducible) and found.reason.startswith("line 66: more than 64")


def run_wrapper(tmp_path: Path, batch_script: str) -> tuple[int, dict, str]:
    """The estimation job's script for ``batch_script``, run with bash as this user; returns its exit status,
    what its Comment would carry and what the stand-in estimator saw."""
    estimator = tmp_path / "estimator"
    seen = tmp_path / "seen.txt"  # what the stand-in estimator saw (the job's own files are gone at its end)
    estimator.write_text(f'#!/bin/sh\n{{ echo "args=$*"\necho "pwd=$(pwd)"\necho "path=$PATH"\n'
                         'echo "hf=${HF_HOME-} pythonpath=${PYTHONPATH-} child=${GPUSHARE_CHILD_PYTHONPATH-}"; }'
                         f' > {seen}\n')
    estimator.chmod(0o755)
    cfg = parse_config({"estimation": {"partition": "cpu", "spool_dir": str(tmp_path / "spool"),
                                       "command": str(estimator)}, "nodes": [{"names": "n1", "gpu": "a100-40gb"}]})
    client = SimpleNamespace(run=lambda *args, **kwargs: batch_script)  # scontrol write batch_script
    svc = EstimationService(cfg, client=client, clock=lambda: 1000.0)  # type: ignore[arg-type]
    _, command = svc._discover(5, os.getuid(), str(tmp_path))
    wrapper = tmp_path / "wrapper.sh"
    wrapper.write_text(svc.wrapper(HeldJob(5, os.getuid(), os.getgid(), 990.0, {}, str(tmp_path), "k", command),
                                   command))
    proc = subprocess.run(["bash", str(wrapper)], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path)})
    lines = [line for line in proc.stdout.splitlines() if line.startswith(estimation_result.PREFIX)]
    report = estimation_result.parse(lines[-1]) if lines else None  # what the job's Comment would carry
    assert report is not None, proc.stdout + proc.stderr
    assert not list(tmp_path.glob("gpushare-estimate.*"))  # the node's private directory is removed
    return proc.returncode, report, seen.read_text() if seen.exists() else ""


def test_replay_runs_the_lines_then_the_estimator_with_the_training_interpreter(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'export VIRTUAL_ENV={venv}\nexport PATH="$VIRTUAL_ENV/bin:$PATH"\n')
    (tmp_path / "sub").mkdir()
    script = (f"#!/bin/bash\nsource {venv}/bin/activate\nexport HF_HOME=/scratch/hf PYTHONPATH=/opt/mods\n"
              "cd sub\nfalse_command_that_is_not_replayed\npython train.py --bs 4\n")
    code, report, result = run_wrapper(tmp_path, script)
    assert code == 0 and report["exit"] == 0
    assert f"path={venv}/bin:" in result and f"pwd={tmp_path}/sub" in result
    assert "hf=/scratch/hf pythonpath= child=/opt/mods" in result  # the user's PYTHONPATH is the child's only
    assert "--python python train.py --bs 4" in result and "--own-python-if-unusable" not in result
    assert "env_failed" not in report


def test_a_failing_line_is_named_and_one_that_ends_the_shell_stops_the_replay(tmp_path: Path) -> None:
    code, report, result = run_wrapper(tmp_path, "#!/bin/sh\nmodule load nosuch/1.0\npython3 train.py\n")
    assert code == 0 and report["env_failed"] == 2 and "--python python3" in result
    strict = tmp_path / "strict"
    strict.mkdir()
    code, report, result = run_wrapper(strict, "#!/bin/bash\nset -e\nsource /nonexistent/activate\npython train.py\n")
    assert code == 91 and result == "" and report["env_line"] == 3 and report["exit"] == 91


def test_no_environment_lines_let_a_bare_python_fall_back_to_ours(tmp_path: Path) -> None:
    code, _, result = run_wrapper(tmp_path, "#!/bin/sh\npython train.py\n")
    assert code == 0 and "--python python --own-python-if-unusable train.py" in result


def test_the_interpreter_named_in_a_result_is_checked_before_it_enters_a_record() -> None:
    """result.json is the user's file: only an absolute, printable path and version-shaped versions pass."""
    from gpushare.slurm_plugins.estimationd import _interpreter_of

    good = {"python": {"executable": "/home/ana/venv/bin/python", "python_version": "3.11.2",
                       "torch_version": "2.5.1+cu124"}}
    assert _interpreter_of(good) == "/home/ana/venv/bin/python (Python 3.11.2, PyTorch 2.5.1+cu124)"
    assert _interpreter_of({"python": {"executable": "/x\n\"decision\":\"shared\""}}) is None
    assert _interpreter_of({"python": {"executable": "relative/python"}}) is None
    assert _interpreter_of({"python": {"executable": "/p/" + "a" * 300}}) is None
    assert _interpreter_of({"python": {"executable": "/usr/bin/python3", "python_version": ["3"],
                                       "torch_version": "2.5 (evil) text"}}) == "/usr/bin/python3 (Python ?, PyTorch ?)"
    assert _interpreter_of([]) is None and _interpreter_of({"python": "x"}) is None


def test_a_training_script_run_by_its_own_first_line(tmp_path: Path) -> None:
    """`./train.py`: the script is the launcher; gpu-estimate --python follows its #! line."""
    command = find_training_command("#!/bin/bash\nsource ~/venv/bin/activate\nsrun ./train.py --bs 8\n")
    assert isinstance(command, TrainingCommand) and command.how == "shebang" and command.interpreter == "./train.py"
    assert (command.script, command.args) == ("./train.py", ("--bs", "8"))
    _, _, result = run_wrapper(tmp_path, "#!/bin/sh\nexport A=1\n./train.py\n")
    assert "--python ./train.py ./train.py" in result
