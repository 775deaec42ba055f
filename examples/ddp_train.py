"""A torchrun DDP training script as researchers write it (small MLP): ``torchrun --nproc_per_node=N ddp_train.py``.

Started without a launcher (no ``LOCAL_RANK``) it trains the same model in one process without DDP: the
reference the per-rank estimates are compared with (tests/estimator/test_launchers.py)."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--width", type=int, default=2048)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--bucket-view", action="store_true", help="DDP(gradient_as_bucket_view=True)")
args = parser.parse_args()

distributed = "LOCAL_RANK" in os.environ
local_rank = int(os.environ["LOCAL_RANK"]) if distributed else 0
if distributed:
    dist.init_process_group("nccl")
torch.cuda.set_device(local_rank)
device = torch.device("cuda", local_rank)

model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.ReLU())
                              for _ in range(6)], torch.nn.Linear(args.width, 10)).to(device)
if distributed:
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=args.bucket_view)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(args.steps):
    x = torch.randn(args.batch_size, args.width, device=device)
    y = torch.randint(0, 10, (args.batch_size,), device=device)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if not distributed or dist.get_rank() == 0:
        print(f"step {step} loss {loss.item():.3f}")
if distributed:
    dist.destroy_process_group()
