"""Small models whose every dimension fails to divide by 2, 3 or 4, with seeded data."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class TinyGPT(nn.Module):
    """Token + position embeddings, pre-norm blocks (causal MHA, GELU MLP), head tied to the embedding."""

    def __init__(self, vocab: int = 101, dim: int = 70, heads: int = 7, hidden: int = 150, ctx: int = 9,
                 layers: int = 2):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.head.weight = self.wte.weight
        self.register_buffer("causal", torch.ones(ctx, ctx, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, self.causal[:t, :t])
        return self.head(self.ln_f(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, is_causal=True, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


def mlp() -> nn.Module:
    # PReLU has no sharding rule: it stays replicated.
    return nn.Sequential(nn.Linear(13, 29), nn.PReLU(), nn.Linear(29, 17), nn.Tanh(), nn.Linear(17, 5))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 7, 3, padding=1), nn.ReLU(),
        nn.Conv2d(7, 9, 1), nn.ReLU(),
        nn.Conv2d(9, 9, 3, padding=1, groups=3, padding_mode="reflect"), nn.ReLU(),
        nn.Conv2d(9, 5, 2, stride=2), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(5 * 4, 7))


@dataclass(frozen=True)
class Case:
    """A model, how to draw a global batch for a step, and its loss (a mean over the batch)."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _mlp_batch(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 13, generator=g), torch.randn(n, 5, generator=g)


def _cnn_batch(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 10, 10, generator=g), torch.randint(0, 7, (n,), generator=g)


def _gpt_batch(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 101, (n, 10), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


CASES: dict[str, Case] = {
    "mlp": Case(mlp, _mlp_batch, F.mse_loss),
    "cnn": Case(cnn, _cnn_batch, F.cross_entropy),
    "gpt": Case(TinyGPT, _gpt_batch, _lm_loss),
}


def global_batch(case: Case, step: int, world: int, micro: int, seed: int = 0):
    g = torch.Generator().manual_seed(1000 * seed + step)
    return case.batch(g, world * micro)


def micro_batch(x: torch.Tensor, rank: int, micro: int) -> torch.Tensor:
    return x[rank * micro:(rank + 1) * micro]
