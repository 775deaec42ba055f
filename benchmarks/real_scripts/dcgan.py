"""DCGAN in the classic style: generator and discriminator with their own Adam optimizers, real/fake
label tensors made with ``torch.full(..., device=device)``, the discriminator stepped on real and
detached fake batches, then the generator; ``D(x).mean().item()`` logged."""

import argparse

import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=128)
p.add_argument("--nz", type=int, default=100)
args = p.parse_args()
device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
ngf = ndf = 64
netG = nn.Sequential(
    nn.ConvTranspose2d(args.nz, ngf * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 8), nn.ReLU(True),
    nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
    nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
    nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
    nn.ConvTranspose2d(ngf, 3, 4, 2, 1, bias=False), nn.Tanh()).to(device)
netD = nn.Sequential(
    nn.Conv2d(3, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
    nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
    nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 4), nn.LeakyReLU(0.2, inplace=True),
    nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 8), nn.LeakyReLU(0.2, inplace=True),
    nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False), nn.Sigmoid(), nn.Flatten(0)).to(device)
criterion = nn.BCELoss()
optD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
optG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
dataset = torch.utils.data.TensorDataset(torch.rand(args.batch_size * 10, 3, 64, 64) * 2 - 1)
loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=2)
for epoch in range(25):
    for i, (real,) in enumerate(loader):
        netD.zero_grad()
        real = real.to(device)
        label = torch.full((real.size(0),), 1.0, dtype=torch.float, device=device)
        errD_real = criterion(netD(real), label)
        errD_real.backward()
        fake = netG(torch.randn(real.size(0), args.nz, 1, 1, device=device))
        label.fill_(0.0)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)
        errD_fake.backward()
        optD.step()
        netG.zero_grad()
        label.fill_(1.0)
        output = netD(fake)
        errG = criterion(output, label)
        errG.backward()
        optG.step()
        print(f"[{epoch}][{i}] Loss_D {(errD_real + errD_fake).item():.4f} Loss_G {errG.item():.4f} D(G(z)) {output.mean().item():.4f}")
