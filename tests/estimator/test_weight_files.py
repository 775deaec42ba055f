"""Fake mode reads pretrained weights from the safetensors header only (estimator_cli/weight_files.py): a
checkpoint larger than the script's CPU-memory limit loads, and one whose data region is missing altogether
loads too — proof that no byte of it is mapped or read."""

from __future__ import annotations

import json
import struct

import pytest

from gpushare.estimator_cli.cli import EXIT_OK
from gpushare.estimator_cli.weight_files import read_header
from gpushare.gpus import GiB
from estimator_run import estimate

pytestmark = pytest.mark.torch  # starts gpu-estimate captures: torch in a child process or the warm worker


def _sparse_safetensors(path, shape=(32768, 32768)):
    """A 4 GiB float32 tensor declared in the header; the data is a hole in a sparse file (no disk used)."""
    size = shape[0] * shape[1] * 4
    header = {"big.weight": {"dtype": "F32", "shape": list(shape), "data_offsets": [0, size]},
              "small.bias": {"dtype": "BF16", "shape": [shape[0]], "data_offsets": [size, size + 2 * shape[0]]},
              "__metadata__": {"format": "pt"}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
        handle.truncate(8 + len(raw) + size + 2 * shape[0])


def test_header_reader_units(tmp_path):
    path = tmp_path / "w.safetensors"
    _sparse_safetensors(path, (64, 32))
    tensors, metadata = read_header(path)
    assert tensors == {"big.weight": ("F32", (64, 32)), "small.bias": ("BF16", (64,))}
    assert metadata == {"format": "pt"}
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 40) + b"{not json")
    with pytest.raises(Exception, match="bad.safetensors: file ends inside its 40-byte header"):
        read_header(bad)


def test_weights_larger_than_the_cpu_limit(capsys, tmp_path):
    """4 GiB of weights under a 3 GiB address-space limit: safetensors would map the file and fail."""
    weights = tmp_path / "big.safetensors"
    _sparse_safetensors(weights)
    code, doc, err = estimate(capsys, tmp_path, """
        import sys, torch
        from safetensors import safe_open
        from safetensors.torch import load_file
        state = load_file(sys.argv[1])                   # host tensors, then moved
        big = state["big.weight"].to("cuda", torch.bfloat16)
        assert state["small.bias"].dtype == torch.bfloat16 and state["small.bias"].cpu() is state["small.bias"]
        with safe_open(sys.argv[1], framework="pt", device="cuda") as f:
            shard = f.get_slice("big.weight")[:1024]     # a tensor-parallel shard: only its own size
            assert f.get_slice("big.weight").get_dtype() == "F32" and shard.shape == (1024, 32768)
        head = torch.nn.Linear(32768, 8).cuda()
        opt = torch.optim.SGD(head.parameters(), lr=0.1)
        for step in range(3):
            head(torch.randn(4, 32768, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
    """, "--mode", "fake", "--max-cpu-memory", "3G", script_args=(str(weights),))
    assert code == EXIT_OK, err
    peak = doc["targets"][0]["peak_allocated_bytes"]
    # the float32 copy (4 GiB, its host weight stands for it from loading) + its bf16 copy (2 GiB) + the shard
    assert 6 * GiB + 128 * 2**20 <= peak < 6.5 * GiB


def test_from_pretrained_reads_no_weight_bytes(capsys, tmp_path):
    """A tiny Llama saved with ``save_pretrained`` (bf16, tied embeddings), its weight file then cut right
    after the header: from_pretrained on the host with a dtype change, ``model.cuda()``, training."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp_path / "tiny")
    weights = tmp_path / "tiny" / "model.safetensors"
    with open(weights, "r+b") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        handle.truncate(8 + length)
    code, doc, err = estimate(capsys, tmp_path, """
        import sys, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        model.cuda().train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for step in range(3):
            ids = torch.randint(0, 1000, (2, 64), device="cuda")
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    """, "--mode", "fake", script_args=(str(tmp_path / "tiny"),))
    assert code == EXIT_OK, err
    # float32 weights, gradients and AdamW's two states
    assert doc["targets"][0]["peak_allocated_bytes"] >= 16 * parameters
