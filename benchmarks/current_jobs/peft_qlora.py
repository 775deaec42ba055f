"""QLoRA fine-tuning (the PEFT and bitsandbytes examples' recipe): the local model loaded with its linear
weights quantized to 4-bit NF4 with double quantization and bf16 compute (``BitsAndBytesConfig``),
``prepare_model_for_kbit_training``, LoRA adapters on every projection, the HF Trainer with gradient
checkpointing, bf16 and paged 8-bit AdamW."""

import argparse
import tempfile

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import (AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, DataCollatorForLanguageModeling,
                          Trainer, TrainingArguments)

from _data import sentences

p = argparse.ArgumentParser()
p.add_argument("model_dir")
p.add_argument("--rank", type=int, default=64)
args = p.parse_args()

quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=torch.bfloat16)
tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
model = AutoModelForCausalLM.from_pretrained(args.model_dir, quantization_config=quantization, device_map={"": 0},
                                             dtype=torch.bfloat16)
model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
lora = LoraConfig(r=args.rank, lora_alpha=16, lora_dropout=0.1, bias="none", task_type="CAUSAL_LM",
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
model = get_peft_model(model, lora)
model.print_trainable_parameters()

data = Dataset.from_dict({"text": sentences(256)}).map(
    lambda b: tokenizer(b["text"], truncation=True, max_length=512), batched=True, remove_columns=["text"])
training = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, gradient_accumulation_steps=4,
                             bf16=True, learning_rate=2e-4, max_steps=100, warmup_steps=10, logging_steps=10,
                             save_strategy="no", report_to="none", optim="paged_adamw_8bit", lr_scheduler_type="constant")
Trainer(model=model, args=training, train_dataset=data,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False)).train()
