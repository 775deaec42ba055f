"""Batch inference: no optimizer, so ``gpu-estimate`` reports the forward-only peak of the whole run."""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=3)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).to(device).eval()
    data = TensorDataset(torch.randn(args.batch_size * args.batches, 3, 64, 64))
    predictions = []
    with torch.no_grad():
        for (x,) in DataLoader(data, batch_size=args.batch_size):
            predictions.append(model(x.to(device)).argmax(dim=1))
    print(f"{len(predictions)} batches predicted")


if __name__ == "__main__":
    main()
