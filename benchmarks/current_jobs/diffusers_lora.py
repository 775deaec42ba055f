"""Text-to-image LoRA in the manner of diffusers' train_text_to_image_lora.py: every pretrained part frozen
and cast to fp16, PEFT LoRA adapters added to the UNet's attention projections, only the adapters trained
(kept in float32) under fp16 mixed precision."""

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from diffusers.training_utils import cast_training_params
from peft import LoraConfig
from transformers import AutoTokenizer, CLIPTextModel

from _data import sentences

p = argparse.ArgumentParser()
p.add_argument("pipeline_dir")
p.add_argument("--resolution", type=int, default=512)
p.add_argument("--batch-size", type=int, default=1)
p.add_argument("--rank", type=int, default=4)
args = p.parse_args()

accelerator = Accelerator(mixed_precision="fp16")
scheduler = DDPMScheduler.from_pretrained(args.pipeline_dir, subfolder="scheduler")
tokenizer = AutoTokenizer.from_pretrained(args.pipeline_dir, subfolder="tokenizer")
text_encoder = CLIPTextModel.from_pretrained(args.pipeline_dir, subfolder="text_encoder")
vae = AutoencoderKL.from_pretrained(args.pipeline_dir, subfolder="vae")
unet = UNet2DConditionModel.from_pretrained(args.pipeline_dir, subfolder="unet")
for part in (unet, vae, text_encoder):
    part.requires_grad_(False)
for part in (unet, vae, text_encoder):
    part.to(accelerator.device, dtype=torch.float16)
unet.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, init_lora_weights="gaussian",
                            target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
cast_training_params(unet, dtype=torch.float32)
params = [p for p in unet.parameters() if p.requires_grad]
optimizer = torch.optim.AdamW(params, lr=1e-4)

images = torch.rand(16, 3, args.resolution, args.resolution) * 2 - 1
ids = tokenizer(sentences(16, words=20), padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, ids), batch_size=args.batch_size, shuffle=True)
unet, optimizer, loader = accelerator.prepare(unet, optimizer, loader)
for epoch in range(100):
    for pixels, input_ids in loader:
        latents = vae.encode(pixels.to(torch.float16)).latent_dist.sample() * vae.config.scaling_factor
        noise = torch.randn_like(latents)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device)
        hidden = text_encoder(input_ids, return_dict=False)[0]
        pred = unet(scheduler.add_noise(latents, noise, t), t, hidden, return_dict=False)[0]
        loss = F.mse_loss(pred.float(), noise.float())
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad()
