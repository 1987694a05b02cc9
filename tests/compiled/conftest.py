"""Small models for the compiled executor's tests, and the partition torch makes of them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


class MLPBlock(nn.Module):
    def __init__(self, d: int, dropout: float = 0.0):
        super().__init__()
        self.ln, self.fc1, self.fc2, self.drop = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln(x)))))


class MLP(nn.Module):
    def __init__(self, d: int = 32, n: int = 3, dropout: float = 0.0):
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(d, dropout) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class TransformerBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d), MLPBlock(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x + self.attn(self.ln1(x)))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, n: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(TransformerBlock(d, heads) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), tokens.roll(-1, 1).flatten())


class CNN(nn.Module):
    def __init__(self, c: int = 8, n: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()) for _ in range(n)))
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3))).logsumexp(1).mean()


def make_case(kind: str) -> tuple[nn.Module, Any]:
    """A seeded model and its input."""
    torch.manual_seed(0)
    if kind == "mlp":
        return MLP(), torch.randn(4, 16, 32)
    if kind == "transformer":
        return Transformer(), torch.randint(0, 64, (2, 16))
    if kind == "cnn":
        return CNN(), torch.randn(2, 3, 16, 16)
    raise ValueError(kind)


@pytest.fixture(params=["mlp", "transformer", "cnn"])
def case(request: pytest.FixtureRequest) -> tuple[nn.Module, Any]:
    return make_case(request.param)
