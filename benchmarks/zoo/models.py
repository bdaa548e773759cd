"""The zoo's networks: small (about 20k-250k parameters), so that a 400-step run at 4 ranks takes
tens of seconds on two cores, and of several shapes, so that compressors meet convolution
kernels, recurrent weight matrices, attention projections, embeddings and BatchNorm."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """``depth`` hidden layers of ``width`` ReLU units."""

    def __init__(self, inputs: int, outputs: int, width: int = 256, depth: int = 2):
        super().__init__()
        sizes = [inputs] + [width] * depth
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        self.out = nn.Linear(sizes[-1], outputs)

    def forward(self, x):
        for layer in self.hidden:
            x = F.relu(layer(x))
        return self.out(x)


class ShapesCNN(nn.Module):
    """Three 3x3 convolutions (16, 32, 32 channels, two 2x2 max-pools), then 512 -> 64 -> classes."""

    def __init__(self, classes: int = 8):
        super().__init__()
        self.c1 = nn.Conv2d(1, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 32, 3, padding=1)
        self.c3 = nn.Conv2d(32, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, 64)
        self.out = nn.Linear(64, classes)

    def forward(self, x):
        x = F.relu(self.c1(x))
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        x = F.max_pool2d(F.relu(self.c3(x)), 2)
        return self.out(F.relu(self.fc(x.flatten(1))))


class WaveCNN(nn.Module):
    """1-D convolutions with BatchNorm (buffers that DDP broadcasts), global average pooling."""

    def __init__(self, classes: int = 8, channels: int = 32):
        super().__init__()
        c = channels
        self.convs = nn.ModuleList([nn.Conv1d(1, c, 7, padding=3), nn.Conv1d(c, 2 * c, 5, padding=2),
                                    nn.Conv1d(2 * c, 2 * c, 3, padding=1)])
        self.norms = nn.ModuleList([nn.BatchNorm1d(c), nn.BatchNorm1d(2 * c), nn.BatchNorm1d(2 * c)])
        self.out = nn.Linear(2 * c, classes)

    def forward(self, x):
        for i, (conv, norm) in enumerate(zip(self.convs, self.norms)):
            x = F.relu(norm(conv(x)))
            if i < 2:
                x = F.max_pool1d(x, 2)
        return self.out(x.mean(-1))


class RecurrentLM(nn.Module):
    """Embedding, a GRU or LSTM, and a linear head: next-symbol logits at every position."""

    def __init__(self, vocab: int, embed: int, hidden: int, cell: str = "gru", layers: int = 1):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.rnn = (nn.GRU if cell == "gru" else nn.LSTM)(embed, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.head(self.rnn(self.embed(x))[0])


class RecurrentClassifier(nn.Module):
    """Embedding, an LSTM, and a linear head on the last hidden state: one label per sequence."""

    def __init__(self, vocab: int, classes: int, embed: int = 16, hidden: int = 96):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.rnn = nn.LSTM(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.rnn(self.embed(x))[0][:, -1])


class Transformer(nn.Module):
    """Pre-norm transformer encoder blocks over token and position embeddings, an untied head
    per position; ``causal`` makes it a decoder-only LM, otherwise every position sees all
    (the sorting task)."""

    def __init__(self, vocab: int, context: int, d_model: int = 64, layers: int = 2, heads: int = 4,
                 causal: bool = True, outputs: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, outputs or vocab)
        self.causal = causal
        mask = nn.Transformer.generate_square_subsequent_mask(context) if causal else torch.zeros(context, context)
        self.register_buffer("mask", mask, persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, x):
        t = x.shape[1]
        h = self.embed(x) + self.pos(torch.arange(t, device=x.device))
        for block in self.blocks:
            if self.causal:
                h = block(h, src_mask=self.mask[:t, :t], is_causal=True)
            else:
                h = block(h)
        return self.head(self.norm(h))
