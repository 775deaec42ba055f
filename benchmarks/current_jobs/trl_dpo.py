"""Preference training with TRL's DPOTrainer: policy and a frozen reference copy, both loaded from the
same local checkpoint, prompt/chosen/rejected pairs, bf16."""

import argparse
import tempfile

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

from _data import sentences

p = argparse.ArgumentParser()
p.add_argument("model_dir")
args = p.parse_args()

tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16)
ref = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16)
prompts, good, bad = sentences(200, 40, 1), sentences(200, 60, 2), sentences(200, 60, 3)
data = Dataset.from_dict({"prompt": prompts, "chosen": good, "rejected": bad})
config = DPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                   bf16=True, learning_rate=5e-7, beta=0.1, max_length=256, max_steps=50, logging_steps=5,
                   save_strategy="no", report_to="none")
DPOTrainer(model=model, ref_model=ref, args=config, train_dataset=data, processing_class=tokenizer).train()
