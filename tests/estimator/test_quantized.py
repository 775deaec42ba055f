"""QLoRA in fake mode (estimator_cli/quantized.py): transformers loads a Llama with ``BitsAndBytesConfig``
(4-bit NF4, double quantization), PEFT adds LoRA adapters, bitsandbytes' paged 8-bit AdamW trains them.
The estimate counts the packed 4-bit weights (half a byte per parameter plus the quantization state),
not bf16 weights, and the weight file is read from its header only (it is cut right after it).

gpu-estimate runs in a process of its own, so ``import bitsandbytes`` happens inside the capture, under
the presented GPU, as it does for a researcher's script."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

LAYERS, HIDDEN, INTERMEDIATE, VOCAB = 4, 1024, 4096, 1000
LINEAR_PARAMETERS = LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE)  # what bitsandbytes quantizes

SCRIPT = """
    import sys, torch
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], quantization_config=q, device_map={"": 0})
    up = model.model.layers[0].mlp.up_proj
    assert isinstance(up, bnb.nn.Linear4bit) and up.weight.dtype == torch.uint8
    assert up.weight.numel() == up.in_features * up.out_features // 2       # two 4-bit values a byte
    model = prepare_model_for_kbit_training(model)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                  "gate_proj", "up_proj", "down_proj"]))
    model.to("cuda")                                                          # as the HF Trainer does
    opt = bnb.optim.PagedAdamW8bit([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    for step in range(3):
        ids = torch.randint(0, 1000, (2, 128), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
"""


def _header_only_llama(folder) -> int:
    """A bf16 Llama folder whose ``model.safetensors`` ends right after its header; its weight bytes."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                      num_hidden_layers=LAYERS, num_attention_heads=16, num_key_value_heads=16,
                                      tie_word_embeddings=False, dtype="bfloat16")
    config.save_pretrained(folder)
    with torch.device("meta"):
        shapes = {name: list(t.shape) for name, t in transformers.LlamaForCausalLM(config).state_dict().items()}
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = torch.Size(shape).numel() * 2
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps({**header, "__metadata__": {"format": "pt"}}).encode()
    raw += b" " * (-len(raw) % 8)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return offset


def test_qlora_counts_packed_four_bit_weights(tmp_path):
    folder = tmp_path / "llama"
    bf16_bytes = _header_only_llama(folder)
    script = tmp_path / "qlora.py"
    script.write_text(textwrap.dedent(SCRIPT))
    proc = subprocess.run([sys.executable, "-m", "gpushare.estimator_cli.cli", "--json", "--no-cache", "--no-warm",
                           "--gpu", "a100-40gb", "--mode", "fake", "--max-cpu-memory", "4G", str(script), str(folder)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["mode"] == "fake" and doc["iterations"] == 3
    kept = doc["targets"][0]["persistent_allocated_bytes"]
    # packed NF4 weights are at least half a byte per quantized parameter; bf16 weights would be over 134 MB
    assert LINEAR_PARAMETERS // 2 <= kept < 0.6 * bf16_bytes, (kept, bf16_bytes)
