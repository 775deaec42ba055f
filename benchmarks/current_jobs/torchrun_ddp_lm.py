"""A causal LM fine-tuned with DistributedDataParallel, written for ``torchrun``: LOCAL_RANK from the
environment (no default), ``init_process_group("nccl")``, the local pretrained model loaded on every rank,
a DistributedSampler, bf16 autocast. Run as ``torchrun --nproc_per_node=N torchrun_ddp_lm.py MODEL_DIR``."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForCausalLM

p = argparse.ArgumentParser()
p.add_argument("model_dir")
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--seq", type=int, default=512)
args = p.parse_args()

local_rank = int(os.environ["LOCAL_RANK"])
dist.init_process_group("nccl")
torch.cuda.set_device(local_rank)
model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).to(local_rank)
model = DDP(model, device_ids=[local_rank])
tokens = torch.randint(0, model.module.config.vocab_size, (2048, args.seq))
sampler = torch.utils.data.distributed.DistributedSampler(tokens)
loader = torch.utils.data.DataLoader(tokens, batch_size=args.batch_size, sampler=sampler, pin_memory=True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
for epoch in range(3):
    sampler.set_epoch(epoch)
    for ids in loader:
        ids = ids.to(local_rank, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if dist.get_rank() == 0:
        print(f"epoch {epoch} loss {loss.item():.3f}")
dist.destroy_process_group()
