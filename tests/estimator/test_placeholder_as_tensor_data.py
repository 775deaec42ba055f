"""A logged value put back into a GPU tensor as its data (timm's train.py all-reduces its running loss for a log
line: ``reduce_tensor(loss.new([loss_avg]), world_size).item()``) stays in fake mode: the new tensor has no
values, as every fake GPU tensor, and a read of it is a placeholder again, which still falls back where it
decides memory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from estimator_run import estimate

from gpushare.estimator_cli.cli import EXIT_OK, EXIT_UNSUPPORTED

pytestmark = pytest.mark.torch

SCRIPT = """
    import torch, torch.nn as nn

    class Avg:
        def __init__(self):
            self.sum, self.count = 0.0, 0
        def update(self, v):
            self.sum += v
            self.count += 1
        @property
        def avg(self):
            return self.sum / self.count

    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    losses = Avg()
    for step in range(50):
        loss = model(torch.randn(32, 256, device="cuda")).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.update(loss.item())
        USE
"""


def test_a_logged_value_put_back_into_a_gpu_tensor_as_data_stays_in_fake_mode(capsys, tmp_path):
    use = """synced = loss.new([losses.avg]).clone()
        synced /= 2
        now = loss.new_tensor([losses.sum, float(losses.count)]).sum() / 2
        print(f"loss {synced.item():#.3g} ({now.item():.3f})")"""
    code, doc, err = estimate(capsys, tmp_path, SCRIPT.replace("USE", use), "--mode", "fake")
    assert code == EXIT_OK, err
    assert doc["mode"] == "fake" and doc["iterations"] == 3
    # the model and its AdamW state are all there: 2 x (256x1024 + 1024) weights, float32, x3 with the moments
    assert doc["targets"][0]["peak_allocated_bytes"] >= 3 * 4 * 2 * (256 * 1024 + 1024)


def test_the_value_of_such_a_tensor_still_falls_back_where_it_decides_memory(capsys, tmp_path):
    use = """synced = loss.new([losses.avg])
        if synced.item() > 0.5:
            extra = torch.zeros(1 << 20, device="cuda")"""
    code, _, err = estimate(capsys, tmp_path, SCRIPT.replace("USE", use), "--mode", "fake")
    assert code == EXIT_UNSUPPORTED, err
    assert "uses the value of a GPU tensor" in err and "train.py:24" in err


FILL = """
    import torch, torch.nn as nn

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.stride = torch.tensor([8.0, 16.0, 32.0])  # a plain attribute, not a buffer

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = Head()

        def _apply(self, fn, recurse=True):  # as ultralytics' BaseModel moves its Detect head's strides
            self = super()._apply(fn)
            self.head.stride = fn(self.head.stride)
            return self

    model = Model().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10):
        y = model.head.conv(torch.randn(2, 3, 32, 32, device="cuda"))
        FILLS
        (y.mean() * torch.cat(anchors).mean()).backward()
        opt.step()
        opt.zero_grad()
"""


@pytest.mark.parametrize("fills, read", [
    # ultralytics' make_anchors: a known value (the tensor came from the host)
    ("anchors = [y.new_full((4, 1), s) for s in model.head.stride]", "concrete"),
    ("anchors = [torch.full((4, 1), s, device='cuda') for s in model.head.stride]", "concrete"),
    # a value only the GPU would know: the new tensor is value-free, as any fake GPU tensor
    ("anchors = [y.new_full((4, 1), fill_value=y.detach().mean()), torch.full_like(y[0, 0, :4, :1], y.detach().max())]",
     "placeholder"),
])
def test_a_one_element_gpu_tensor_as_a_fill_value_stays_in_fake_mode(capsys, tmp_path, fills, read):
    code, doc, err = estimate(capsys, tmp_path, FILL.replace("FILLS", fills), "--mode", "fake")
    assert code == EXIT_OK, err
    assert doc["mode"] == "fake" and doc["iterations"] == 3
    assert doc["value_reads"][read].get(".item()")


def test_a_gpu_value_stored_into_a_host_tensor_stays_in_fake_mode(capsys, tmp_path):
    # litgpt's validate(): losses = torch.zeros(n); losses[k] = loss_fn(logits, targets); losses.mean()
    code, doc, err = estimate(capsys, tmp_path, """
    import torch, torch.nn as nn
    model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 128)).cuda()
    opt = torch.optim.AdamW(model.parameters())

    @torch.no_grad()
    def validate():
        losses = torch.zeros(4)
        for k in range(4):
            losses[k] = model(torch.randn(16, 128, device="cuda")).pow(2).mean()
        return losses.mean()

    print(f"sanity check: {validate().item():.4f}")
    for step in range(20):
        model(torch.randn(16, 128, device="cuda")).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    """, "--mode", "fake")
    assert code == EXIT_OK, err
    assert doc["mode"] == "fake" and doc["iterations"] == 3


def test_a_logged_value_in_arithmetic_with_a_gpu_tensor_stays_in_fake_mode(capsys, tmp_path):
    # torchtune's recipes: loss_to_log = running_loss.item() / num_tokens, num_tokens a GPU count
    code, doc, err = estimate(capsys, tmp_path, """
    import torch, torch.nn as nn
    model = nn.Linear(128, 128).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for step in range(20):
        labels = torch.randint(-1, 4, (16,), device="cuda")
        num_tokens = (labels != -1).sum()
        running_loss = model(torch.randn(16, 128, device="cuda")).pow(2).mean() * num_tokens
        running_loss.backward()
        opt.step()
        opt.zero_grad()
        loss_to_log = running_loss.item() / num_tokens
        print(f"{step}|Loss: {loss_to_log}")
    """, "--mode", "fake")
    assert code == EXIT_OK, err
    assert doc["mode"] == "fake" and doc["iterations"] == 3


TRUNC_NORMAL = """
import torch, torch.nn as nn
model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).to("cuda")
for m in model:
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
opt = torch.optim.AdamW(model.parameters())
for step in range(5):
    model(torch.randn(32, 256, device="cuda")).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_trunc_normal_of_gpu_weights_stays_in_fake_mode_on_the_newest_pytorch(capsys, tmp_path):
    """PyTorch 2.14's trunc_normal_ redraws while ``mask.any()`` of the out-of-range draws (torchtitan
    initialises every weight on the GPU so): a condition inside torch.nn.init decides values, never memory."""
    python = Path(os.environ.get("GPUSHARE_PYTHON_ENVS", "/var/cache/gpushare/python-envs")) / "torch-2.14.1" / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{python.parent.parent} missing: 'make python-envs' builds it (5 GB, 2-3 minutes)")
    code, doc, err = estimate(capsys, tmp_path, TRUNC_NORMAL, "--mode", "fake", "--python", str(python))
    assert code == EXIT_OK, err
    assert doc["torch_version"].startswith("2.14") and doc["mode"] == "fake" and doc["iterations"] == 3
    assert any("torch.nn.init" in what for what in doc["value_reads"]["placeholder"])
