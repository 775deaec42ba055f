"""Translation-style sequence-to-sequence training with ``nn.Transformer``: padded batches with key
padding masks built from lengths, a square subsequent mask, label smoothing with ``ignore_index`` on the
padding, a Noam learning-rate schedule, and tokens-per-second logging from ``(tgt != PAD).sum()``."""

import argparse

import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--max-len", type=int, default=128)
args = p.parse_args()
PAD, V = 0, 16000
device = "cuda"


class Seq2Seq(nn.Module):
    def __init__(self, d=512):
        super().__init__()
        self.src_emb, self.tgt_emb = nn.Embedding(V, d, padding_idx=PAD), nn.Embedding(V, d, padding_idx=PAD)
        self.pos = nn.Embedding(args.max_len, d)
        self.transformer = nn.Transformer(d, 8, 6, 6, 2048, dropout=0.1, batch_first=True)
        self.out = nn.Linear(d, V)

    def forward(self, src, tgt):
        pos_s = torch.arange(src.size(1), device=src.device)
        pos_t = torch.arange(tgt.size(1), device=tgt.device)
        causal = self.transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        h = self.transformer(self.src_emb(src) + self.pos(pos_s), self.tgt_emb(tgt) + self.pos(pos_t), tgt_mask=causal,
                             src_key_padding_mask=src == PAD, tgt_key_padding_mask=tgt == PAD,
                             memory_key_padding_mask=src == PAD)
        return self.out(h)


model = Seq2Seq().to(device)
opt = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 512 ** -0.5 * min((s + 1) ** -0.5, (s + 1) * 4000 ** -1.5))
crit = nn.CrossEntropyLoss(ignore_index=PAD, label_smoothing=0.1)
g = torch.Generator().manual_seed(0)
for step in range(100_000):
    ls, lt = torch.randint(8, args.max_len, (args.batch_size,), generator=g), torch.randint(8, args.max_len, (args.batch_size,), generator=g)
    src = torch.randint(1, V, (args.batch_size, int(ls.max())), generator=g)
    tgt = torch.randint(1, V, (args.batch_size, int(lt.max()) + 1), generator=g)
    src[torch.arange(src.size(1))[None] >= ls[:, None]] = PAD
    tgt[torch.arange(tgt.size(1))[None] >= lt[:, None] + 1] = PAD
    src, tgt = src.to(device), tgt.to(device)
    logits = model(src, tgt[:, :-1])
    loss = crit(logits.reshape(-1, V), tgt[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    ntokens = (tgt[:, 1:] != PAD).sum().item()
    if step % 50 == 0:
        print(f"step {step} loss {loss.item():.3f} tokens {ntokens}")
