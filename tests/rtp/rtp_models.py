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


def cnn(c1: int = 7, c2: int = 9, c3: int = 5) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, c1, 3, padding=1), nn.ReLU(),
        nn.Conv2d(c1, c2, 1), nn.ReLU(),
        nn.Conv2d(c2, c2, 3, padding=1, groups=3, padding_mode="reflect"), nn.ReLU(),
        nn.Conv2d(c2, c3, 2, stride=2), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(c3 * 4, 7))


def wide_cnn() -> nn.Module:
    """The CNN with its ungrouped convolutions widened (97 and 29 channels, primes) so that its
    three-group convolution, whose whole groups cannot split 4 ways, is 4% of the parameters
    instead of 30%: the model state then balances within 4% at N = 2, 3 and 4."""
    return cnn(97, 9, 29)


class EdgeCases(nn.Module):
    """Sizes below N and unusual uses, for N = 3.

    The embedding has 1 column, so two of three shards are empty and one rank neither sends
    nor receives in some ring shifts (including the very first of a forward); attention has
    2 heads (a headless shard), the conv 2 output channels and `out` 2 rows (empty shards);
    `sq` runs twice per forward; `frozen` has a frozen weight next to a trainable bias.
    Every layer is sharded: nothing is replicated.
    """

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 1)
        self.up = nn.Linear(1, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.sq = nn.Linear(4, 4)
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.ln = nn.LayerNorm(4)
        self.frozen = nn.Linear(4, 3)
        self.frozen.weight.requires_grad_(False)
        self.out = nn.Linear(3 + 2, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.up(self.emb(ids))
        x = x + self.attn(x, x, x, need_weights=False)[0]
        x = self.sq(torch.tanh(self.sq(x)))
        x = self.ln(x)
        c = self.conv(x.unsqueeze(1)).mean((2, 3))
        h = self.frozen(x).mean(1)
        return self.out(torch.cat([h, c], -1))


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


def _edge_batch(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 11, (n, 5), generator=g), torch.randn(n, 2, generator=g)


CASES: dict[str, Case] = {
    "mlp": Case(mlp, _mlp_batch, F.mse_loss),
    "cnn": Case(cnn, _cnn_batch, F.cross_entropy),
    "gpt": Case(TinyGPT, _gpt_batch, _lm_loss),
}
# Measured for one guarantee each, not run through every equivalence check.
WIDE_CNN = Case(wide_cnn, _cnn_batch, F.cross_entropy)
EDGE = Case(EdgeCases, _edge_batch, F.mse_loss)


def global_batch(case: Case, step: int, world: int, micro: int, seed: int = 0):
    g = torch.Generator().manual_seed(1000 * seed + step)
    return case.batch(g, world * micro)


def micro_batch(x: torch.Tensor, rank: int, micro: int) -> torch.Tensor:
    return x[rank * micro:(rank + 1) * micro]
