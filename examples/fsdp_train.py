"""A torchrun FSDP2 (``fully_shard``) training script (small MLP): ``torchrun --nproc_per_node=N fsdp_train.py``."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--width", type=int, default=2048)
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl")

model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.ReLU())
                              for _ in range(6)], torch.nn.Linear(args.width, 10)).cuda()
for block in model:
    fully_shard(block)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(args.steps):
    x = torch.randn(args.batch_size, args.width, device="cuda")
    y = torch.randint(0, 10, (args.batch_size,), device="cuda")
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
dist.destroy_process_group()
