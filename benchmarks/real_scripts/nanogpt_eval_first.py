"""GPT training that evaluates before it trains, as single-file GPT trainers do: ``torch.compile`` on,
and at iteration 0 ``estimate_loss()`` averages 200 batches of each split under ``no_grad`` into host
tensors, then keeps the best validation loss and saves a checkpoint when it improves."""

import argparse
import math
import os

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

from _synthetic import token_memmap, workdir

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=12)
p.add_argument("--block-size", type=int, default=1024)
p.add_argument("--n-layer", type=int, default=12)
p.add_argument("--n-head", type=int, default=12)
p.add_argument("--n-embd", type=int, default=768)
p.add_argument("--eval-iters", type=int, default=200)
p.add_argument("--eval-interval", type=int, default=2000)
p.add_argument("--compile", type=int, default=1)
args = p.parse_args()
vocab = 50304
out_dir = workdir("nanogpt_eval_first")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        d = args.n_embd
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, args.n_head, C // args.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, args.n_embd), nn.Embedding(args.block_size, args.n_embd)
        self.h = nn.ModuleList(Block() for _ in range(args.n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(args.n_embd), nn.Linear(args.n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


splits = {"train": np.memmap(token_memmap("nanogpt", 2_000_000, vocab), dtype=np.uint16, mode="r")}
splits["val"] = splits["train"][-200_000:]
device = "cuda"
ctx = torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)


def get_batch(split):
    data = splits[split]
    ix = torch.randint(len(data) - args.block_size, (args.batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + args.block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + args.block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


model = GPT().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
raw_model = model
if args.compile:
    model = torch.compile(model)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            X, Y = get_batch(split)
            with ctx:
                _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


best_val_loss = 1e9
X, Y = get_batch("train")
for iter_num in range(600000):
    lr = 6e-4 * 0.5 * (1 + math.cos(math.pi * min(iter_num, 600000) / 600000))
    for group in optimizer.param_groups:
        group["lr"] = lr
    if iter_num % args.eval_interval == 0:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses["val"] < best_val_loss:
            best_val_loss = losses["val"]
            if iter_num > 0:
                torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                            "iter_num": iter_num, "best_val_loss": best_val_loss}, os.path.join(out_dir, "ckpt.pt"))
    with ctx:
        logits, loss = model(X, Y)
    X, Y = get_batch("train")
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
