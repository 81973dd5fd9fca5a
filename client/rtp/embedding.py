"""nn.Embedding: split the embedding dimension, so every shard looks up its columns of every row.

Column shards keep the lookup local (no masking of token ids by vocabulary range) and
match a tied output head split by input features.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .layer_plan import LayerChunk, LayerPlan, ShardedParam
from .rules import Combine, Concat, GradAdder, Rotate, ShardRule, Unsupported, rows
from .split import Split, Splitter

COLUMNS = 1


class EmbeddingRule(ShardRule):
    types = (nn.Embedding,)

    def claimed(self, module: nn.Module) -> list[tuple[nn.Module, str]]:
        return [(module, "weight")]

    def split_dims(self, module: nn.Module, owner: nn.Module, name: str) -> tuple[int, ...]:
        return (COLUMNS,)

    def plan(self, module: nn.Module, splitter: Splitter, fixed: dict[tuple[int, str], Split]) -> LayerPlan:
        if module.max_norm is not None:
            raise Unsupported("max_norm renormalises whole rows, which no shard holds")
        if module.sparse:
            raise Unsupported("sparse gradients")
        weight = fixed.get((id(module), "weight")) or splitter.even(tuple(module.weight.shape), COLUMNS)
        if weight.dim != COLUMNS:
            raise Unsupported("embedding weight tied to a row split")
        return LayerPlan([ShardedParam(module, "weight", weight)])

    def chunkable(self, plan: LayerPlan) -> bool:
        return True

    def forward(self, module: nn.Module, rotate: Rotate, indices: torch.Tensor) -> torch.Tensor:
        return rotate(None, (indices,))

    def combines(self, layer: LayerChunk, call: Any) -> list[Combine]:
        return [Concat(-1, layer.plan.params[0].split)]

    def forward_piece(self, layer: LayerChunk, call: Any, inputs: Sequence[torch.Tensor], w: list[torch.Tensor],
                      s: int) -> tuple[torch.Tensor, ...]:
        m = layer.module
        return (F.embedding(inputs[0], w[0], m.padding_idx, None, 2.0, m.scale_grad_by_freq, False),)

    def backward_needs_weights(self, layer: LayerChunk, call: Any, need_in: Sequence[bool]) -> bool:
        return layer.module.scale_grad_by_freq  # only the recomputing fallback reads them

    def backward_piece(self, layer: LayerChunk, call: Any, inputs: Sequence[torch.Tensor], w: list[torch.Tensor] | None,
                       s: int, gy: torch.Tensor, dx: list[torch.Tensor | None], need_w: bool) -> GradAdder | None:
        m = layer.module
        if m.scale_grad_by_freq:
            return super().backward_piece(layer, call, inputs, w, s, gy, dx, need_w)
        if not need_w:
            return None
        ids = inputs[0].reshape(-1)
        g2 = rows(gy)

        def add(acc: list[torch.Tensor]) -> None:
            acc[0].index_add_(0, ids, g2)
            if m.padding_idx is not None:
                acc[0][m.padding_idx].zero_()  # every rank's contribution to this row is zero
        return add
