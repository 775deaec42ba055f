"""Causal-LM fine-tuning in the plain-loop style of Hugging Face examples: a Llama-architecture model
built from a config (no weights downloaded), a synthetic token corpus, AdamW, bf16 autocast, gradient
checkpointing, and an attention mask from the collator."""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--seq-len", type=int, default=512)
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                     num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = LlamaForCausalLM(config).to(device)
model.gradient_checkpointing_enable()
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
corpus = torch.randint(0, config.vocab_size, (args.batch_size * (args.steps + 1), args.seq_len))

for step in range(args.steps):
    ids = corpus[step * args.batch_size:(step + 1) * args.batch_size].to(device)
    attention_mask = torch.ones_like(ids)
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        out = model(input_ids=ids, attention_mask=attention_mask, labels=ids)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if step % 5 == 0:
        print(f"step {step} loss {out.loss.item():.4f}")
