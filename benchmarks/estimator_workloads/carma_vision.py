"""CARMA's vision training workloads (itu-rad/CARMA ``workloads/{resnet50,vgg,mobilenet}.py`` and
``*_cifar100.py``), with ImageFolder/CIFAR replaced by same-shaped synthetic float tensors.

Same loop as CARMA's: Adam (ImageNet scripts) or AdamW(weight_decay=1e-4) (CIFAR-100 scripts), lr 1e-3,
``optimizer.zero_grad()`` at the top, CrossEntropyLoss, ``loss.item()`` logging, then a ``no_grad``
validation pass.
"""

import argparse
import os
import sys

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo import MODELS  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--num_classes", type=int, default=1000)
    parser.add_argument("--optimizer", choices=["adam", "adamw"], default="adam")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = args.batch_size * args.steps
    images = torch.zeros(n, 3, args.image_size, args.image_size)  # ToTensor() output: float32
    labels = torch.randint(0, args.num_classes, (n,))
    train_loader = DataLoader(TensorDataset(images, labels), batch_size=args.batch_size, shuffle=True, num_workers=4)
    model = MODELS[args.model](args.num_classes)
    model.to(device)
    criterion = nn.CrossEntropyLoss()
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    model.train()
    running_loss = 0.0
    for inputs, targets in train_loader:
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = criterion(outputs, targets)
        loss.backward()
        optimizer.step()
        running_loss += loss.item()
    model.eval()
    with torch.no_grad():
        for inputs, targets in train_loader:
            outputs = model(inputs.to(device))
    print(f"loss {running_loss:.3f}")


if __name__ == "__main__":
    main()
