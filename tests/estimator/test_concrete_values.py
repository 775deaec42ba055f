"""Fake mode through data-dependent code: small GPU tensors from concrete inputs keep real values
(estimator_cli/concrete_values.py), large ones stay value-free, and a branch on a value-free tensor still
falls back with the reason."""

from __future__ import annotations

import importlib.util

import torch

import pytest

from estimator_run import estimate

from gpushare.estimator_cli.cli import EXIT_OK, EXIT_UNSUPPORTED

pytestmark = pytest.mark.torch


MASKS_AND_LENGTHS = """
    import torch
    lengths = torch.tensor([3, 5, 8, 2])
    mask = torch.arange(10)[None, :] < lengths[:, None]
    model = torch.nn.Linear(16, 4).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m, L = mask.cuda(), lengths.to("cuda")
    for step in range(10):
        out = model(torch.randn(8, 16).cuda())
        if m.all():                                   # Hugging Face's `padding_mask.all()`
            raise SystemExit("wrong branch")
        n = int(L.max())
        assert n == 8 and L.cpu().tolist() == [3, 5, 8, 2]
        assert torch.arange(n, device="cuda").sum().item() == 28
        picked = out[m[:, :2].reshape(-1)]             # boolean-mask indexing, autograd through it
        assert picked.shape == (int(m[:, :2].sum()), 4), picked.shape
        assert m.nonzero().shape == (18, 2)
        loss = picked.pow(2).mean()
        if torch.isnan(loss):                          # the loss guard: assumed finite
            raise SystemExit("nan")
        print(f"loss {loss.item():.3f}")
        loss.backward()
        opt.step()
        opt.zero_grad()
"""


def test_small_tensors_from_inputs_keep_values_in_fake_mode(capsys, tmp_path):
    code, doc, err = estimate(capsys, tmp_path, MASKS_AND_LENGTHS, "--mode", "fake")
    assert code == EXIT_OK, err
    assert doc["mode"] == "fake" and doc["iterations"] == 3
    concrete = doc["value_reads"]["concrete"]
    assert concrete.get("a condition on a tensor") and concrete.get("int(tensor)")
    assert concrete.get(".cpu()") and concrete.get("a boolean mask used as an index")
    placeholder = doc["value_reads"]["placeholder"]
    assert any("assumed finite" in what for what in placeholder) and placeholder.get(".item()")


def test_branch_on_a_large_value_free_tensor_still_refuses(capsys, tmp_path):
    code, _, err = estimate(capsys, tmp_path, """
        import torch
        model = torch.nn.Linear(512, 512).cuda()
        x = model(torch.randn(256, 512).cuda())
        if (x > 0).any():
            x = x * 2                                  # a GPU operation in the branch
            print("data-dependent")
    """, "--mode", "fake")
    assert code == EXIT_UNSUPPORTED and "a condition on a tensor" in err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_hugging_face_training_stays_in_fake_mode(capsys, tmp_path, arch):
    """transformers 5.x asks ``padding_mask.all()`` in its mask code for causal LMs and encoders alike."""
    code, doc, err = estimate(capsys, tmp_path, f"""
        import torch, transformers
        arch = "{arch}"
        if arch == "llama":
            cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
            model = transformers.LlamaForCausalLM(cfg).cuda()
        else:
            cfg = transformers.BertConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_labels=3)
            model = transformers.BertForSequenceClassification(cfg).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for step in range(5):
            ids = torch.randint(0, 1000, (4, 32))
            mask = torch.ones_like(ids)
            mask[1, 20:] = 0                                   # padding
            labels = ids if arch == "llama" else torch.tensor([0, 1, 2, 0])
            out = model(input_ids=ids.cuda(), attention_mask=mask.cuda(), labels=labels.cuda())
            out.loss.backward()
            opt.step()
            opt.zero_grad()
    """, "--mode", "fake")
    assert code == EXIT_OK, err
    assert doc["mode"] == "fake" and doc["iterations"] == 3


FACTORY_VALUES_READ_LATE = """
    import torch
    model = torch.nn.Linear(8, 8).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        eye = torch.eye(8, device="cuda")              # DoRA's identity: only multiplied, never read
        out = model(eye).sum()
        z = torch.zeros(5, device="cuda", dtype=torch.int64)
        z[1] = 3                                       # written in place before any read
        tail = z[2:]
        tail.add_(2)                                   # through a view
        assert z.tolist() == [0, 3, 2, 2, 2], z.tolist()
        steps = torch.arange(0, 10, 2, device="cuda")
        assert int(steps[-1]) == 8 and torch.full((2,), 7, device="cuda").sum().item() == 14
        out.backward()
        opt.step()
        opt.zero_grad()
"""


def test_factory_values_are_made_when_first_read_and_follow_in_place_writes(capsys, tmp_path):
    """A small factory tensor's CPU value is made when it is first read (most never are): in-place writes to
    it, and through its views, still reach the value a later read sees."""
    code, doc, err = estimate(capsys, tmp_path, FACTORY_VALUES_READ_LATE, "--mode", "fake")
    assert code == EXIT_OK, err
    assert doc["mode"] == "fake" and doc["iterations"] == 3
    assert doc["value_reads"]["concrete"].get(".tolist()") and doc["value_reads"]["concrete"].get("int(tensor)")


def test_a_factory_never_read_is_never_made() -> None:
    from gpushare.estimator_cli import concrete_values

    values = concrete_values.ConcreteValues()
    out = torch.eye(960, device="meta")
    values.propagate(torch.eye, (960,), {"device": torch.device("meta")}, out)
    assert isinstance(values.shadows.get(out), concrete_values._Deferred)
    made = values.get(out)
    assert made is not None and made.device.type == "cpu" and torch.equal(made, torch.eye(960))
    assert values.shadows.get(out) is made


PADDING_TILES_DROPPED = """
    import torch, torch.nn as nn
    vision = nn.Sequential(nn.Conv2d(3, 16, 16, 16), nn.Flatten(), nn.Linear(9216, 64)).cuda()
    text = nn.Embedding(1000, 64).cuda()
    opt = torch.optim.AdamW(list(vision.parameters()) + list(text.parameters()))
    for step in range(5):
        pixels = torch.randn(1, 13, 3, 384, 384)
        pixels[0, 10:] = 0.0                                  # three padding tiles
        pv = pixels.cuda().to(torch.bfloat16).view(-1, 3, 384, 384)
        real = (pv == 0.0).sum(dim=(-1, -2, -3)) != pv.shape[1:].numel()
        pv = pv[real].contiguous()                            # Idefics3's get_image_features
        assert pv.shape[0] == 10, pv.shape
        loss = text(torch.randint(0, 1000, (1, 64)).cuda()).sum() + vision(pv.float()).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
"""


def test_a_batch_keeps_its_values_so_a_mask_made_from_pixels_selects_exactly(capsys, tmp_path):
    """A vision-language model drops its padding image tiles by a mask computed from the pixel values
    (5.8M elements here): the batch moved to the GPU keeps its value, so the mask and the selection are exact."""
    code, doc, err = estimate(capsys, tmp_path, PADDING_TILES_DROPPED, "--mode", "fake")
    assert code == EXIT_OK, err
    assert doc["mode"] == "fake" and doc["iterations"] == 3
