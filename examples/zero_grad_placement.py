"""The xMem Figure 1 experiment: where ``optimizer.zero_grad()`` sits changes the peak.

``--placement top`` clears gradients at the top of the loop, before the forward pass;
``--placement before-backward`` clears them after the forward pass, right before ``backward()``, so the
previous step's gradients are still alive while the forward pass builds its activations: a higher peak.
"""

import argparse

import torch
import torch.nn as nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--placement", choices=["top", "before-backward"], default="top")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(args.width, args.width), nn.ReLU())],
                          nn.Linear(args.width, 10)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for step in range(args.steps):
        x = torch.randn(args.batch_size, args.width, device=device)
        y = torch.randint(0, 10, (args.batch_size,), device=device)
        if args.placement == "top":
            optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        if args.placement == "before-backward":
            optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
