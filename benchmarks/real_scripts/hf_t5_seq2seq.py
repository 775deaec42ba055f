"""Sequence-to-sequence fine-tuning of a T5 model built from its config with transformers' Adafactor, padded source and target batches (``-100`` in the labels' padding)."""

import argparse

import torch
from transformers import T5Config, T5ForConditionalGeneration
from transformers.optimization import Adafactor

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--src-len", type=int, default=512)
p.add_argument("--tgt-len", type=int, default=128)
args = p.parse_args()

config = T5Config(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12,
                  decoder_start_token_id=0, pad_token_id=0)
model = T5ForConditionalGeneration(config).cuda()
model.config.use_cache = False
optimizer = Adafactor(model.parameters(), lr=1e-3, relative_step=False, scale_parameter=False)
g = torch.Generator().manual_seed(0)
for step in range(1000):
    src_lengths = torch.randint(args.src_len // 2, args.src_len + 1, (args.batch_size,), generator=g)
    tgt_lengths = torch.randint(args.tgt_len // 2, args.tgt_len + 1, (args.batch_size,), generator=g)
    input_ids = torch.randint(2, config.vocab_size, (args.batch_size, args.src_len), generator=g)
    attention_mask = (torch.arange(args.src_len)[None] < src_lengths[:, None]).long()
    labels = torch.randint(2, config.vocab_size, (args.batch_size, args.tgt_len), generator=g)
    labels[torch.arange(args.tgt_len)[None] >= tgt_lengths[:, None]] = -100
    batch = {"input_ids": input_ids.cuda(), "attention_mask": attention_mask.cuda(), "labels": labels.cuda()}
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if step % 20 == 0:
        print(step, loss.item())
