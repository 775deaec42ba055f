"""A barrier with ``device_ids`` under a launcher line (accelerate's ``wait_for_everyone`` calls
``torch.distributed.barrier(device_ids=[local_rank])``): the fake process group ignores the device, which
profile mode's CPU build does not have (estimator_cli/fake_distributed.py)."""

from __future__ import annotations

import json
import textwrap

import pytest

from gpushare.estimator_cli.cli import EXIT_OK, main

pytestmark = pytest.mark.torch

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "GPUSHARE_ESTIMATE_WORLD_SIZE", "GPUSHARE_ESTIMATE_DEVICES")

BARRIER = """
    import os, torch, torch.distributed as dist
    local = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("nccl")
    torch.cuda.set_device(local)
    dist.barrier(device_ids=[local])
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        model(torch.randn(32, 256).cuda()).sum().backward()
        opt.step()
        opt.zero_grad()
        dist.barrier(device_ids=[local])
"""


@pytest.mark.parametrize("mode", ["profile", "fake"])
def test_a_barrier_on_a_device_passes_in_both_modes(capsys, monkeypatch, tmp_path, mode):
    for name in LAUNCHER_VARS:  # what gpu-estimate sets for a launcher line is undone after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(BARRIER))
    capsys.readouterr()
    code = main(["--json", "--no-cache", "--no-warm", "--gpu", "a100-40gb", "--mode", mode,
                 "torchrun", "--nproc_per_node=1", str(script)])
    out, err = capsys.readouterr()
    assert code == EXIT_OK, err
    doc = json.loads(out)
    assert doc["mode"] == mode and doc["iterations"] == 3
