"""Activation checkpointing in a job given as its launcher line (torchrun, accelerate launch).

Under a launcher line the backward pass runs with the device presenter pushed (FSDP2's gathers need it), so
the non-reentrant checkpoint's recomputation asked the presenter for each saved tensor's device ("cuda")
while the forward had recorded the storage's ("meta"): every checkpointed job launched that way failed in
fake mode with "Recomputed values ... have different metadata" (diffusers' train_text_to_image.py under
``accelerate launch --mixed_precision=fp16``; the same script as ``python ... --mixed_precision=fp16`` worked).
"""

from __future__ import annotations

import pytest
from estimator_run import estimate

from gpushare.estimator_cli.cli import EXIT_OK

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

CHECKPOINTED = """
import torch
from torch.utils.checkpoint import checkpoint

model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)).cuda()
opt = torch.optim.AdamW(model.parameters())
for step in range(4):
    with torch.autocast("cuda", dtype=torch.float16):
        y = checkpoint(model, torch.randn(64, 256, device="cuda"), use_reentrant=False)
    y.float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize("launcher", [("torchrun", "--nproc_per_node=1"), ("accelerate", "launch")],
                         ids=["torchrun", "accelerate-launch"])
def test_checkpointed_job_under_a_launcher_is_estimated_as_without_it(capsys, tmp_path, launcher):
    code, plain, err = estimate(capsys, tmp_path, CHECKPOINTED, "--mode", "fake")
    assert code == EXIT_OK, err
    code, launched, err = estimate(capsys, tmp_path, CHECKPOINTED, "--mode", "fake", *launcher)
    assert code == EXIT_OK, err
    assert launched["mode"] == "fake" and launched["iterations"] == 3
    assert [t["peak_allocated_bytes"] for t in launched["targets"]] == \
        [t["peak_allocated_bytes"] for t in plain["targets"]]
