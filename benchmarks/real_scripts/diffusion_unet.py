"""Denoising-diffusion training with diffusers: a ``UNet2DModel`` built from its config, a
``DDPMScheduler`` adding noise at random timesteps drawn on the device, fp16 autocast with GradScaler,
an exponential moving average of the weights, synthetic 64x64 images."""

import argparse
import copy

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DModel

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--resolution", type=int, default=64)
args = p.parse_args()
device = "cuda"
model = UNet2DModel(sample_size=args.resolution, in_channels=3, out_channels=3, layers_per_block=2,
                    block_out_channels=(128, 128, 256, 256, 512, 512),
                    down_block_types=("DownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
                    up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D")).to(device)
ema = copy.deepcopy(model).requires_grad_(False)
scheduler = DDPMScheduler(num_train_timesteps=1000)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-6)
scaler = torch.amp.GradScaler("cuda")
images = torch.rand(args.batch_size * 8, 3, args.resolution, args.resolution) * 2 - 1
for step in range(100_000):
    clean = images[(step % 8) * args.batch_size:(step % 8 + 1) * args.batch_size].to(device)
    noise = torch.randn_like(clean)
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (clean.shape[0],), device=device).long()
    noisy = scheduler.add_noise(clean, noise, timesteps)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = F.mse_loss(model(noisy, timesteps).sample.float(), noise)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    with torch.no_grad():
        for pe, pm in zip(ema.parameters(), model.parameters()):
            pe.lerp_(pm, 1 - 0.9999)
    if step % 100 == 0:
        print(step, loss.item())
