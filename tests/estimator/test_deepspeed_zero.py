"""DeepSpeed ZeRO stages 1-3 estimated per rank in fake mode (estimator_cli/deepspeed_fake.py) from the launcher
line as a batch script has it: ``deepspeed --num_gpus=N train.py ...`` and ``torchrun --nproc_per_node=N ...``.

The script is benchmarks/current_jobs/deepspeed_zero.py (6 linear layers of 2048: P = 96 MiB of fp32
parameters, AdamW). ZeRO divides by the world size what its stage partitions (stage 1: optimizer state and
DeepSpeed's fp32 master copy, 3P; stage 2: + gradients, 4P; stage 3: + parameters, 5P), so rank 0's peak
falls with N by at least 7/8 of that from 1 to 8 ranks. At one rank ZeRO partitions nothing, and the peak is
the plain single-process loop's plus DeepSpeed's own buffers: the fp32 master copy of the parameters (P),
and at stage 3 also the flattened gradient partition handed to the optimizer (P) and a reduce bucket."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest

from gpushare.estimator_cli.cli import EXIT_OK, main
from gpushare.estimator_cli.launch_line import LaunchLineError, parse

pytestmark = pytest.mark.torch  # starts gpu-estimate captures: torch in a child process

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "current_jobs" / "deepspeed_zero.py"
P = 6 * (2048 * 2048 + 2048) * 4 + (2048 * 10 + 10) * 4  # fp32 parameter bytes
BUCKET = 5_000_000 * 4  # the script's reduce_bucket_size, fp32
PLAIN = """
    import torch, torch.nn as nn
    class Net(nn.Module):
        def __init__(self, width, layers):
            super().__init__()
            self.body = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)])
            self.head = nn.Linear(width, 10)
        def forward(self, x):
            return self.head(self.body(x))
    net = Net(2048, 6).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.01)
    criterion = nn.CrossEntropyLoss()
    for step in range(10):
        x = torch.randn(16, 2048, device="cuda")
        y = torch.randint(0, 10, (16,), device="cuda")
        loss = criterion(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
"""


@pytest.mark.parametrize("line, script, args, world, local", [
    ("deepspeed --num_gpus=8 train.py --deepspeed --deepspeed_config ds.json", "train.py",
     ["--local_rank=0", "--deepspeed", "--deepspeed_config", "ds.json"], 8, 8),
    ("deepspeed --num_nodes 2 --num_gpus 4 --master_port 29501 train.py", "train.py", ["--local_rank=0"], 8, 4),
    ("deepspeed --no_local_rank --num_gpus=2 train.py --x", "train.py", ["--x"], 2, 2),
    ("srun deepspeed --num_gpus=4 train.py", "train.py", ["--local_rank=0"], 4, 4),
])
def test_deepspeed_launch_lines(line, script, args, world, local):
    parsed = parse(line.split())
    assert (parsed.script, parsed.args, parsed.world_size, parsed.local_world_size) == (script, args, world, local)


@pytest.mark.parametrize("line, what", [
    ("deepspeed --no_python no-such-trainer-command", "neither a file nor a command"),
    ("deepspeed --include localhost:0,1 train.py", "--num_gpus"),
    ("deepspeed --num_gpus=two train.py", "not a count"),
])
def test_unreadable_deepspeed_lines(line, what):
    with pytest.raises(LaunchLineError, match=what):
        parse(line.split())


_plain: list[int] = []


def _peak(capsys, monkeypatch, *line: str) -> int:
    """Rank 0's allocated peak on an A100 (the launcher's variables set in this process are undone after)."""
    if importlib.util.find_spec("deepspeed") is None:  # found, not imported: only the capture child imports it
        pytest.skip("DeepSpeed is not installed (pip install deepspeed, or the test extra)")
    for name in ("RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "GPUSHARE_ESTIMATE_WORLD_SIZE", "GPUSHARE_ESTIMATE_DEVICES", "DS_ACCELERATOR"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    capsys.readouterr()
    code = main(["--json", "--no-cache", "--no-warm", "--mode", "fake", "--gpu", "a100-40gb", *line])
    out, err = capsys.readouterr()
    assert code == EXIT_OK, err
    document = json.loads(out)
    assert document["mode"] == "fake"
    return int(document["targets"][0]["peak_allocated_bytes"])


def _plain_peak(capsys, monkeypatch, tmp_path: Path) -> int:
    if not _plain:
        plain = tmp_path / "plain.py"
        plain.write_text(textwrap.dedent(PLAIN))
        _plain.append(_peak(capsys, monkeypatch, str(plain)))
    return _plain[0]


@pytest.mark.parametrize("stage, sharded, extra", [(1, 3, P), (2, 4, P), (3, 5, 2 * P + BUCKET)])
def test_zero_per_rank(capsys, monkeypatch, tmp_path, stage, sharded, extra):
    """The per-rank peak falls with the world size as the stage partitions; at one rank it is the plain loop's
    plus DeepSpeed's own buffers (``extra``), within 3 %."""
    peaks = {n: _peak(capsys, monkeypatch, "deepspeed", f"--num_gpus={n}", str(SCRIPT), "--stage", str(stage))
             for n in (1, 8)}
    plain = _plain_peak(capsys, monkeypatch, tmp_path)
    assert abs(peaks[1] - (plain + extra)) / plain < 0.03, (peaks, plain)
    assert peaks[1] - peaks[8] >= 0.8 * (7 / 8) * sharded * P, peaks


def test_zero_launch_forms_agree(capsys, monkeypatch, tmp_path):
    """torchrun and the deepspeed launcher give the same rank the same peak; a JSON config file read through
    ``--deepspeed_config`` and the script's own config dict agree; so do DeepSpeed's optimizer section
    (``torch_adam``), torch's AdamW handed to ``deepspeed.initialize``, and DeepSpeed's FusedAdam (a CUDA op
    that is never built here: torch's fused AdamW stands in; at stage 2 the optimizer steps on one flat
    partition, so foreach and fused implementations leave the same peak, but for fused's step counters)."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 16, "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True,
                              "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6}}))
    launcher = _peak(capsys, monkeypatch, "deepspeed", "--num_gpus=2", str(SCRIPT), "--stage", "2")
    torchrun = _peak(capsys, monkeypatch, "torchrun", "--nproc_per_node=2", str(SCRIPT), "--stage", "2")
    from_file = _peak(capsys, monkeypatch, "deepspeed", "--num_gpus=2", str(SCRIPT), "--deepspeed",
                      "--deepspeed_config", str(config))
    client = _peak(capsys, monkeypatch, "deepspeed", "--num_gpus=2", str(SCRIPT), "--stage", "2",
                   "--optimizer", "client")
    fused = _peak(capsys, monkeypatch, "deepspeed", "--num_gpus=2", str(SCRIPT), "--stage", "2", "--optimizer", "fused")
    assert launcher == torchrun == from_file == client
    assert abs(fused - launcher) < 4096, (fused, launcher)  # fused keeps its step counters on the GPU
