"""A script with a bug: the classifier's input size does not match the features (a real-world classic).

``gpu-estimate`` reports the script's own traceback and exits with status 3, never an estimate.
"""

import argparse

import torch
import torch.nn as nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten())
    classifier = nn.Linear(16 * 8 * 8, 10)  # should be 16 * 4 * 4
    model = nn.Sequential(features, classifier).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(args.batch_size, 3, 32, 32, device=device)
    loss = model(x).sum()
    loss.backward()
    optimizer.step()


if __name__ == "__main__":
    main()
