"""GPT-2 language-model training with Hugging Face ``accelerate``: ``Accelerator(mixed_precision='bf16',
gradient_accumulation_steps=4)``, ``accumulate()`` context, a token-memmap dataset through a DataLoader
with workers, a linear warm-up schedule from transformers."""

import argparse

import numpy as np
import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

from _synthetic import token_memmap

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--seq-len", type=int, default=512)
args = p.parse_args()


class Blocks(torch.utils.data.Dataset):
    def __init__(self, path, seq):
        self.data, self.seq = np.memmap(path, dtype=np.uint16, mode="r"), seq

    def __len__(self):
        return len(self.data) // (self.seq + 1)

    def __getitem__(self, i):
        chunk = torch.from_numpy(self.data[i * (self.seq + 1):(i + 1) * (self.seq + 1)].astype(np.int64))
        return {"input_ids": chunk[:-1], "labels": chunk[:-1].clone()}


accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=4)
model = GPT2LMHeadModel(GPT2Config(n_positions=1024, n_embd=768, n_layer=12, n_head=12))
loader = torch.utils.data.DataLoader(Blocks(token_memmap("accelerate-gpt2", 1_000_000, 50257), args.seq_len),
                                     batch_size=args.batch_size, shuffle=True, num_workers=2, pin_memory=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
scheduler = get_linear_schedule_with_warmup(optimizer, 100, 10_000)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
model.train()
for step, batch in enumerate(loader):
    with accelerator.accumulate(model):
        loss = model(**batch).loss
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    if step % 50 == 0:
        accelerator.print(f"step {step} loss {loss.item():.3f}")
