"""BERT-style sequence classification trained with the Hugging Face ``Trainer``: the model from a
``BertConfig``, a synthetic tokenised dataset with padding (so the attention mask has zeros), fp16."""

import argparse
import tempfile

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--seq-len", type=int, default=256)
args = parser.parse_args()


class SyntheticGlue(torch.utils.data.Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1000, vocab, (n, seq_len), generator=g)
        self.lengths = torch.randint(seq_len // 4, seq_len + 1, (n,), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        mask = (torch.arange(self.ids.shape[1]) < self.lengths[i]).long()
        return {"input_ids": self.ids[i] * mask, "attention_mask": mask, "labels": self.labels[i]}


config = BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    intermediate_size=3072, num_labels=2)
model = BertForSequenceClassification(config)
out_dir = tempfile.mkdtemp(prefix="bert-synthetic-")
training_args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=args.batch_size,
                                  max_steps=50, learning_rate=2e-5, fp16=torch.cuda.is_available(),
                                  logging_steps=10, save_strategy="no", report_to=[],
                                  dataloader_num_workers=0)
trainer = Trainer(model=model, args=training_args,
                  train_dataset=SyntheticGlue(args.batch_size * 60, args.seq_len, config.vocab_size))
trainer.train()
