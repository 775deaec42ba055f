"""Graph convolutional network on a synthetic citation-style graph in plain torch: a symmetric-normalised
sparse adjacency (COO) built on the host, ``torch.sparse.mm`` propagation, boolean train/val masks and
full-batch training with Adam."""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--nodes", type=int, default=50_000)
p.add_argument("--edges", type=int, default=500_000)
p.add_argument("--features", type=int, default=512)
p.add_argument("--hidden", type=int, default=256)
args = p.parse_args()
g = torch.Generator().manual_seed(0)
src, dst = torch.randint(0, args.nodes, (2, args.edges), generator=g)
loops = torch.arange(args.nodes)
index = torch.stack([torch.cat([src, dst, loops]), torch.cat([dst, src, loops])])
deg = torch.zeros(args.nodes).index_add_(0, index[0], torch.ones(index.size(1)))
norm = deg[index[0]].rsqrt() * deg[index[1]].rsqrt()
adj = torch.sparse_coo_tensor(index, norm, (args.nodes, args.nodes)).coalesce()
features = torch.randn(args.nodes, args.features, generator=g)
labels = torch.randint(0, 40, (args.nodes,), generator=g)
train_mask = torch.rand(args.nodes, generator=g) < 0.6


class GCN(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(args.features, args.hidden), nn.Linear(args.hidden, 40)

    def forward(self, x, a):
        x = F.dropout(F.relu(torch.sparse.mm(a, self.l1(x))), 0.5, self.training)
        return torch.sparse.mm(a, self.l2(x))


device = "cuda"
model = GCN().to(device)
adj, features, labels, train_mask = adj.to(device), features.to(device), labels.to(device), train_mask.to(device)
opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
for epoch in range(200):
    model.train()
    opt.zero_grad()
    out = model(features, adj)
    loss = F.cross_entropy(out[train_mask], labels[train_mask])
    loss.backward()
    opt.step()
    pred = out.argmax(1)
    acc = (pred[~train_mask] == labels[~train_mask]).float().mean()
    print(f"epoch {epoch} loss {loss.item():.3f} val acc {acc.item():.3f}")
