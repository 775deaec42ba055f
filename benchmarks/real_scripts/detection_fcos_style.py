"""Single-stage object detection in plain torch, FCOS-style: a small FPN backbone, a variable number of
boxes per image collated as a list, per-location target assignment with boolean masks (inside-box,
size range), a classification loss on every location and a box loss on the positives only
(``if pos.any()``), normalised by the number of positives counted with ``int(pos.sum())``."""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--size", type=int, default=512)
args = p.parse_args()
classes = 80


def conv(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.GroupNorm(16, cout), nn.ReLU())


class Detector(nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList([nn.Sequential(conv(3, 64, 2), conv(64, 64, 2), conv(64, 128, 2)),
                                     conv(128, 256, 2), conv(256, 256, 2)])
        self.cls = nn.Sequential(conv(128, 128), nn.Conv2d(128, classes, 3, 1, 1))
        self.lat = nn.ModuleList([nn.Conv2d(c, 128, 1) for c in (128, 256, 256)])
        self.reg = nn.Sequential(conv(128, 128), nn.Conv2d(128, 4, 3, 1, 1))

    def forward(self, x):
        feats = []
        for stage, lat in zip(self.stages, self.lat):
            x = stage(x)
            feats.append(lat(x))
        return [(self.cls(f), F.relu(self.reg(f))) for f in feats]


def locations(h, w, stride, device):
    ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    return torch.stack([xs.reshape(-1), ys.reshape(-1)], 1).float() * stride + stride // 2


def targets_for(points, boxes, labels, lo, hi):
    l = points[:, None, 0] - boxes[None, :, 0]
    t = points[:, None, 1] - boxes[None, :, 1]
    r = boxes[None, :, 2] - points[:, None, 0]
    b = boxes[None, :, 3] - points[:, None, 1]
    ltrb = torch.stack([l, t, r, b], 2)
    inside = ltrb.min(2).values > 0
    extent = ltrb.max(2).values
    ok = inside & (extent >= lo) & (extent <= hi)
    area = ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]))[None].expand_as(ok).clone()
    area[~ok] = float("inf")
    best_area, best = area.min(1)
    cls_t = labels[best].clone()
    cls_t[best_area == float("inf")] = classes
    return cls_t, ltrb[torch.arange(len(points), device=points.device), best]


device = "cuda"
model = Detector().to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
g = torch.Generator().manual_seed(0)
for it in range(10_000):
    images = torch.randn(args.batch_size, 3, args.size, args.size).to(device)
    gt = []
    for _ in range(args.batch_size):
        n = int(torch.randint(1, 20, (1,), generator=g))
        xy = torch.rand(n, 2, generator=g) * args.size * 0.7
        wh = torch.rand(n, 2, generator=g) * args.size * 0.3 + 8
        gt.append((torch.cat([xy, xy + wh], 1).to(device), torch.randint(0, classes, (n,), generator=g).to(device)))
    outs = model(images)
    cls_loss = reg_loss = 0.0
    num_pos = 0
    for (cls_out, reg_out), stride, (lo, hi) in zip(outs, (8, 16, 32), ((0, 64), (64, 128), (128, 1e8))):
        h, w = cls_out.shape[-2:]
        pts = locations(h, w, stride, device)
        for i, (boxes, labels) in enumerate(gt):
            cls_t, reg_t = targets_for(pts, boxes, labels, lo, hi)
            pos = cls_t < classes
            num_pos += int(pos.sum())
            onehot = F.one_hot(cls_t, classes + 1)[:, :classes].float()
            logits = cls_out[i].permute(1, 2, 0).reshape(-1, classes)
            cls_loss = cls_loss + F.binary_cross_entropy_with_logits(logits, onehot, reduction="sum")
            if pos.any():
                pred = reg_out[i].permute(1, 2, 0).reshape(-1, 4)[pos]
                reg_loss = reg_loss + F.smooth_l1_loss(pred, reg_t[pos] / stride, reduction="sum")
    loss = (cls_loss + reg_loss) / max(num_pos, 1)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if it % 20 == 0:
        print(it, loss.item(), num_pos)
