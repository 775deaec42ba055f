"""Convolutional VAE that saves a grid of reconstructions every few steps, as image-generation scripts
do: the decoded batch is moved with ``.to('cpu')``, scaled to bytes, turned into a NumPy array and written
as a PNG with PIL; the KL and reconstruction terms are logged with ``.item()``."""

import argparse
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

from _synthetic import workdir

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=128)
p.add_argument("--latent", type=int, default=128)
p.add_argument("--sample-every", type=int, default=1)
args = p.parse_args()
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
out_dir = workdir("vae_samples")


class VAE(nn.Module):
    def __init__(self, z):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 64, 4, 2, 1), nn.ReLU(), nn.Conv2d(64, 128, 4, 2, 1), nn.ReLU(),
                                 nn.Conv2d(128, 256, 4, 2, 1), nn.ReLU(), nn.Flatten())
        self.mu, self.logvar = nn.Linear(256 * 8 * 8, z), nn.Linear(256 * 8 * 8, z)
        self.up = nn.Linear(z, 256 * 8 * 8)
        self.dec = nn.Sequential(nn.ConvTranspose2d(256, 128, 4, 2, 1), nn.ReLU(),
                                 nn.ConvTranspose2d(128, 64, 4, 2, 1), nn.ReLU(),
                                 nn.ConvTranspose2d(64, 3, 4, 2, 1), nn.Sigmoid())

    def forward(self, x):
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.dec(self.up(z).view(-1, 256, 8, 8)), mu, logvar


def save_grid(batch, path, nrow=8):
    """The batch (N, 3, H, W) in [0, 1] as one PNG, rows of ``nrow`` images."""
    images = batch.detach().to("cpu")[: nrow * nrow]
    images = images.mul(255).add(0.5).clamp(0, 255).to(torch.uint8)
    n, c, h, w = images.shape
    grid = images.view(n // nrow, nrow, c, h, w).permute(0, 3, 1, 4, 2).reshape(n // nrow * h, nrow * w, c)
    Image.fromarray(grid.numpy()).save(path)


model = VAE(args.latent).to(device)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
data = torch.rand(2048, 3, 64, 64)
for step in range(1000):
    idx = torch.randint(0, len(data), (args.batch_size,))
    x = data[idx].to(device)
    recon, mu, logvar = model(x)
    rec = F.binary_cross_entropy(recon, x, reduction="sum") / x.size(0)
    kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / x.size(0)
    loss = rec + kl
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} rec {rec.item():.2f} kl {kl.item():.2f}")
    if step % args.sample_every == 0:
        save_grid(recon, os.path.join(out_dir, f"recon_{step:05d}.png"))
        np.save(os.path.join(out_dir, "latents.npy"), mu.detach().cpu().numpy())
