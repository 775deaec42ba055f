"""Fake mode reads ``torch.save`` checkpoints from their pickle only (estimator_cli/checkpoint_files.py): a
4 GiB ``pytorch_model.bin`` loads under a 3 GiB CPU-memory limit, where ``torch.load(mmap=True)`` cannot even
map it, and transformers' ``from_pretrained`` of such a folder estimates too.

The big checkpoints are sparse files: ``torch.save`` under ``torch.serialization.skip_data`` writes the
archive's records with the data regions left as holes, so 4 GiB of declared weights take a few KiB of disk.
"""

from __future__ import annotations

import io
import json
import os

import pytest

from gpushare.estimator_cli.cli import EXIT_OK
from gpushare.gpus import GiB
from estimator_run import estimate

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch  # starts gpu-estimate captures in-process


def _sparse_checkpoint(path, shapes: dict[str, tuple[int, ...]], dtype=None) -> None:
    """A ``torch.save`` zip checkpoint declaring ``shapes`` whose data regions are holes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        state = {name: torch.empty(shape, dtype=dtype or torch.float32) for name, shape in shapes.items()}
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(state, path)


def test_loads_inside_the_block_are_meta_host_weights(tmp_path, monkeypatch):
    """Unit: a zip checkpoint (path or open file) gives host weights on meta with the saved dtypes and
    shared storages, its small tensors read; ``map_location="meta"``, the pre-1.6 format, a missing file and
    a checkpoint under the small-checkpoint bound go to the real loader."""
    from gpushare.estimator_cli import checkpoint_files
    from gpushare.estimator_cli.checkpoint_files import pickle_only_checkpoints
    from gpushare.estimator_cli.weight_files import is_host_weight

    weight = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    state = {"w": weight, "w_t": weight.t(), "step": 7, "nested": {"b": torch.ones(2)}}
    torch.save(state, tmp_path / "zip.pt")
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    original = torch.load
    with pickle_only_checkpoints():
        small = torch.load(tmp_path / "zip.pt")  # 56 bytes of storages: data, read for real
        assert torch.equal(small["w"], weight) and small["w_t"].untyped_storage() is small["w"].untyped_storage()
        monkeypatch.setattr(checkpoint_files, "SMALL_CHECKPOINT_BYTES", 0)
        # within a large checkpoint, small tensors held by one dict or list place are read for real
        part = torch.load(tmp_path / "zip.pt", map_location="cpu")
        assert torch.equal(part["nested"]["b"], torch.ones(2)) and not part["nested"]["b"].is_meta
        assert part["w"].is_meta and is_host_weight(part["w"])  # two tensors on its storage: not read
        monkeypatch.setattr(checkpoint_files, "SMALL_TENSOR_BYTES", 0)
        assert torch.load is not original and torch.serialization.load is torch.load
        loaded = torch.load(tmp_path / "zip.pt", map_location="cpu", mmap=True)
        assert loaded["step"] == 7 and loaded["w"].is_meta and loaded["w"].dtype == torch.bfloat16
        assert loaded["w_t"].shape == (4, 3) and loaded["w_t"].untyped_storage() is loaded["w"].untyped_storage()
        assert is_host_weight(loaded["w"]) and is_host_weight(loaded["nested"]["b"])
        with open(tmp_path / "zip.pt", "rb") as handle:
            handle_loaded = torch.load(handle)
            assert handle_loaded["w"].is_meta
        buffer = io.BytesIO((tmp_path / "zip.pt").read_bytes())
        assert torch.load(buffer, weights_only=True)["nested"]["b"].is_meta
        as_meta = torch.load(tmp_path / "zip.pt", map_location="meta")
        assert as_meta["w"].is_meta and not is_host_weight(as_meta["w"])
        legacy = torch.load(tmp_path / "legacy.pt")
        assert torch.equal(legacy["w"], weight)  # read for real: its storages follow the pickle
        with pytest.raises(FileNotFoundError):
            torch.load(tmp_path / "missing.pt")
    assert torch.load is original and torch.serialization.load is original


def test_checkpoint_larger_than_the_cpu_limit(capsys, tmp_path):
    """4 GiB of float32 declared in a ``.bin`` under a 3 GiB address-space limit, loaded the way
    transformers loads one (``map_location="cpu"``, ``mmap=True``), moved to the GPU as bf16."""
    weights = tmp_path / "pytorch_model.bin"
    _sparse_checkpoint(weights, {"big.weight": (32768, 32768), "small.bias": (32768,)})
    assert os.path.getsize(weights) > 4 * GiB
    code, doc, err = estimate(capsys, tmp_path, """
        import sys, torch
        state = torch.load(sys.argv[1], map_location="cpu", weights_only=True, mmap=True)
        big = state["big.weight"].to("cuda", torch.bfloat16)
        assert state["small.bias"].cpu() is state["small.bias"]
        head = torch.nn.Linear(32768, 8).cuda()
        head.bias.data.copy_(state["small.bias"][:8])
        opt = torch.optim.SGD(head.parameters(), lr=0.1)
        for step in range(3):
            head(torch.randn(4, 32768, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
    """, "--mode", "fake", "--max-cpu-memory", "3G", script_args=(str(weights),))
    assert code == EXIT_OK, err
    peak = doc["targets"][0]["peak_allocated_bytes"]
    # the float32 tensor (its host weight is counted from loading) + its bf16 copy
    assert 6 * GiB <= peak < 6.5 * GiB


def test_resuming_a_training_checkpoint(capsys, tmp_path):
    """A resumed run: model and AdamW state from a 240 MiB checkpoint; Adam reads each ``step`` with
    ``.item()``, so the small tensors must carry their values."""
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4096)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}, tmp_path / "last.pt")
    code, doc, err = estimate(capsys, tmp_path, """
        import sys, torch
        checkpoint = torch.load(sys.argv[1], map_location="cuda")
        model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
        model.load_state_dict(checkpoint["model"])
        opt = torch.optim.AdamW(model.parameters())
        opt.load_state_dict(checkpoint["optimizer"])
        assert opt.state_dict()["state"][0]["step"].item() == 1.0
        del checkpoint
        for step in range(3):
            model(torch.randn(8, 4096, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
    """, "--mode", "fake", script_args=(str(tmp_path / "last.pt"),))
    assert code == EXIT_OK, err
    weights = sum(p.numel() for p in model.parameters()) * 4
    # weights and two AdamW states kept; the checkpoint's copies were counted while loaded
    assert doc["targets"][0]["persistent_allocated_bytes"] >= 3 * weights
    assert doc["targets"][0]["peak_allocated_bytes"] >= 4 * weights


def test_from_pretrained_of_a_bin_folder(capsys, tmp_path):
    """A Llama folder with ``config.json`` and a 4.2 GiB float32 ``pytorch_model.bin`` (no safetensors):
    ``from_pretrained`` under a 3 GiB limit, then full training in bf16 for three steps."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                      num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)
    folder = tmp_path / "llama"
    config.save_pretrained(folder)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in transformers.LlamaForCausalLM(config).state_dict().items()}
    _sparse_checkpoint(folder / "pytorch_model.bin", shapes)
    parameters = sum(torch.Size(s).numel() for s in shapes.values())
    assert os.path.getsize(folder / "pytorch_model.bin") > 4 * GiB and json.loads((folder / "config.json").read_text())
    code, doc, err = estimate(capsys, tmp_path, """
        import sys, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).cuda().train()
        assert model.lm_head.weight.dtype == torch.bfloat16
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        for step in range(3):
            ids = torch.randint(0, 32000, (1, 64), device="cuda")
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    """, "--mode", "fake", "--max-cpu-memory", "3G", script_args=(str(folder),))
    assert code == EXIT_OK, err
    target = doc["targets"][0]
    # bf16 weights and gradients at least; the float32 file's host weights are counted while loading
    assert target["persistent_allocated_bytes"] >= 2 * parameters
    assert target["peak_allocated_bytes"] >= 4 * parameters
