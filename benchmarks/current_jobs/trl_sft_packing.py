"""Supervised fine-tuning with TRL's SFTTrainer (trl sft's defaults plus packing): the model given by its
local path, a conversational dataset rendered with the tokenizer's chat template, packed into fixed-length
sequences, bf16."""

import argparse
import random
import tempfile

from datasets import Dataset
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer

from _data import sentences

p = argparse.ArgumentParser()
p.add_argument("model_dir")
args = p.parse_args()

rng = random.Random(0)
texts = sentences(300, words=60)
data = Dataset.from_dict({"messages": [[{"role": "user", "content": texts[i]},
                                        {"role": "assistant", "content": texts[rng.randrange(len(texts))]}]
                                       for i in range(len(texts))]})
config = SFTConfig(output_dir=tempfile.mkdtemp(), packing=True, max_length=512, per_device_train_batch_size=4,
                   gradient_accumulation_steps=4, gradient_checkpointing=True, bf16=True, learning_rate=2e-5,
                   max_steps=50, logging_steps=5, save_strategy="no", report_to="none",
                   model_init_kwargs={"dtype": "bfloat16"})
trainer = SFTTrainer(model=args.model_dir, args=config, train_dataset=data,
                     processing_class=AutoTokenizer.from_pretrained(args.model_dir))
trainer.train()
