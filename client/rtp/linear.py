"""nn.Linear: split output features, so each shard owns its rows of the weight and its slice of the bias.

A weight tied to a column-split embedding (a GPT output head) is split by input
features instead: every shard then adds a full-size partial product, and the bias
is cut separately so each of its elements is added, and gets its gradient, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from .layer_plan import LayerChunk, LayerPlan, ShardedParam
from .rules import Combine, Concat, GradAdder, Rotate, ShardRule, Sum, Unsupported, rows
from .split import Split, Splitter

ROWS, COLUMNS = 0, 1


class LinearRule(ShardRule):
    types = (nn.Linear, NonDynamicallyQuantizableLinear)

    def claimed(self, module: nn.Module) -> list[tuple[nn.Module, str]]:
        return [(module, "weight")] + ([(module, "bias")] if module.bias is not None else [])

    def split_dims(self, module: nn.Module, owner: nn.Module, name: str) -> tuple[int, ...]:
        return (ROWS, COLUMNS) if name == "weight" else (0,)

    def plan(self, module: nn.Module, splitter: Splitter, fixed: dict[tuple[int, str], Split]) -> LayerPlan:
        if (id(module), "bias") in fixed:
            raise Unsupported("a tied Linear bias")
        weight = fixed.get((id(module), "weight")) or splitter.even(tuple(module.weight.shape), ROWS)
        params = [ShardedParam(module, "weight", weight)]
        if module.bias is not None:
            bias = (Split(tuple(module.bias.shape), 0, weight.ranges) if weight.dim == ROWS
                    else splitter.even(tuple(module.bias.shape), 0))
            params.append(ShardedParam(module, "bias", bias))
        return LayerPlan(params, detail=weight.dim)

    def chunkable(self, plan: LayerPlan) -> bool:
        return True

    def forward(self, module: nn.Module, rotate: Rotate, x: torch.Tensor) -> torch.Tensor:
        return rotate(None, (x,))

    def combines(self, layer: LayerChunk, call: Any) -> list[Combine]:
        if layer.plan.detail == ROWS:
            return [Concat(-1, layer.plan.params[0].split)]
        return [Sum()]

    def forward_piece(self, layer: LayerChunk, call: Any, inputs: Sequence[torch.Tensor], w: list[torch.Tensor],
                      s: int) -> tuple[torch.Tensor, ...]:
        x, weight = inputs[0], w[0]
        bias = w[1] if len(w) > 1 else None
        if layer.plan.detail == ROWS:
            return (F.linear(x, weight, bias),)
        at, length = layer.plan.params[0].split.single_range(s)
        out = F.linear(x.narrow(-1, at, length), weight)
        if bias is not None:
            b_at, b_len = layer.plan.params[1].split.single_range(s)
            out.narrow(-1, b_at, b_len).add_(bias)
        return (out,)

    def backward_needs_weights(self, layer: LayerChunk, call: Any, need_in: Sequence[bool]) -> bool:
        return need_in[0]  # the weight gradient is gy^T x: no weights in it

    def backward_piece(self, layer: LayerChunk, call: Any, inputs: Sequence[torch.Tensor], w: list[torch.Tensor] | None,
                       s: int, gy: torch.Tensor, dx: list[torch.Tensor | None], need_w: bool) -> GradAdder | None:
        x = inputs[0]
        has_bias = len(layer.plan.params) > 1
        g2, x2 = rows(gy), rows(x)
        if layer.plan.detail == ROWS:
            if dx[0] is not None:
                rows(dx[0]).addmm_(g2, w[0])
            b_at, b_len = 0, g2.shape[1]
        else:
            at, length = layer.plan.params[0].split.single_range(s)
            if dx[0] is not None:
                rows(dx[0]).narrow(1, at, length).addmm_(g2, w[0])
            x2 = x2.narrow(1, at, length)
            b_at, b_len = layer.plan.params[1].split.single_range(s) if has_bias else (0, 0)
        if not need_w:
            return None

        def add(acc: list[torch.Tensor]) -> None:
            acc[0].addmm_(g2.t(), x2)  # written straight into the travelling accumulator
            if has_bias:
                acc[1].add_(g2.narrow(1, b_at, b_len).sum(0))
        return add
