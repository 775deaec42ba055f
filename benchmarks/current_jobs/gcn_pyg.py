"""Node classification with PyTorch Geometric, as its gcn.py example does it on a Planetoid-style citation
graph: GCNConv layers with cached normalisation, full-batch training, masks for train/val/test."""

import argparse

import torch
import torch.nn.functional as F
from torch_geometric.data import Data
from torch_geometric.nn import GCNConv
from torch_geometric.utils import to_undirected

p = argparse.ArgumentParser()
p.add_argument("--nodes", type=int, default=19_717)  # PubMed, the example's largest Planetoid graph
p.add_argument("--features", type=int, default=500)
p.add_argument("--hidden", type=int, default=256)
args = p.parse_args()

g = torch.Generator().manual_seed(0)
edges = to_undirected(torch.randint(0, args.nodes, (2, 9 * args.nodes // 4), generator=g))
data = Data(x=torch.randn(args.nodes, args.features, generator=g), edge_index=edges,
            y=torch.randint(0, 40, (args.nodes,), generator=g))
data.train_mask = torch.rand(args.nodes, generator=g) < 0.6
data.val_mask = ~data.train_mask


class GCN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = GCNConv(args.features, args.hidden, cached=True)
        self.conv2 = GCNConv(args.hidden, 40, cached=True)

    def forward(self, x, edge_index):
        x = F.dropout(x, p=0.5, training=self.training)
        x = self.conv1(x, edge_index).relu()
        x = F.dropout(x, p=0.5, training=self.training)
        return self.conv2(x, edge_index)


device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model, data = GCN().to(device), data.to(device)
opt = torch.optim.Adam([dict(params=model.conv1.parameters(), weight_decay=5e-4),
                        dict(params=model.conv2.parameters(), weight_decay=0)], lr=0.01)
for epoch in range(1, 201):
    model.train()
    opt.zero_grad()
    out = model(data.x, data.edge_index)
    loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
    loss.backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        pred = model(data.x, data.edge_index).argmax(dim=-1)
        acc = (pred[data.val_mask] == data.y[data.val_mask]).float().mean()
    print(f"epoch {epoch:03d} loss {loss:.4f} val {acc:.4f}")
