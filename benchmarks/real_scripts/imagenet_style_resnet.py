"""ImageNet-style classification in the manner of the classic reference script: an image folder read
with PIL through a DataLoader with workers and pinned memory, the device chosen through
``torch.accelerator``, a ResNet-18 written out in plain torch, AMP with GradScaler, top-k accuracy and
average meters fed with ``.item()``."""

import argparse
import os

import numpy as np
import torch
import torch.nn as nn
from PIL import Image

from _synthetic import image_folder

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=128)
p.add_argument("--workers", type=int, default=4)
args = p.parse_args()


class Folder(torch.utils.data.Dataset):
    def __init__(self, root):
        self.items = [(os.path.join(root, c, f), i) for i, c in enumerate(sorted(os.listdir(root)))
                      if not c.startswith(".") for f in sorted(os.listdir(os.path.join(root, c)))]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        img = np.asarray(Image.open(path).convert("RGB").resize((224, 224)), dtype=np.float32) / 255.0
        return torch.from_numpy(img).permute(2, 0, 1), label


class Basic(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        y = self.b2(self.c2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


def resnet18(classes=1000):
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Basic(cin, cout, stride), Basic(cout, cout, 1)]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes))


def accuracy(output, target, topk=(1, 5)):
    with torch.no_grad():
        _, pred = output.topk(max(topk), 1, True, True)
        correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
        return [correct[:k].reshape(-1).float().sum(0, keepdim=True).mul_(100.0 / target.size(0)) for k in topk]


if torch.accelerator.is_available():
    torch.accelerator.set_device_index(0)
    device = torch.accelerator.current_accelerator()
else:
    device = torch.device("cpu")
model = resnet18().to(device)
criterion = nn.CrossEntropyLoss().to(device)
optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
scaler = torch.amp.GradScaler("cuda")
loader = torch.utils.data.DataLoader(Folder(image_folder("imagenet", 10, 40)), batch_size=args.batch_size,
                                     shuffle=True, num_workers=args.workers, pin_memory=True, drop_last=True)
top1_sum, seen = 0.0, 0
for epoch in range(90):
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            output = model(images)
            loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target)
        top1_sum += acc1[0].item() * images.size(0)
        seen += images.size(0)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    print(f"epoch {epoch} acc@1 {top1_sum / max(seen, 1):.2f}")
