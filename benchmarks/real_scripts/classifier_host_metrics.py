"""Image classifier with its metrics computed on the host, as many training scripts do: predictions and
probabilities moved with ``.cpu()`` into a NumPy confusion matrix and a running accuracy, the class name
of the first sample looked up with ``int(tensor)``, and the top classes of the first sample printed in a
loop bounded by ``int(tensor)``."""

import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=256)
p.add_argument("--classes", type=int, default=100)
args = p.parse_args()
device = "cuda"
class_names = [f"class_{i:03d}" for i in range(args.classes)]


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


model = nn.Sequential(block(3, 64), block(64, 128), nn.MaxPool2d(2), block(128, 256), nn.MaxPool2d(2),
                      block(256, 512), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, args.classes)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
images = torch.randn(4096, 3, 32, 32)
labels = torch.randint(0, args.classes, (4096,))
confusion = np.zeros((args.classes, args.classes), dtype=np.int64)
seen = correct = 0
for step in range(1000):
    idx = torch.randint(0, len(images), (args.batch_size,))
    x, y = images[idx].to(device, non_blocking=True), labels[idx].to(device, non_blocking=True)
    logits = model(x)
    loss = F.cross_entropy(logits, y, label_smoothing=0.1)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()

    probs = logits.detach().softmax(dim=1).cpu()
    preds = probs.argmax(dim=1).numpy()
    truth = y.cpu().numpy()
    np.add.at(confusion, (truth, preds), 1)
    correct += (preds == truth).sum()
    seen += len(truth)
    first = int(logits[0].argmax())
    print(f"step {step} loss {loss.item():.3f} acc {correct / seen:.3f} first sample -> {class_names[first]}")
    for rank in range(int((probs[0] > 0.05).sum())):
        print(f"  candidate {rank}: p={probs[0].sort(descending=True).values[rank].item():.3f}")
