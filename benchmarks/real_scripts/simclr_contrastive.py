"""Contrastive self-supervised training (SimCLR-style): two augmented views per image, a CNN encoder
with a projection head, the NT-Xent loss with the diagonal removed by a boolean ``eye`` mask
(``sim[~mask]``), positives picked with a label mask, a LARS-like scaled SGD, channels-last AMP."""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=256)
p.add_argument("--temperature", type=float, default=0.5)
args = p.parse_args()
device = "cuda"


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2))


encoder = nn.Sequential(block(3, 64), block(64, 128), block(128, 256), block(256, 512), nn.AdaptiveAvgPool2d(1), nn.Flatten())
model = nn.Sequential(encoder, nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 128)).to(device, memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.3 * args.batch_size / 256, momentum=0.9, weight_decay=1e-6)
scaler = torch.amp.GradScaler()
images = torch.rand(args.batch_size * 4, 3, 32, 32)


def augment(x):
    flip = torch.rand(x.size(0), 1, 1, 1, device=x.device) < 0.5
    x = torch.where(flip, x.flip(3), x)
    return (x * (0.6 + 0.8 * torch.rand(x.size(0), 1, 1, 1, device=x.device))).clamp(0, 1)


for step in range(10_000):
    x = images[(step % 4) * args.batch_size:(step % 4 + 1) * args.batch_size].to(device, non_blocking=True)
    views = torch.cat([augment(x), augment(x)]).contiguous(memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=torch.float16):
        z = F.normalize(model(views).float(), dim=1)
    n = z.size(0)
    labels = torch.cat([torch.arange(n // 2) for _ in range(2)]).to(device)
    same = (labels[None] == labels[:, None])
    diag = torch.eye(n, dtype=torch.bool, device=device)
    sim = z @ z.t()
    positives = sim[same & ~diag].view(n, -1)
    negatives = sim[~same].view(n, -1)
    logits = torch.cat([positives, negatives], 1) / args.temperature
    loss = F.cross_entropy(logits, torch.zeros(n, dtype=torch.long, device=device))
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    if step % 20 == 0:
        print(step, f"{loss.item():.4f}")
