"""Text classification with the Lightning ``Trainer``: a LightningModule around a small transformer
encoder, a LightningDataModule over a synthetic tokenised dataset, 16-bit mixed precision, gradient
clipping, and ``accelerator='gpu'`` when one is available."""

import argparse

import lightning as L
import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--seq-len", type=int, default=256)
args = p.parse_args()


class Data(L.LightningDataModule):
    def train_dataloader(self):
        ids = torch.randint(1, 20000, (args.batch_size * 50, args.seq_len))
        labels = torch.randint(0, 4, (args.batch_size * 50,))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, labels), batch_size=args.batch_size,
                                           shuffle=True, num_workers=2)


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.save_hyperparameters()
        self.emb = nn.Embedding(20000, 512)
        layer = nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 6)
        self.head = nn.Linear(512, 4)

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        logits = self.head(self.encoder(self.emb(ids)).mean(1))
        loss = nn.functional.cross_entropy(logits, labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-4)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.OneCycleLR(opt, 3e-4, total_steps=1000)}


trainer = L.Trainer(max_epochs=20, accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=1,
                    precision="16-mixed", gradient_clip_val=1.0, logger=False, enable_checkpointing=False)
trainer.fit(Classifier(), datamodule=Data())
