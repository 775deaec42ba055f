"""Fake mode through the last common real-script patterns: GPU values copied to the host for image files,
metrics and logs (estimator_cli/device_mode.py, placeholders.py), ``int(tensor)`` as a bounded index or
loop bound and a condition that only picks host work (value_use.py), and long gradient-free passes before
the first step (repeat_passes.py). A value that decides memory still falls back, naming the line."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from estimator_run import estimate

from gpushare.estimator_cli.cli import EXIT_OK, EXIT_UNSUPPORTED

pytestmark = pytest.mark.torch

needs_pil = pytest.mark.skipif(importlib.util.find_spec("PIL") is None, reason="needs Pillow")

HEAD = """
    import os, sys
    import numpy as np
    import torch, torch.nn as nn, torch.nn.functional as F
    out_dir = sys.argv[1]
"""


def _line(source: str, needle: str) -> str:
    """``train.py:N`` of the first line of the written script that contains ``needle``."""
    lines = textwrap.dedent(source).splitlines()
    return f"train.py:{next(i for i, text in enumerate(lines, 1) if needle in text)}"


def _assumed(doc: dict) -> list[str]:
    return [what for what in doc["value_reads"]["placeholder"] if "assumed" in what]


@needs_pil
def test_a_batch_moved_to_the_host_and_saved_as_an_image_stays_in_fake_mode(capsys, tmp_path):
    code, doc, err = estimate(capsys, tmp_path, HEAD + """
    from PIL import Image
    gen = nn.Sequential(nn.Linear(32, 3 * 16 * 16), nn.Sigmoid()).cuda()
    opt = torch.optim.Adam(gen.parameters())
    for step in range(100):
        img = gen(torch.randn(64, 32, device="cuda")).view(64, 3, 16, 16)
        img.mean().backward()
        opt.step()
        opt.zero_grad()
        if step % 2 == 0:                              # a sample grid every N steps
            grid = img.detach().to("cpu")[:8].mul(255).clamp(0, 255).to(torch.uint8)
            arr = grid.permute(0, 2, 3, 1).reshape(8 * 16, 16, 3).numpy()
            Image.fromarray(arr).save(os.path.join(out_dir, f"sample_{step}.png"))
    """, "--mode", "fake", script_args=(str(tmp_path),))
    assert code == EXIT_OK, err
    assert doc["mode"] == "fake" and doc["iterations"] == 3
    assert (tmp_path / "sample_0.png").stat().st_size > 0
    assert doc["value_reads"]["placeholder"].get(".to('cpu')")


def test_outputs_copied_to_the_host_for_a_metric_stay_in_fake_mode(capsys, tmp_path):
    code, doc, err = estimate(capsys, tmp_path, HEAD + """
    model = nn.Linear(64, 10).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    correct = seen = 0
    for step in range(100):
        x, y = torch.randn(128, 64).cuda(), torch.randint(0, 10, (128,)).cuda()
        out = model(x)
        F.cross_entropy(out, y).backward()
        opt.step()
        opt.zero_grad()
        preds = out.detach().cpu().argmax(1)
        probs = out.detach().softmax(1).cpu().numpy()
        correct += (preds == y.cpu()).sum().item()
        seen += len(y)
        np.save(os.path.join(out_dir, "probs.npy"), probs)
        print(f"acc {correct / seen:.3f} top {probs.max():.3f} {out.detach().cpu().tolist()[0][:2]}")
    """, "--mode", "fake", script_args=(str(tmp_path),))
    assert code == EXIT_OK, err
    assert doc["mode"] == "fake" and doc["iterations"] == 3
    assert doc["value_reads"]["placeholder"].get(".cpu()")
    assert (tmp_path / "probs.npy").exists()


def test_int_of_a_gpu_value_as_a_bounded_index_or_loop_bound_gets_a_value(capsys, tmp_path):
    source = HEAD + """
    names = ["cat", "dog", "bird"]
    model = nn.Linear(16, 3).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(100):
        out = model(torch.randn(8, 16).cuda())
        out.sum().backward()
        opt.step()
        opt.zero_grad()
        first = int(out[0].argmax())
        print(f"first sample: {names[first]}")
        for rank in range(int(out[0].argmax())):
            print("  rank", rank)
    """
    code, doc, err = estimate(capsys, tmp_path, source, "--mode", "fake", script_args=(str(tmp_path),))
    assert code == EXIT_OK, err
    assert doc["mode"] == "fake"
    assumed = _assumed(doc)
    index, bound = _line(source, "first = int"), _line(source, "for rank")
    assert any(f"{index} used only as index, output (assumed 0)" in w for w in assumed), assumed
    assert any(f"{bound} used only as loop bound (assumed 1)" in w for w in assumed), assumed


def test_a_condition_that_only_picks_host_work_is_assumed_false(capsys, tmp_path):
    source = HEAD + """
    model = nn.Linear(16, 16).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    best = 1e9
    for step in range(100):
        loss = model(torch.randn(8, 16).cuda()).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        val = torch.tensor([loss.item()]).mean()
        if val < best:                                 # keep the best model: host work either way
            best = val
            torch.save(model.state_dict(), os.path.join(out_dir, "best.pt"))
    """
    code, doc, err = estimate(capsys, tmp_path, source, "--mode", "fake", script_args=(str(tmp_path),))
    assert code == EXIT_OK, err
    assert any(f"{_line(source, 'if val < best')} choosing between host-only branches (assumed false)" in w for w in _assumed(doc))


@pytest.mark.parametrize("use, needle", [
    ("extra = torch.zeros(int(out.argmax()) + 1, 1024, device='cuda')", "extra ="),
    ("sizes = [8, 4096]\n        extra = torch.zeros(sizes[int(out.argmax())], device='cuda')", "extra ="),
    ("if out.cpu().mean() > 0:\n            out = out.repeat(64, 1)", "if out"),
    ("for k in range(int(out.argmax())):\n            extra = torch.zeros(k, 1024, device='cuda')", "for k"),
])
def test_a_value_that_decides_memory_still_falls_back_naming_the_line(capsys, tmp_path, use, needle):
    source = HEAD + f"""
    model = nn.Linear(16, 8).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10):
        out = model(torch.randn(4, 16, device="cuda"))
        {use}
        out.sum().backward()
        opt.step()
        opt.zero_grad()
    """
    code, _, err = estimate(capsys, tmp_path, source, "--mode", "fake", script_args=(str(tmp_path),))
    assert code == EXIT_UNSUPPORTED, err
    assert f"at {_line(source, needle)}" in err, err


def test_repeated_evaluation_passes_before_the_first_step_are_fast_forwarded(capsys, tmp_path):
    """200 evaluation batches through a compiled model at iteration 0, and an evaluation that keeps its
    outputs on the GPU: the first grows every pass, so its peak must grow with the number of passes."""
    script = HEAD + """
    model = torch.compile(nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda())
    opt = torch.optim.Adam(model.parameters())
    keep = int(sys.argv[2])
    with torch.no_grad():
        kept = []
        for k in range(200):
            y = model(torch.randn(512, 256).cuda())
            if k < keep:
                kept.append(y)                          # accumulated on the GPU
    for step in range(100):
        model(torch.randn(512, 256).cuda()).sum().backward()
        opt.step()
        opt.zero_grad()
    """
    peaks = []
    for keep in (0, 50):
        code, doc, err = estimate(capsys, tmp_path, script, "--mode", "fake", script_args=(str(tmp_path), str(keep)))
        assert code == EXIT_OK, err
        assert doc["iterations"] == 3 and doc["fast_forwarded_passes"] >= 190
        peaks.append(doc["targets"][0]["peak_allocated_bytes"])
    assert peaks[1] - peaks[0] >= 49 * 512 * 256 * 4  # the 50 kept outputs


@needs_pil
@pytest.mark.slow
def test_a_script_with_the_patterns_estimates_as_profile_mode_does(capsys, tmp_path):
    """Evaluation at iteration 0 through torch.compile, host metrics, an image of the outputs, a bounded
    index and a best-loss branch: the fake-mode estimate is the profile-mode one within 3 %, once the head's
    bias-gradient reduction buffer is added, which only fake mode sees (estimator_cli/reduce_buffer.py)."""
    script = HEAD + """
    from PIL import Image
    vocab, T, d = 2048, 128, 256
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.body = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.LayerNorm(d))
            self.head = nn.Linear(d, vocab)
        def forward(self, idx, targets):
            logits = self.head(self.body(self.emb(idx)))
            return logits, F.cross_entropy(logits.view(-1, vocab), targets.view(-1))
    data = torch.randint(0, vocab, (50000,))
    def get_batch():
        ix = torch.randint(len(data) - T - 1, (32,))
        return (torch.stack([data[i:i + T] for i in ix]).cuda(), torch.stack([data[i + 1:i + T + 1] for i in ix]).cuda())
    model = torch.compile(Net().cuda())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    words = [f"tok{i}" for i in range(vocab)]
    @torch.no_grad()
    def estimate_loss(iters):
        model.eval()
        losses = torch.zeros(iters)
        for k in range(iters):
            X, Y = get_batch()
            _, loss = model(X, Y)
            losses[k] = loss.item()
        model.train()
        return losses.mean()
    best = 1e9
    for step in range(100):
        if step == 0:
            val = estimate_loss(20)
            if val < best:
                best = val
        X, Y = get_batch()
        logits, loss = model(X, Y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        preds = logits.detach().argmax(-1).cpu().numpy()
        acc = (preds == Y.cpu().numpy()).mean()
        print(f"step {step} loss {loss.item():.3f} acc {acc:.3f} next {words[int(logits[0, -1].argmax())]}")
        picture = logits.detach()[0].softmax(-1).to("cpu").mul(255).to(torch.uint8).numpy()
        Image.fromarray(picture).save(os.path.join(out_dir, f"probs_{step}.png"))
    """
    docs = {}
    for mode in ("auto", "profile"):
        code, doc, err = estimate(capsys, tmp_path, script, "--mode", mode, script_args=(str(tmp_path),))
        assert code == EXIT_OK, err
        docs[mode] = doc
    assert docs["auto"]["mode"] == "fake" and docs["auto"]["fallback_reason"] is None
    assert docs["auto"]["fast_forwarded_passes"] >= 15 and docs["profile"]["mode"] == "profile"
    fake, real = (docs[m]["targets"][0]["peak_total_bytes"] for m in ("auto", "profile"))
    import torch

    from gpushare.estimator_cli.reduce_buffer import geometry_of, max_threads_per_sm, staging_bytes

    head_bias_grad = geometry_of("sum.dim_IntList", (torch.empty(32 * 128, 2048, device="meta"), [0], True))
    assert head_bias_grad is not None
    staging, _ = staging_bytes(head_bias_grad, 108, max_threads_per_sm((8, 0)))  # a100-40gb
    assert staging == 64 << 20
    assert abs(fake - (real + staging)) <= 0.03 * real, (fake, real)
