"""Mixed-precision training with ``torch.autocast('cuda')`` and a GradScaler, the usual AMP recipe.

On the GPU, linear/conv layers run in float16 under autocast and their fp16 inputs are what backward
keeps, so the peak is well below the float32 run of the same model (try ``--no-amp``).
"""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def make_model(width: int, depth: int, classes: int) -> nn.Module:
    layers = [nn.Linear(1024, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--no-amp", action="store_true")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    use_amp = device == "cuda" and not args.no_amp

    data = TensorDataset(torch.randn(args.batch_size * 3, 1024), torch.randint(0, 100, (args.batch_size * 3,)))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    model = make_model(args.width, args.depth, 100).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
    for epoch in range(args.epochs):
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=use_amp):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            print(f"epoch {epoch} batch {i} loss {loss.item():.3f} scale {scaler.get_scale() if use_amp else 1}")


if __name__ == "__main__":
    main()
