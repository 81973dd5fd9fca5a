"""nn.LayerNorm: normalise locally (no weights involved), then rotate the elementwise affine.

Weight and bias are cut along the first normalised dimension; shard s scales and
shifts its slice of the normalised input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .layer_plan import LayerChunk, LayerPlan, ShardedParam
from .rules import Combine, Concat, GradAdder, Rotate, ShardRule, Unsupported
from .split import Split, Splitter


class LayerNormRule(ShardRule):
    types = (nn.LayerNorm,)

    def claimed(self, module: nn.Module) -> list[tuple[nn.Module, str]]:
        return [(module, n) for n in ("weight", "bias") if getattr(module, n) is not None]

    def plan(self, module: nn.Module, splitter: Splitter, fixed: dict[tuple[int, str], Split]) -> LayerPlan:
        if fixed:
            raise Unsupported("tied LayerNorm parameters")
        if module.weight is None:
            raise Unsupported("a LayerNorm with a bias but no weight")
        weight = splitter.even(tuple(module.weight.shape), 0)
        params = [ShardedParam(module, "weight", weight)]
        if module.bias is not None:
            params.append(ShardedParam(module, "bias", Split(tuple(module.bias.shape), 0, weight.ranges)))
        return LayerPlan(params)

    def chunkable(self, plan: LayerPlan) -> bool:
        return True

    def forward(self, module: nn.Module, rotate: Rotate, x: torch.Tensor) -> torch.Tensor:
        m = module
        normalised = F.layer_norm(x, m.normalized_shape, None, None, m.eps)
        return rotate(None, (normalised,))

    def _dim(self, layer: LayerChunk) -> int:
        return -len(layer.module.normalized_shape)

    def combines(self, layer: LayerChunk, call: Any) -> list[Combine]:
        return [Concat(self._dim(layer), layer.plan.params[0].split)]

    def forward_piece(self, layer: LayerChunk, call: Any, inputs: Sequence[torch.Tensor], w: list[torch.Tensor],
                      s: int) -> tuple[torch.Tensor, ...]:
        at, length = layer.plan.params[0].split.single_range(s)
        out = inputs[0].narrow(self._dim(layer), at, length) * w[0]
        return (out + w[1] if len(w) > 1 else out,)

    def backward_needs_weights(self, layer: LayerChunk, call: Any, need_in: Sequence[bool]) -> bool:
        return need_in[0]

    def backward_piece(self, layer: LayerChunk, call: Any, inputs: Sequence[torch.Tensor], w: list[torch.Tensor] | None,
                       s: int, gy: torch.Tensor, dx: list[torch.Tensor | None], need_w: bool) -> GradAdder | None:
        dim = self._dim(layer)
        at, length = layer.plan.params[0].split.single_range(s)
        if dx[0] is not None:
            dx[0].narrow(dim, at, length).add_(gy * w[0])
        if not need_w:
            return None
        xs = inputs[0].narrow(dim, at, length)
        lead = tuple(range(xs.dim() + dim))

        def over_lead(t: torch.Tensor) -> torch.Tensor:
            return t.sum(lead) if lead else t  # sum(()) would reduce every dimension

        def add(acc: list[torch.Tensor]) -> None:
            acc[0].add_(over_lead(gy * xs))
            if len(acc) > 1:
                acc[1].add_(over_lead(gy))
        return add
