"""Gradient accumulation: several micro-batches per optimizer step, loss scaled by the accumulation count.

Gradients accumulate in place between steps, so they are alive through every micro-batch's forward.
"""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class ConvNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(128, 256, 3, padding=1), nn.BatchNorm2d(256), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(256, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=64, help="micro-batch size")
    parser.add_argument("--accumulation-steps", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=64)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = args.batch_size * args.accumulation_steps * 4
    data = TensorDataset(torch.randn(n, 3, args.image_size, args.image_size), torch.randint(0, 10, (n,)))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    model = ConvNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer.zero_grad()
    for i, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        loss = nn.functional.cross_entropy(model(x), y) / args.accumulation_steps
        loss.backward()
        if (i + 1) % args.accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
            print(f"update {(i + 1) // args.accumulation_steps} loss {loss.item() * args.accumulation_steps:.4f}")


if __name__ == "__main__":
    main()
