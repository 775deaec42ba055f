"""LoRA fine-tuning with PEFT and the Hugging Face Trainer (the PEFT examples' recipe): adapters on the
attention and MLP projections of a frozen local model, fp16 mixed precision, gradient checkpointing with
input gradients enabled."""

import argparse
import tempfile

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                          TrainingArguments)

from _data import sentences

p = argparse.ArgumentParser()
p.add_argument("model_dir")
p.add_argument("--rank", type=int, default=16)
p.add_argument("--dora", action="store_true")
args = p.parse_args()

tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
model.gradient_checkpointing_enable()
model.enable_input_require_grads()
lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.05, task_type="CAUSAL_LM", use_dora=args.dora,
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
model = get_peft_model(model, lora)
model.print_trainable_parameters()

data = Dataset.from_dict({"text": sentences(256)}).map(
    lambda b: tokenizer(b["text"], truncation=True, max_length=256), batched=True, remove_columns=["text"])
training = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=16, fp16=True,
                             learning_rate=2e-4, num_train_epochs=1, logging_steps=5, save_strategy="no",
                             report_to="none", optim="adamw_torch")
Trainer(model=model, args=training, train_dataset=data,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False)).train()
