"""GPT training in the style of single-file GPT trainers: a token memmap read with random offsets,
gradient accumulation, bf16 autocast context, GradScaler, cosine learning rate, pinned non-blocking
copies, an initial evaluation under no_grad, and ``torch.compile`` on by default."""

import argparse
import math

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

from _synthetic import token_memmap

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=12)
p.add_argument("--block-size", type=int, default=1024)
p.add_argument("--n-layer", type=int, default=12)
p.add_argument("--n-embd", type=int, default=768)
p.add_argument("--grad-accum", type=int, default=5)
p.add_argument("--compile", type=int, default=1)
args = p.parse_args()
vocab = 50304


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj, self.h = nn.Linear(d, 3 * d), nn.Linear(d, d), h
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.0))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, args.n_embd), nn.Embedding(args.block_size, args.n_embd)
        self.blocks = nn.ModuleList(Block(args.n_embd, 12) for _ in range(args.n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(args.n_embd), nn.Linear(args.n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


data = np.memmap(token_memmap("nanogpt", 2_000_000, vocab), dtype=np.uint16, mode="r")
device = "cuda"
torch.backends.cuda.matmul.allow_tf32 = True
ctx = torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)


def get_batch():
    ix = torch.randint(len(data) - args.block_size, (args.batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + args.block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + args.block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


model = GPT().to(device)
scaler = torch.amp.GradScaler("cuda", enabled=False)
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=6e-4, betas=(0.9, 0.95), fused=True)
if args.compile:
    model = torch.compile(model)


@torch.no_grad()
def estimate_loss():
    model.eval()
    losses = torch.zeros(2)
    for k in range(2):
        X, Y = get_batch()
        with ctx:
            _, loss = model(X, Y)
        losses[k] = loss.item()
    model.train()
    return losses.mean()


X, Y = get_batch()
for it in range(5000):
    lr = 6e-4 * 0.5 * (1 + math.cos(math.pi * it / 5000))
    for g in optimizer.param_groups:
        g["lr"] = lr
    if it % 250 == 0:
        print(f"step {it}: val loss {estimate_loss():.4f}")
    for micro in range(args.grad_accum):
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / args.grad_accum
        X, Y = get_batch()
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
