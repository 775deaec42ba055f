"""Causal-LM fine-tuning with the Hugging Face Trainer, as run_clm.py does it: a local pretrained model and
tokenizer, a tokenized dataset grouped into blocks, bf16, gradient accumulation, gradient checkpointing and
evaluation every few steps."""

import argparse
import tempfile

import torch
from datasets import Dataset
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                          TrainingArguments)

from _data import sentences

p = argparse.ArgumentParser()
p.add_argument("model_dir")
p.add_argument("--block-size", type=int, default=512)
p.add_argument("--batch-size", type=int, default=8)
args = p.parse_args()

tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16)
raw = Dataset.from_dict({"text": sentences(400)})


def group(batch):
    ids = sum(batch["input_ids"], [])
    n = len(ids) // args.block_size * args.block_size
    blocks = [ids[i:i + args.block_size] for i in range(0, n, args.block_size)]
    return {"input_ids": blocks, "attention_mask": [[1] * len(b) for b in blocks]}


tokenized = raw.map(lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"])
blocks = tokenized.map(group, batched=True, remove_columns=tokenized.column_names)
split = blocks.train_test_split(test_size=0.1, seed=0)
training = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch_size,
                             per_device_eval_batch_size=args.batch_size, gradient_accumulation_steps=2,
                             gradient_checkpointing=True, bf16=True, learning_rate=2e-5, max_steps=100,
                             eval_strategy="steps", eval_steps=50, logging_steps=10, save_strategy="no",
                             report_to="none")
trainer = Trainer(model=model, args=training, train_dataset=split["train"], eval_dataset=split["test"],
                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
trainer.train()
