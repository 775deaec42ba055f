"""Word-level LSTM language model as in the long-standing example: a text corpus tokenised into a
dictionary, batchify/get_batch over a long id tensor, truncated BPTT with hidden-state repackaging,
gradient clipping and a hand-written SGD update (no torch.optim optimizer)."""

import argparse

import torch
import torch.nn as nn

from _synthetic import text_corpus

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=20)
p.add_argument("--bptt", type=int, default=35)
p.add_argument("--emsize", type=int, default=650)
p.add_argument("--nhid", type=int, default=650)
args = p.parse_args()

word2idx, ids = {}, []
with open(text_corpus("wordlm", 300_000)) as f:
    for line in f:
        for w in line.split() + ["<eos>"]:
            ids.append(word2idx.setdefault(w, len(word2idx)))
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
data = torch.tensor(ids, dtype=torch.long)
nbatch = data.size(0) // args.batch_size
train_data = data[:nbatch * args.batch_size].view(args.batch_size, -1).t().contiguous().to(device)


class RNNModel(nn.Module):
    def __init__(self, ntoken):
        super().__init__()
        self.drop, self.encoder = nn.Dropout(0.5), nn.Embedding(ntoken, args.emsize)
        self.rnn, self.decoder = nn.LSTM(args.emsize, args.nhid, 2, dropout=0.5), nn.Linear(args.nhid, ntoken)

    def forward(self, x, hidden):
        out, hidden = self.rnn(self.drop(self.encoder(x)), hidden)
        return self.decoder(self.drop(out)).view(-1, self.decoder.out_features), hidden

    def init_hidden(self, bsz):
        w = next(self.parameters())
        return (w.new_zeros(2, bsz, args.nhid), w.new_zeros(2, bsz, args.nhid))


def repackage_hidden(h):
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)


model = RNNModel(len(word2idx)).to(device)
criterion, lr = nn.NLLLoss(), 20.0
for epoch in range(40):
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        seq_len = min(args.bptt, len(train_data) - 1 - i)
        x, y = train_data[i:i + seq_len], train_data[i + 1:i + 1 + seq_len].reshape(-1)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(x, hidden)
        loss = criterion(torch.log_softmax(output, -1), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p_ in model.parameters():
            p_.data.add_(p_.grad, alpha=-lr)
        if batch % 200 == 0:
            print(f"epoch {epoch} batch {batch} loss {loss.item():.2f}")
