"""3D U-Net segmentation in the manner of medical-imaging training scripts (MONAI-style): patches sampled
from CT-like volumes, instance norm, Dice + cross-entropy loss, AMP with a GradScaler, sliding-window
validation every epoch."""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--patch", type=int, default=96)
p.add_argument("--batch-size", type=int, default=2)
p.add_argument("--channels", type=int, nargs="+", default=[32, 64, 128, 256])
p.add_argument("--classes", type=int, default=14)
args = p.parse_args()


def block(cin, cout):
    return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1, bias=False), nn.InstanceNorm3d(cout, affine=True),
                         nn.LeakyReLU(0.01, inplace=True), nn.Conv3d(cout, cout, 3, padding=1, bias=False),
                         nn.InstanceNorm3d(cout, affine=True), nn.LeakyReLU(0.01, inplace=True))


class UNet3D(nn.Module):
    def __init__(self, chans, classes):
        super().__init__()
        self.down = nn.ModuleList(block(a, b) for a, b in zip([1, *chans[:-1]], chans))
        self.up = nn.ModuleList(nn.ConvTranspose3d(b, a, 2, stride=2) for a, b in zip(chans[:-1], chans[1:]))
        self.dec = nn.ModuleList(block(2 * a, a) for a in chans[:-1])
        self.head = nn.Conv3d(chans[0], classes, 1)

    def forward(self, x):
        skips = []
        for i, enc in enumerate(self.down):
            x = enc(x if i == 0 else F.max_pool3d(x, 2))
            skips.append(x)
        for up, dec, skip in zip(reversed(self.up), reversed(self.dec), reversed(skips[:-1])):
            x = dec(torch.cat([up(x), skip], 1))
        return self.head(x)


def dice_ce(logits, target):
    onehot = F.one_hot(target, logits.shape[1]).permute(0, 4, 1, 2, 3).float()
    probs = logits.softmax(1)
    inter = (probs * onehot).sum((2, 3, 4))
    dice = 1 - (2 * inter + 1e-5) / (probs.sum((2, 3, 4)) + onehot.sum((2, 3, 4)) + 1e-5)
    return dice.mean() + F.cross_entropy(logits, target)


volumes = [torch.randn(1, 160, 160, 128) for _ in range(4)]
labels = [torch.randint(0, args.classes, (160, 160, 128)) for _ in range(4)]
model = UNet3D(args.channels, args.classes).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-5)
scaler = torch.amp.GradScaler("cuda")
P = args.patch
for epoch in range(50):
    model.train()
    for it in range(20):
        idx = torch.randint(0, len(volumes), (args.batch_size,)).tolist()
        x0, y0, z0 = (int(torch.randint(0, s - P + 1, ())) for s in (160, 160, 128))
        x = torch.stack([volumes[i][:, x0:x0 + P, y0:y0 + P, z0:z0 + P] for i in idx]).cuda(non_blocking=True)
        y = torch.stack([labels[i][x0:x0 + P, y0:y0 + P, z0:z0 + P] for i in idx]).cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = dice_ce(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
