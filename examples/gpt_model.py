"""A small GPT-style decoder: token and position embeddings, pre-norm attention blocks.

Built from Embedding, LayerNorm and Linear layers only (attention's projections are
Linear), which are exactly the layers RTP shards across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256  # byte-level tokens
    block: int = 256
    layers: int = 4
    heads: int = 4
    width: int = 256


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        if c.width % c.heads:
            raise ValueError(f"width {c.width} is not a multiple of heads {c.heads}")
        self.heads = c.heads
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.proj = nn.Linear(c.width, c.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(x).split(w, dim=2)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, w))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.width)
        self.attn = CausalSelfAttention(c)
        self.ln2 = nn.LayerNorm(c.width)
        self.mlp = nn.Sequential(nn.Linear(c.width, 4 * c.width), nn.GELU(), nn.Linear(4 * c.width, c.width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.tokens = nn.Embedding(c.vocab, c.width)
        self.positions = nn.Embedding(c.block, c.width)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] for token ids [B, T] (T <= block)."""
        t = ids.shape[1]
        if t > self.config.block:
            raise ValueError(f"sequence of {t} tokens is longer than the model's block of {self.config.block}")
        x = self.tokens(ids) + self.positions(torch.arange(t, device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
