"""Fake mode's GPU tensors answer as CUDA tensors, and every way of putting a model on the GPU counts it.

Fake mode stands GPU tensors in by meta tensors (estimator_cli/device_mode.py). What the script can ask of
them must be what a GPU would answer, and the device rewrite behind them must never look like the script's
own ``meta`` (estimator_cli/fake_capture.py keeps those out of GPU memory). Each test is one cause:

- ``model.to(device=dev)`` (keyword) lost every parameter and the optimizer state: the rewritten device came
  back from ``Module.to``'s argument parser and the module's ``t.to(meta)`` was taken as the script's own;
- ``is_meta`` said True, so code that refuses or skips meta tensors (Lightning, torchtune's RoPE cache) took
  its meta branch, and ``torch.cuda``'s random-state queries reached the absent CUDA runtime;
- activation checkpointing inferred ``meta`` for such tensors and recomputed without CUDA autocast
  ("Recomputed values ... have different metadata");
- ``load_state_dict`` failed ("Cannot copy out of meta tensor", "Cannot swap t1 because it has weakref");
- small values carried to the GPU (buffers, strides) must keep their values for ``.item()`` and fill values.
"""

from __future__ import annotations

import textwrap

import pytest

from estimator_run import estimate

from gpushare.estimator_cli.cli import EXIT_OK

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch  # starts gpu-estimate captures in-process

MiB = 2**20
# two Linear(1024, 1024): 2 * (1024 * 1024 + 1024) float32 values
PARAMETER_BYTES = 2 * (1024 * 1024 + 1024) * 4

MOVES = {
    "positional": "model.to(dev)",
    "keyword": "model.to(device=dev)",
    "keyword with dtype": "model.to(dtype=torch.float32, device=dev)",
    "torch.device": "model.to(torch.device('cuda'))",
    "cuda()": "model.cuda()",
    "to_empty": "model.to_empty(device=dev)",
}


def _fake(capsys, tmp_path, source: str) -> dict:
    code, doc, err = estimate(capsys, tmp_path, textwrap.dedent(source), "--mode", "fake")
    assert code == EXIT_OK, err
    assert doc is not None and doc["mode"] == "fake" and doc["iterations"] == 3
    return doc


def _training(move: str) -> str:
    return f"""
        import torch
        dev = torch.device("cuda")
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
        {move}
        opt = torch.optim.AdamW(model.parameters())
        for step in range(3):
            model(torch.randn(8, 1024, device=dev)).sum().backward()
            opt.step()
            opt.zero_grad()
    """


def test_every_way_to_the_gpu_counts_parameters_and_optimizer_state(capsys, tmp_path):
    """Parameters, gradients and both AdamW states (4x the parameter bytes) are in the peak, the same for
    every form of the move; the keyword form used to give about a quarter of it."""
    peaks = {name: int(_fake(capsys, tmp_path, _training(move))["targets"][0]["peak_allocated_bytes"])
             for name, move in MOVES.items()}
    assert peaks["positional"] >= 4 * PARAMETER_BYTES
    assert peaks["positional"] < 4 * PARAMETER_BYTES + 64 * MiB
    assert {name: peak for name, peak in peaks.items() if peak != peaks["positional"]} == {}


def test_fake_gpu_tensors_answer_as_cuda_tensors(capsys, tmp_path):
    """Parameters, buffers, activations and gradients: not meta, on cuda; autocast state and the CUDA random
    state answer as on a GPU; code that skips meta tensors (torchtune's RoPE cache) builds on the GPU."""
    _fake(capsys, tmp_path, """
        import torch

        class Rope(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("theta", torch.arange(8, dtype=torch.float32), persistent=False)
                self.built = False

            def build(self):
                if self.theta.is_meta:                  # torchtune: no cache on a meta skeleton
                    return
                self.register_buffer("cache", torch.outer(torch.arange(64, device=self.theta.device), self.theta))
                self.built = True

        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64)).to(device="cuda")
        rope = Rope().cuda()
        rope.build()
        assert rope.built and rope.cache.is_cuda
        # Lightning Fabric refuses a module with meta parameters or buffers
        assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.cuda.manual_seed(0)
        states = (torch.cuda.get_rng_state(), torch.cuda.random.get_rng_state(), torch.cuda.initial_seed())
        with torch.random.fork_rng(devices=[0], device_type="cuda"):
            torch.cuda.random.set_rng_state(states[0])
        for step in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
                y = model(torch.randn(16, 64, device="cuda"))
            for t in (y, model[0].weight, model[1].running_mean):
                assert not t.is_meta and t.is_cuda and t.device.type == "cuda" and t.device == torch.device("cuda", 0)
            assert y.dtype == torch.bfloat16
            y.float().sum().backward()
            assert not model[0].weight.grad.is_meta and model[0].weight.grad.device.type == "cuda"
            opt.step()
            opt.zero_grad()
    """)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_checkpoint_recompute_keeps_cuda_autocast(capsys, tmp_path, dtype):
    """Non-reentrant activation checkpointing under CUDA autocast, the model moved with ``to(device=...)`` and
    the checkpointed input computed from its parameters: the recomputation runs under autocast again, so
    its saved tensors match the forward's."""
    _fake(capsys, tmp_path, f"""
        import torch
        from torch.utils.checkpoint import checkpoint
        dev = torch.device("cuda")
        emb = torch.nn.Embedding(128, 512).to(device=dev)
        body = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 512)).to(device=dev)
        opt = torch.optim.SGD([*emb.parameters(), *body.parameters()], lr=0.1)
        for step in range(3):
            with torch.autocast("cuda", dtype=torch.{dtype}):
                h = emb.weight[:16] * 2
                y = checkpoint(body, h, use_reentrant=False)
            assert y.dtype == torch.{dtype}
            y.float().sum().backward()
            opt.step()
            opt.zero_grad()
    """)


@pytest.mark.parametrize("when", ["before the move", "after the move"])
@pytest.mark.parametrize("fmt", ["torch.save", "safetensors"])
def test_pretrained_state_dict_loads_in_fake_mode(capsys, tmp_path, when, fmt):
    """A timm-style ``pretrained=True``: the model is built on the host, a saved state_dict loaded with
    ``load_state_dict`` (parameters and BatchNorm buffers) before or after ``.to('cuda')``; a small buffer's
    value comes from the file either way (a safetensors file's large tensors from its header only)."""
    if fmt == "safetensors":
        pytest.importorskip("safetensors")
    path = tmp_path / ("weights.pt" if fmt == "torch.save" else "weights.safetensors")
    save = "torch.save(sd, PATH)" if fmt == "torch.save" else "safetensors.torch.save_file(sd, PATH)"
    load = ("torch.load(PATH, map_location='cpu', weights_only=True)" if fmt == "torch.save"
            else "safetensors.torch.load_file(PATH, device='cpu')")
    library = "safetensors.torch" if fmt == "safetensors" else "torch"
    doc = _fake(capsys, tmp_path, f"""
        import torch
        import {library}
        PATH = {str(path)!r}

        def make():
            return torch.nn.Sequential(torch.nn.Conv2d(3, 256, 3), torch.nn.BatchNorm2d(256), torch.nn.ReLU(),
                                       torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(256, 1000))

        sd = make().state_dict()
        sd["1.num_batches_tracked"] = torch.tensor(5)
        {save}
        model = make()
        if {when == "before the move"}:
            model.load_state_dict({load})
        model = model.to("cuda")
        if {when == "after the move"}:
            model.load_state_dict({load})
        assert model[1].num_batches_tracked.item() == 5   # a small tensor is read from the file
        opt = torch.optim.AdamW(model.parameters())
        for step in range(3):
            model(torch.randn(8, 3, 32, 32, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
    """)
    parameters = (256 * 3 * 9 + 256 + 2 * 256 + 256 * 1000 + 1000) * 4
    assert int(doc["targets"][0]["peak_allocated_bytes"]) >= 4 * parameters


def test_small_values_carried_to_the_gpu_keep_their_values(capsys, tmp_path):
    """ultralytics' pattern: strides kept as a plain tensor moved by the model's own ``_apply``, used as a
    fill value (``make_anchors``) and read with ``.item()``; a buffer loaded from a state_dict on the GPU; an
    EMA copy of the model. Every read is exact, none is a placeholder."""
    doc = _fake(capsys, tmp_path, """
        import copy
        import torch

        class Head(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = torch.nn.Conv2d(8, 8, 1)
                self.stride = torch.zeros(3)                  # set once the model is built
                self.register_buffer("scale", torch.tensor(4.0))

            def _apply(self, fn, *args, **kwargs):
                self = super()._apply(fn, *args, **kwargs)
                self.stride = fn(self.stride)
                return self

            def forward(self, x):
                y = self.conv(x)
                fills = [torch.full((4, 1), s, dtype=y.dtype, device=y.device) for s in self.stride]
                assert torch.cat(fills).sum().item() == 4 * (8 + 16 + 32)
                assert self.stride[-1].item() == 32 and int(self.stride.max()) == 32
                return y.sum() * self.scale

        model = Head()
        model.stride = torch.tensor([8.0, 16.0, 32.0])
        model = model.to(device=torch.device("cuda")).half().float()
        model.load_state_dict({**model.state_dict(), "scale": torch.tensor(7.0)})
        assert model.scale.item() == 7.0
        ema = copy.deepcopy(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            model(torch.randn(2, 8, 4, 4, device="cuda")).backward()
            with torch.no_grad():
                ema(torch.randn(2, 8, 4, 4, device="cuda"))
            opt.step()
            opt.zero_grad()
    """)
    assert doc["value_reads"]["concrete"].get(".item()")
    assert not doc["value_reads"]["placeholder"].get(".item()")
