"""nn.Conv2d: split output channels; a grouped convolution is split by whole groups.

Each shard owns its output channels' filters and bias, and convolves the input
channels those filters read (all of them, or its groups' slice).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .layer_plan import LayerChunk, LayerPlan, ShardedParam
from .rules import Combine, Concat, Rotate, ShardRule, Unsupported
from .split import Split, Splitter, units

CHANNELS = -3  # of both (N, C, H, W) and unbatched (C, H, W)


class Conv2dRule(ShardRule):
    types = (nn.Conv2d,)

    def claimed(self, module: nn.Module) -> list[tuple[nn.Module, str]]:
        return [(module, "weight")] + ([(module, "bias")] if module.bias is not None else [])

    def plan(self, module: nn.Module, splitter: Splitter, fixed: dict[tuple[int, str], Split]) -> LayerPlan:
        if fixed:
            raise Unsupported("tied convolution weights")
        shape = tuple(module.weight.shape)
        groups = module.groups
        counts = splitter.counts(groups if groups > 1 else shape[0])
        weight = units(shape, 0, counts, unit_len=shape[0] // groups if groups > 1 else 1)
        params = [ShardedParam(module, "weight", weight)]
        if module.bias is not None:
            params.append(ShardedParam(module, "bias", Split(tuple(module.bias.shape), 0, weight.ranges)))
        first_groups = [sum(counts[:s]) for s in range(len(counts))]
        return LayerPlan(params, detail=(counts, first_groups))

    def chunkable(self, plan: LayerPlan) -> bool:
        return plan.params[0].owner.groups == 1

    def forward(self, module: nn.Module, rotate: Rotate, x: torch.Tensor) -> torch.Tensor:
        m = module
        padding = m.padding
        if m.padding_mode != "zeros":  # padded outside the rotation, once, as nn.Conv2d does
            x = F.pad(x, m._reversed_padding_repeated_twice, mode=m.padding_mode)
            padding = 0
        return rotate(padding, (x,))

    def combines(self, layer: LayerChunk, call: Any) -> list[Combine]:
        return [Concat(CHANNELS, layer.plan.params[0].split)]

    def forward_piece(self, layer: LayerChunk, call: Any, inputs: Sequence[torch.Tensor], w: list[torch.Tensor],
                      s: int) -> tuple[torch.Tensor, ...]:
        m, x, weight = layer.module, inputs[0], w[0]
        bias = w[1] if len(w) > 1 else None
        groups = m.groups
        if groups > 1:
            counts, first = layer.plan.detail
            per_group = m.in_channels // groups
            # An empty shard still convolves one group's channels, for the output's shape.
            x = (x.narrow(CHANNELS, first[s] * per_group, counts[s] * per_group) if counts[s]
                 else x.narrow(CHANNELS, 0, per_group))
            groups = counts[s]
        if weight.shape[0] == 0:
            # conv2d refuses zero filters: convolve one zero filter for the shape, keep no channel.
            probe = weight.new_zeros((1, x.shape[CHANNELS]) + tuple(weight.shape[2:]))
            return (F.conv2d(x, probe, None, m.stride, call, m.dilation, 1).narrow(CHANNELS, 0, 0),)
        return (F.conv2d(x, weight, bias, m.stride, call, m.dilation, groups),)
