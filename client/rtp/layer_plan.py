"""What rotates for one layer: the parameters its rule cut (`LayerPlan`), and the chunks
they travel in (`LayerChunk`).

Rules produce plans and compute with chunks; the rotating shard (shard.py) and the
rotation schedule (rotation.py) move chunks. Both sides stand on this module and on
split.py, never on each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .split import Split


@dataclass(frozen=True)
class ShardedParam:
    """One parameter a layer shards: where it is registered and how it is cut."""

    owner: nn.Module
    name: str
    split: Split


@dataclass
class LayerPlan:
    params: list[ShardedParam]
    detail: Any = None  # rule-specific: mode, head counts, ...


class LayerChunk:
    """A unit of rotation: every shard of a layer, or for a layer too large to move whole,
    the same slice of every shard. All tensors of one shard's chunk travel as one flat
    message; `views` unpacks it. Rules see a chunk as their layer (`module`, `plan`)."""

    def __init__(self, module: nn.Module, plan: LayerPlan, n_shards: int, rank: int, offsets: list[int] | None):
        self.module = module
        self.plan = plan
        self._shapes = [[p.split.shape(s) for p in plan.params] for s in range(n_shards)]
        self._numels = [[p.split.numel(s) for p in plan.params] for s in range(n_shards)]
        self._rank = rank
        self._offsets = offsets  # where this chunk starts inside each owned parameter; None: whole

    @property
    def max_numel(self) -> int:
        return max(sum(n) for n in self._numels)

    def numel(self, s: int) -> int:
        return sum(self._numels[s])

    def own(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This chunk of the owned parameters (views)."""
        if self._offsets is None:
            return list(params)
        return [p.narrow(sp.split.dim, at, sp.split.length(self._rank))
                for p, sp, at in zip(params, self.plan.params, self._offsets)]

    def views(self, flat: torch.Tensor, s: int) -> list[torch.Tensor]:
        """Shard `s`'s tensors inside a flat buffer holding that shard."""
        out, at = [], 0
        for shape, n in zip(self._shapes[s], self._numels[s]):
            out.append(flat[at: at + n].view(shape))
            at += n
        return out

    def pack(self, tensors: Sequence[torch.Tensor], flat: torch.Tensor, s: int) -> torch.Tensor:
        """Copy shard `s`'s tensors into the front of `flat`; returns the used part."""
        for view, t in zip(self.views(flat, s), tensors):
            view.copy_(t)
        return flat[: self.numel(s)]


def chunk_layer(module: nn.Module, plan: LayerPlan, n_shards: int, rank: int, k: int) -> list[LayerChunk]:
    """The layer as `k` chunks, chunk c holding piece c of every shard (see `Split.chunks`);
    one chunk, the whole shards, when `k` <= 1."""
    if k <= 1:
        return [LayerChunk(module, plan, n_shards, rank, None)]
    per_param = [sp.split.chunks(k) for sp in plan.params]
    chunks, offsets = [], [0] * len(plan.params)
    for c in range(k):
        params = [ShardedParam(sp.owner, sp.name, splits[c]) for sp, splits in zip(plan.params, per_param)]
        chunks.append(LayerChunk(module, LayerPlan(params, plan.detail), n_shards, rank, list(offsets)))
        offsets = [at + splits[c].length(rank) for at, splits in zip(offsets, per_param)]
    return chunks
