"""Launcher lines as batch scripts have them (torchrun, python -m torch.distributed.run, accelerate launch,
srun): the script and world size read from the line, and the per-rank estimate of a DDP and an FSDP2 job
made in one CPU process under PyTorch's fake process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpushare.estimator_cli.cli import EXIT_OK, EXIT_USAGE, main
from gpushare.estimator_cli.launch_line import LaunchLineError, parse, rank_zero_env

pytestmark = pytest.mark.torch  # starts gpu-estimate captures: torch in a child process or the warm worker

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("line, script, args, world, local", [
    ("torchrun --nproc_per_node=4 train.py --lr 1e-4", "train.py", ["--lr", "1e-4"], 4, 4),
    ("torchrun --standalone --nnodes=1 --nproc-per-node 8 train.py", "train.py", [], 8, 8),
    ("torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend c10d --rdzv-endpoint h:29400 t.py -x", "t.py", ["-x"], 8, 4),
    ("python -m torch.distributed.run --nproc_per_node 2 train.py", "train.py", [], 2, 2),
    ("python3 -u -m torch.distributed.launch --nproc_per_node=2 train.py", "train.py", [], 2, 2),
    ("accelerate launch --num_processes 4 --multi_gpu --mixed_precision bf16 train.py --bs 8", "train.py",
     ["--bs", "8"], 4, 4),
    ("accelerate launch train.py", "train.py", [], 1, 1),
    ("srun -n 4 --gpus-per-task=1 python train.py --epochs 1", "train.py", ["--epochs", "1"], 4, 4),
    ("srun --ntasks=2 -l python -u train.py", "train.py", [], 2, 2),
    ("srun torchrun --nproc_per_node=4 train.py", "train.py", [], 4, 4),
    ("python train.py --a", "train.py", ["--a"], 1, 1),
])
def test_launch_lines(line, script, args, world, local):
    parsed = parse(line.split())
    assert (parsed.script, parsed.args, parsed.world_size, parsed.local_world_size) == (script, args, world, local)
    env = rank_zero_env(parsed)
    assert env["RANK"] == env["LOCAL_RANK"] == "0" and env["WORLD_SIZE"] == str(world)


@pytest.mark.parametrize("line, what", [
    ("torchrun --nproc_per_node=x train.py", "not a count"),
    ("torchrun --no-python no-such-trainer-command", "neither a file nor a command"),
    ("accelerate config", "accelerate launch"),
    ("torchrun --nproc_per_node=2", "no training script"),
])
def test_unreadable_launch_lines(line, what):
    with pytest.raises(LaunchLineError, match=what):
        parse(line.split())


def test_unreadable_line_is_one_line(capsys):
    assert main(["--no-cache", "torchrun", "--nproc_per_node=x", "train.py"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not a count" in err


def _peak(capsys, monkeypatch, *line: str) -> int:
    """Rank 0's allocated peak on an A100 (the launcher's variables are set in this process: undone after)."""
    for name in ("RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "GPUSHARE_ESTIMATE_WORLD_SIZE", "GPUSHARE_ESTIMATE_DEVICES"):
        monkeypatch.setenv(name, "")  # recorded, so what gpu-estimate sets is undone after the test
        monkeypatch.delenv(name)
    capsys.readouterr()
    code = main(["--json", "--no-cache", "--no-warm", "--mode", "fake", "--gpu", "a100-40gb", *line])
    out, err = capsys.readouterr()
    assert code == EXIT_OK, err
    return int(json.loads(out)["targets"][0]["peak_allocated_bytes"])


def test_ddp_per_rank(capsys, monkeypatch):
    """DDP keeps a full replica per rank: the same per-rank peak at any world size. Its gradient buckets
    (25 MiB cap) copy the gradients unless gradient_as_bucket_view; with the view, world size 1 is the plain
    single-process run."""
    ddp = str(EXAMPLES / "ddp_train.py")
    plain = _peak(capsys, monkeypatch, ddp)
    viewed = _peak(capsys, monkeypatch, "torchrun", "--nproc_per_node=1", ddp, "--bucket-view")
    assert abs(viewed - plain) / plain < 0.03
    peaks = {n: _peak(capsys, monkeypatch, "torchrun", f"--nproc_per_node={n}", ddp) for n in (1, 2, 8)}
    assert peaks[1] == peaks[2] == peaks[8]
    gradients = 6 * (2048 * 2048 + 2048) * 4
    assert peaks[1] - plain >= 0.9 * gradients  # the buckets


def test_ddp_buckets_in_profile_mode(capsys, monkeypatch):
    """Profile mode sees DDP's buckets too (allocated in C++ by its Reducer at construction, on the CPU there):
    at the peak, gradients twice over — the parameters' own and the buckets' copy."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GPUSHARE_ESTIMATE_WORLD_SIZE", "GPUSHARE_ESTIMATE_DEVICES"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    capsys.readouterr()
    code = main(["--json", "--no-cache", "--no-warm", "--mode", "profile", "--gpu", "a100-40gb", "torchrun",
                 "--nproc_per_node=2", str(EXAMPLES / "ddp_train.py"), "--steps", "3", "--width", "1024"])
    out, err = capsys.readouterr()
    assert code == EXIT_OK, err
    by_kind = {k["name"]: k["bytes"] for k in json.loads(out)["targets"][0]["by_kind"]}
    parameters = 6 * (1024 * 1024 + 1024) * 4
    assert by_kind["parameter"] >= parameters and by_kind["gradient"] >= 1.9 * parameters, by_kind


def test_fsdp_per_rank_shrinks_with_world_size(capsys, monkeypatch):
    fsdp = str(EXAMPLES / "fsdp_train.py")
    peaks = [_peak(capsys, monkeypatch, "torchrun", "--standalone", "--nnodes=1", "--nproc-per-node", str(n), fsdp)
             for n in (1, 2, 8)]
    assert peaks[0] > peaks[1] > peaks[2]
    # parameters, gradients and AdamW's two states: 16 bytes per parameter, sharded 8 ways at world size 8
    assert peaks[0] - peaks[2] >= 0.8 * (7 / 8) * 16 * 6 * 2048 * 2048
