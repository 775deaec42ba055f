"""Fake mode keeps the script's own ``meta`` tensors out of GPU memory (estimator_cli/fake_capture.py).

transformers and accelerate build a model's skeleton on ``meta`` before loading its weights; fake mode's GPU
tensors are meta tensors too, and it used to count a 1 GiB skeleton as 1 GiB of GPU memory. A skeleton put
on the GPU (``to_empty(device="cuda")``, ``.to("cuda")``) is a real allocation and still counts.
"""

from __future__ import annotations

import textwrap

import pytest

from gpushare.estimator_cli.cli import EXIT_OK
from estimator_run import estimate

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch  # starts gpu-estimate captures in-process

SMALL_TRAINING = """
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)).cuda()
    assert model[0].weight.device.type == "cuda" and model[0].weight.is_cuda
    opt = torch.optim.AdamW(model.parameters())
    for step in range(3):
        model(torch.randn(64, 1024, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
"""

SKELETON = """
    with torch.device("meta"):                              # 1 GiB of float32
        skeleton = torch.nn.Linear(16384, 16384)
    head = torch.nn.Linear(8192, 8192, device="meta")       # 256 MiB
    host = torch.nn.Linear(4096, 4096).to("meta")           # accelerate's init_empty_weights
    scratch = torch.empty(8192, 8192, device="meta")
    derived = [skeleton.weight.t().contiguous(), torch.zeros_like(head.weight), scratch * 2]
    for t in (skeleton.weight, head.weight, host.weight, scratch, *derived):
        assert t.device.type == "meta" and not t.is_cuda, t.device
"""

MiB = 2**20


def _peak(capsys, tmp_path, source: str) -> int:
    code, doc, err = estimate(capsys, tmp_path, "import torch\n" + textwrap.dedent(source), "--mode", "fake")
    assert code == EXIT_OK, err
    assert doc is not None and doc["mode"] == "fake"
    return int(doc["targets"][0]["peak_allocated_bytes"])


def test_a_meta_skeleton_costs_no_gpu_memory(capsys, tmp_path):
    """Over 1.5 GiB of skeleton on meta beside a 4 MiB model on the GPU: the estimate is the small model's."""
    alone = _peak(capsys, tmp_path, SMALL_TRAINING)
    with_skeleton = _peak(capsys, tmp_path, SKELETON + SMALL_TRAINING)
    assert alone < 100 * MiB
    assert with_skeleton == alone


def test_a_skeleton_put_on_the_gpu_counts(capsys, tmp_path):
    """``to_empty(device="cuda")`` and ``.to("cuda")`` of meta skeletons allocate GPU memory (256 MiB each)."""
    peak = _peak(capsys, tmp_path, """
        with torch.device("meta"):
            model = torch.nn.Linear(8192, 8192, bias=False)
            other = torch.nn.Linear(8192, 8192, bias=False)
        model.to_empty(device="cuda")
        other = other.to("cuda")
        assert model.weight.device.type == "cuda" and other.weight.device.type == "cuda"
        opt = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
        for step in range(3):
            other(model(torch.randn(8, 8192, device="cuda"))).sum().backward()
            opt.step()
            opt.zero_grad()
    """)
    assert peak >= 4 * 256 * MiB  # both weights and both gradients
    assert peak < 4 * 256 * MiB + 64 * MiB
