"""Text-to-image fine-tuning in the manner of diffusers' train_text_to_image.py: scheduler, tokenizer, text
encoder, VAE and UNet loaded from a local pipeline folder, VAE and text encoder frozen in fp16, the UNet
trained under accelerate's fp16 mixed precision with an EMA copy, gradient checkpointing, 8-bit-free AdamW."""

import argparse
import copy

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from diffusers.training_utils import EMAModel
from transformers import AutoTokenizer, CLIPTextModel

from _data import sentences

p = argparse.ArgumentParser()
p.add_argument("pipeline_dir")
p.add_argument("--resolution", type=int, default=256)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--use-ema", action="store_true", default=True)
args = p.parse_args()

accelerator = Accelerator(mixed_precision="fp16", gradient_accumulation_steps=2)
scheduler = DDPMScheduler.from_pretrained(args.pipeline_dir, subfolder="scheduler")
tokenizer = AutoTokenizer.from_pretrained(args.pipeline_dir, subfolder="tokenizer")
text_encoder = CLIPTextModel.from_pretrained(args.pipeline_dir, subfolder="text_encoder")
vae = AutoencoderKL.from_pretrained(args.pipeline_dir, subfolder="vae")
unet = UNet2DConditionModel.from_pretrained(args.pipeline_dir, subfolder="unet")
vae.requires_grad_(False)
text_encoder.requires_grad_(False)
unet.enable_gradient_checkpointing()
ema = EMAModel(copy.deepcopy(unet).parameters(), model_cls=UNet2DConditionModel, model_config=unet.config) if args.use_ema else None

captions = sentences(64, words=20)
images = torch.rand(64, 3, args.resolution, args.resolution) * 2 - 1
ids = tokenizer(captions, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, ids), batch_size=args.batch_size, shuffle=True)
optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-5, weight_decay=1e-2)
unet, optimizer, loader = accelerator.prepare(unet, optimizer, loader)
weight_dtype = torch.float16
text_encoder.to(accelerator.device, dtype=weight_dtype)
vae.to(accelerator.device, dtype=weight_dtype)
if ema is not None:
    ema.to(accelerator.device)

for epoch in range(100):
    for pixels, input_ids in loader:
        with accelerator.accumulate(unet):
            latents = vae.encode(pixels.to(weight_dtype)).latent_dist.sample() * vae.config.scaling_factor
            noise = torch.randn_like(latents)
            t = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device).long()
            noisy = scheduler.add_noise(latents, noise, t)
            hidden = text_encoder(input_ids, return_dict=False)[0]
            pred = unet(noisy, t, hidden, return_dict=False)[0]
            loss = F.mse_loss(pred.float(), noise.float(), reduction="mean")
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(unet.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients and ema is not None:
            ema.step(unet.parameters())
