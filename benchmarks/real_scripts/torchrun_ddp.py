"""A script written for ``torchrun``: LOCAL_RANK/WORLD_SIZE from the environment, a process group and
DistributedDataParallel only when launched with more than one process, a DistributedSampler, and
``torch.cuda.set_device(local_rank)``. Run directly it trains on one GPU, as ``torchrun
--nproc_per_node=1`` would."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=256)
args = p.parse_args()
local_rank, world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
torch.cuda.set_device(local_rank)
if world > 1:
    dist.init_process_group("nccl")
device = torch.device("cuda", local_rank)
model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 1000)).to(device)
if world > 1:
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
data = torch.utils.data.TensorDataset(torch.randn(20_000, 1024), torch.randint(0, 1000, (20_000,)))
sampler = torch.utils.data.distributed.DistributedSampler(data, num_replicas=world, rank=int(os.environ.get("RANK", 0)))
loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=2, pin_memory=True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
stream = torch.cuda.Stream()
for epoch in range(10):
    sampler.set_epoch(epoch)
    for x, y in loader:
        with torch.cuda.stream(stream):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        torch.cuda.current_stream().wait_stream(stream)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if local_rank == 0:
        print(f"epoch {epoch} loss {loss.item():.3f} mem {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
