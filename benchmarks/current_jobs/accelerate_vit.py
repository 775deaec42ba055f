"""Image classification with accelerate, in the manner of the transformers image-classification example
(no_trainer variant): a local pretrained ViT with its image processor, a new 100-class head, bf16 mixed
precision, gradient accumulation, cosine schedule, evaluation each epoch."""

import argparse

import torch
from accelerate import Accelerator
from transformers import AutoImageProcessor, AutoModelForImageClassification, get_cosine_schedule_with_warmup

p = argparse.ArgumentParser()
p.add_argument("model_dir")
p.add_argument("--batch-size", type=int, default=64)
args = p.parse_args()

accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
processor = AutoImageProcessor.from_pretrained(args.model_dir)
model = AutoModelForImageClassification.from_pretrained(args.model_dir, num_labels=100, ignore_mismatched_sizes=True)
size = processor.size["height"]
images, labels = torch.rand(512, 3, size, size), torch.randint(0, 100, (512,))
mean, std = torch.tensor(processor.image_mean).view(3, 1, 1), torch.tensor(processor.image_std).view(3, 1, 1)
train = torch.utils.data.TensorDataset((images - mean) / std, labels)
loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True, num_workers=4)
evaluation = torch.utils.data.DataLoader(train, batch_size=2 * args.batch_size)
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
schedule = get_cosine_schedule_with_warmup(optimizer, 100, 1000)
model, optimizer, loader, evaluation, schedule = accelerator.prepare(model, optimizer, loader, evaluation, schedule)
for epoch in range(10):
    model.train()
    for pixels, y in loader:
        with accelerator.accumulate(model):
            loss = model(pixel_values=pixels, labels=y).loss
            accelerator.backward(loss)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
    model.eval()
    correct = 0
    for pixels, y in evaluation:
        with torch.no_grad():
            pred = model(pixel_values=pixels).logits.argmax(-1)
        pred, y = accelerator.gather_for_metrics((pred, y))
        correct += (pred == y).sum().item()
    accelerator.print(f"epoch {epoch}: accuracy {correct / len(train):.3f}")
