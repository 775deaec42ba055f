"""Control flow that depends on GPU values: hard-example mining and an early stop on the loss.

Fake mode has no values, so ``gpu-estimate`` falls back to profile mode (real CPU execution) and says why.
"""

import argparse

import torch
import torch.nn as nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--target-loss", type=float, default=0.05)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 2)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(100):
        x = torch.randn(args.batch_size, 256, device=device)
        y = (x[:, 0] > 0).long()
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        hard = losses > losses.median()  # train on the harder half only: boolean-mask indexing
        loss = losses[hard].mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < args.target_loss:
            print("converged")
            break


if __name__ == "__main__":
    main()
