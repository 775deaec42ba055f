"""MNIST-style training as in the basic examples: idx files parsed by hand, a small CNN with dropout,
Adadelta with StepLR, per-batch logging and a test pass counting correct predictions."""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

from _synthetic import idx_files, read_idx

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--epochs", type=int, default=14)
args = p.parse_args()
images, labels = idx_files("mnist", 6000)
x = torch.from_numpy(read_idx(images).copy()).float().div(255).sub(0.1307).div(0.3081).unsqueeze(1)
y = torch.from_numpy(read_idx(labels).copy()).long()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch_size, shuffle=True,
                                     num_workers=1, pin_memory=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 32, 3, 1), nn.Conv2d(32, 64, 3, 1)
        self.dropout1, self.dropout2 = nn.Dropout(0.25), nn.Dropout(0.5)
        self.fc1, self.fc2 = nn.Linear(9216, 128), nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.dropout2(F.relu(self.fc1(torch.flatten(self.dropout1(x), 1))))
        return F.log_softmax(self.fc2(x), dim=1)


device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = Net().to(device)
optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
for epoch in range(1, args.epochs + 1):
    model.train()
    for batch_idx, (data, target) in enumerate(loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % 10 == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(loader.dataset)}]\tLoss: {loss.item():.6f}")
    model.eval()
    correct = 0
    with torch.no_grad():
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            correct += model(data).argmax(dim=1, keepdim=True).eq(target.view_as(target[:, None])).sum().item()
    print(f"accuracy {correct / len(loader.dataset):.3f}")
    scheduler.step()
