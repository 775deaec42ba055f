"""Lazy modules in fake mode: ``nn.LazyLinear``, ``nn.LazyBatchNorm1d`` and PyTorch Geometric's ``-1`` input
sizes leave their parameters and buffers uninitialized until the first forward. Moved to the GPU before
that, they must stay uninitialized (as a real ``.cuda()`` leaves them), materialize on the GPU, and be counted
as the same parameters an eagerly sized model has."""

from __future__ import annotations

import pytest
from estimator_run import estimate

from gpushare.estimator_cli.cli import EXIT_OK

pytestmark = pytest.mark.torch

MODEL = """
    import torch, torch.nn as nn
    lazy = {lazy}
    if lazy:
        model = nn.Sequential(nn.LazyLinear(1024), nn.LazyBatchNorm1d(), nn.ReLU(), nn.LazyLinear(10))
    else:
        model = nn.Sequential(nn.Linear(512, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 10))
    model = model.{move}
    opt = None
    for step in range(5):
        out = model(torch.randn(64, 512).cuda())
        if opt is None:                       # after the first forward, as lazy modules must be
            opt = torch.optim.AdamW(model.parameters())
        out.sum().backward()
        opt.step()
        opt.zero_grad()
    assert model[0].weight.shape == (1024, 512) and model[1].running_mean.shape == (1024,)
"""


@pytest.mark.parametrize("move", ["cuda()", "to(torch.device('cuda'))", "to(device='cuda')"])
def test_a_lazy_model_moved_to_the_gpu_is_estimated_as_its_eager_twin(capsys, tmp_path, move):
    code, doc, err = estimate(capsys, tmp_path, MODEL.format(lazy=True, move=move), "--mode", "fake")
    assert code == EXIT_OK, err
    twin_code, twin, twin_err = estimate(capsys, tmp_path, MODEL.format(lazy=False, move=move), "--mode", "fake")
    assert twin_code == EXIT_OK, twin_err
    assert doc is not None and twin is not None and doc["mode"] == "fake"
    mine, theirs = doc["targets"][0], twin["targets"][0]
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "persistent_bytes"):
        assert mine[key] == theirs[key], key
