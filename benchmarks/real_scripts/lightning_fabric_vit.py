"""Vision transformer trained with Lightning Fabric: ``Fabric(precision='bf16-mixed')``, ``setup`` and
``setup_dataloaders``, ``fabric.backward``, a ViT-B/16-sized model written in plain torch with SDPA."""

import argparse

import torch
import torch.nn as nn
from lightning.fabric import Fabric

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=64)
args = p.parse_args()


class ViT(nn.Module):
    def __init__(self, dim=768, depth=12, heads=12, patch=16, image=224, classes=1000):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, activation="gelu", batch_first=True, norm_first=True)
        self.blocks, self.norm, self.head = nn.TransformerEncoder(layer, depth), nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], 1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


fabric = Fabric(accelerator="cuda" if torch.cuda.is_available() else "cpu", devices=1, precision="bf16-mixed")
fabric.launch()
model = ViT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
model, optimizer = fabric.setup(model, optimizer)
data = torch.utils.data.TensorDataset(torch.randn(args.batch_size * 4, 3, 224, 224), torch.randint(0, 1000, (args.batch_size * 4,)))
loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True))
for epoch in range(100):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y, label_smoothing=0.1)
        optimizer.zero_grad()
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
    fabric.print(f"epoch {epoch} loss {loss.item():.3f}")
