"""Finding the training command in realistic batch scripts (what the asynchronous estimation replays)."""

from __future__ import annotations

import pytest

from gpushare.estimate.script_discovery import NotFound, TrainingCommand, describe, find_training_command

HPC_SITE = """#!/bin/bash
#SBATCH --job-name=resnet
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=8
#SBATCH --time=12:00:00
#SBATCH --output=logs/%x-%j.out

set -euo pipefail
module purge
module load cuda/12.1 python/3.11
source $HOME/venvs/torch/bin/activate
export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK

nvidia-smi
python -c "import torch; print(torch.cuda.is_available())"
python train.py --data /scratch/$USER/imagenet --epochs 90 --batch-size 256
"""

VARIABLES = """#!/bin/bash
#SBATCH --gres=gpu:1
BS=128
LR=0.1
CONFIG="configs/gpt2-small.yaml"
srun --cpu-bind=cores -n 1 python3 -u scripts/train_gpt.py --config $CONFIG --bs ${BS} --lr $LR \\
    --seed $SLURM_ARRAY_TASK_ID 2>&1 | tee run.log
"""

TORCHRUN = """#!/bin/bash
#SBATCH --gres=gpu:1
export NCCL_DEBUG=INFO
torchrun --standalone --nnodes=1 --nproc_per_node 1 \\
    train.py \\
    --model vit_b_16 \\
    --amp
"""

TORCH_DISTRIBUTED_RUN = """#!/bin/sh
#SBATCH --gres=gpu:1
python -m torch.distributed.run --nproc_per_node=1 --master_port 29501 finetune.py --epochs 3
"""

ACCELERATE = """#!/bin/bash
#SBATCH --gres=gpu:1
cd $SLURM_SUBMIT_DIR
accelerate launch --mixed_precision bf16 --num_processes 1 --multi_gpu run_clm.py \\
  --model_name_or_path gpt2 --per_device_train_batch_size 8
"""

PREP_THEN_TRAIN = """#!/bin/bash
#SBATCH --gres=gpu:1
python prepare_data.py --out data/
CUDA_VISIBLE_DEVICES=0 exec /opt/conda/envs/ml/bin/python3.11 -W ignore -u train.py --resume > train.log
"""


@pytest.mark.parametrize("script, expected", [
    (HPC_SITE, TrainingCommand("train.py", ("--data", "/scratch/$USER/imagenet", "--epochs", "90",
                                            "--batch-size", "256"), "python", 16)),
    (TORCHRUN, TrainingCommand("train.py", ("--model", "vit_b_16", "--amp"), "torchrun", 4)),
    (TORCH_DISTRIBUTED_RUN, TrainingCommand("finetune.py", ("--epochs", "3"), "torchrun", 3)),
    (ACCELERATE, TrainingCommand("run_clm.py", ("--model_name_or_path", "gpt2", "--per_device_train_batch_size",
                                                "8"), "accelerate", 4)),
])
def test_realistic_batch_scripts(script, expected):
    found = find_training_command(script)
    assert isinstance(found, TrainingCommand)
    assert (found.script, found.args, found.how, found.line) == (expected.script, expected.args, expected.how,
                                                                 expected.line)


def test_unresolved_variables_are_reported():
    found = find_training_command(HPC_SITE)
    assert "$USER left unresolved" in found.notes


def test_assigned_variables_are_substituted_and_redirections_dropped():
    found = find_training_command(VARIABLES)
    assert found.script == "scripts/train_gpt.py" and found.line == 6
    assert found.args == ("--config", "configs/gpt2-small.yaml", "--bs", "128", "--lr", "0.1",
                          "--seed", "$SLURM_ARRAY_TASK_ID")
    assert "$SLURM_ARRAY_TASK_ID left unresolved" in found.notes


def test_last_python_command_wins_and_the_choice_is_reported():
    found = find_training_command(PREP_THEN_TRAIN)
    assert found.script == "train.py" and found.args == ("--resume",) and found.line == 4
    assert any("used the last" in note for note in found.notes)


def test_directive_names_the_script_and_takes_the_arguments_of_its_line():
    script = "#GPUSHARE script=train.py\n" + PREP_THEN_TRAIN
    found = find_training_command(script, "train.py")
    assert found.how == "directive" and found.args == ("--resume",)
    alone = find_training_command("#!/bin/sh\n./launch.sh\n", "model/train.py")
    assert alone.script == "model/train.py" and alone.args == () and alone.notes


@pytest.mark.parametrize("script, needle", [
    ("#!/bin/bash\n./run.sh --gpu\n", "no 'python train.py'"),
    ("#!/bin/bash\npython -m 'not a module'\n", "not a module name"),
    ("#!/bin/bash\npython -c 'print(1)'\n", "no 'python train.py'"),
    ("#!/bin/bash\ntorchrun --standalone\n", "without a script"),
    ("#!/bin/bash\npython $SCRIPT --x\n", "unknown variable"),
    ("#!/bin/bash\napptainer exec img.sif python train.py\n", "no 'python train.py'"),
    ("", "no 'python train.py'"),
])
def test_not_found_says_why_and_names_the_fix(script, needle):
    found = find_training_command(script)
    assert isinstance(found, NotFound)
    assert needle in found.reason and "#GPUSHARE script=" in found.reason


def test_hostile_text_never_raises():
    for script in ['python "unterminated', "\\\n" * 1000, "python \x00 train.py", "srun -n", "python -W",
                   "torchrun --nproc_per_node", "A=1 B=2", "python3 ''", "\udcff python train.py"]:
        find_training_command(script)


def test_describe_is_one_short_line():
    text = describe(TrainingCommand("train.py", ("--x",) * 200, "torchrun", 4))
    assert "\n" not in text and text.endswith("(torchrun, line 4)") and len(text) < 160


@pytest.mark.parametrize("body, launcher", [
    ("N=4\nsrun -n $N python -u train.py --bs 8", ("srun", "-n", "4", "python", "-u")),
    ("torchrun --standalone --nnodes=1 --nproc-per-node 8 train.py", ("torchrun", "--standalone", "--nnodes=1",
                                                                      "--nproc-per-node", "8")),
    ("python -m torch.distributed.run --nproc_per_node=2 train.py", ("python", "-m", "torch.distributed.run",
                                                                    "--nproc_per_node=2")),
    ("accelerate launch --num_processes 2 train.py a", ("accelerate", "launch", "--num_processes", "2")),
    ("python train.py --x", ()),
])
def test_launcher_words_go_with_the_command(body, launcher):
    """gpu-estimate reads the world size from the launcher line, so the estimation job passes it through."""
    found = find_training_command("#!/bin/bash\n" + body + "\n")
    assert isinstance(found, TrainingCommand) and found.script == "train.py"
    assert found.launcher == launcher


@pytest.mark.parametrize("body, script, args, how, launcher, interpreter", [
    ("python -m mypackage.train --epochs 3", "mypackage.train", ("--epochs", "3"), "module", ("python", "-m"),
     "python"),
    ("srun -n 2 python3 -u -m pkg.train --x", "pkg.train", ("--x",), "module",
     ("srun", "-n", "2", "python3", "-u", "-m"), "python3"),
    ("torchrun --nproc_per_node 2 -m pkg.train --y", "pkg.train", ("--y",), "torchrun",
     ("torchrun", "--nproc_per_node", "2", "-m"), "torchrun"),
    ("deepspeed --num_gpus 2 train.py --deepspeed ds.json", "train.py", ("--deepspeed", "ds.json"), "deepspeed",
     ("deepspeed", "--num_gpus", "2"), "deepspeed"),
    ("lightning run model --devices 2 train.py", "train.py", (), "fabric",
     ("lightning", "run", "model", "--devices", "2"), "lightning"),
    ("fabric run --devices 2 t.py --z", "t.py", ("--z",), "fabric", ("fabric", "run", "--devices", "2"), "fabric"),
    ("module load cuda\nlitgpt download m\nlitgpt finetune_lora checkpoints/m --data Alpaca\necho done\nwait",
     "litgpt", ("finetune_lora", "checkpoints/m", "--data", "Alpaca"), "command", (), "litgpt"),
    ("MODEL=yolo11n.pt\nyolo train data=coco8.yaml model=$MODEL epochs=3 2>&1 | tee log", "yolo",
     ("train", "data=coco8.yaml", "model=yolo11n.pt", "epochs=3"), "command", (), "yolo"),
    ("tune run lora_finetune_single_device --config llama3/8B_lora_single_device", "tune",
     ("run", "lora_finetune_single_device", "--config", "llama3/8B_lora_single_device"), "command", (), "tune"),
])
def test_modules_launchers_and_console_scripts(body, script, args, how, launcher, interpreter):
    """What gpu-estimate accepts as a user types it, the estimation job gets from the batch script: the
    launcher words and the command go through whole (a console script is resolved by gpu-estimate)."""
    found = find_training_command(HPC_SITE.split("nvidia-smi")[0] + body + "\n")
    assert isinstance(found, TrainingCommand)
    assert (found.script, found.args, found.how, found.launcher, found.interpreter) == \
        (script, args, how, launcher, interpreter)


def test_a_console_script_only_when_no_python_line_and_never_a_utility():
    assert find_training_command("#!/bin/bash\nlitgpt download m\npython train.py\nyolo val\n").script == "train.py"
    for body in ("echo start\nnvidia-smi\nsleep 10", "./run.sh --gpu", "apptainer exec i.sif python t.py",
                 "conda activate ml\nwandb login\nhuggingface-cli download m", "bash run.sh", "$TRAINER --x"):
        assert isinstance(find_training_command("#!/bin/bash\n" + body + "\n"), NotFound), body
