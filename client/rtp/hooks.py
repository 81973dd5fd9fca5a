"""Everything RTP attaches to the user's modules and parameters, in one place.

- Sharded layers get their class swapped for a subclass whose `forward` runs the
  rotation (as FSDP2 does): the layer's rule prepares the inputs and hands them to
  `rotation.rotate`. isinstance checks, state_dict keys and user hooks keep working;
  a forward pre-hook checks the layer is at rest before it starts.
- Replicated parameters get a post-accumulate-grad hook that averages their gradient
  over the group, matching the mean-over-ranks semantics of the sharded ones.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch import nn

from .ring import Ring
from .rotation import rotate
from .shard import Position, RotatingShard


class ReplicatedLayerWarning(UserWarning):
    """Some layers have no sharding rule: every rank holds them whole."""


class RotatedModule:
    """Mixin placed in front of a sharded module's own class."""

    _rtp_layer: RotatingShard

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        layer = self._rtp_layer
        return layer.rule.forward(layer.module, functools.partial(rotate, layer), *args, **kwargs)


_SUBCLASSES: dict[type, type] = {}


def _check_at_rest(module: nn.Module, args: Any) -> None:
    # Also keeps nn.TransformerEncoderLayer off its fused inference path, which would read
    # the local shards as if they were whole weights: that path is skipped when hooks exist.
    layer = module._rtp_layer
    if layer.position is not Position.HOME:
        raise RuntimeError(f"layer {layer.name!r} called re-entrantly while {layer.position.value}")


def install_rotation(layer: RotatingShard) -> None:
    module = layer.module
    cls = type(module)
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(f"Rotated{cls.__name__}", (RotatedModule, cls), {})
        _SUBCLASSES[cls] = sub
    module.__class__ = sub
    module._rtp_layer = layer
    module.register_forward_pre_hook(_check_at_rest)


def average_replicated_grads(params: list[nn.Parameter], ring: Ring) -> list[Any]:
    """Average each replicated parameter's gradient over the group once it is accumulated.

    Averaging the whole accumulated `.grad` is also right under gradient accumulation:
    the part left by earlier backward passes is already equal on every rank.
    """
    def hook(p: torch.Tensor) -> None:
        if ring.size > 1 and p.grad is not None:
            ring.all_reduce_mean_(p.grad)

    return [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]


def warn_replicated(replicated: dict[str, tuple[str, str]]) -> None:
    if not replicated:
        return
    listed = "; ".join(f"{name or '<root>'} ({type_name}: {why})" for name, (type_name, why) in replicated.items())
    warnings.warn(f"RotatedTensorParallel keeps {len(replicated)} module(s) replicated, every rank holding "
                  f"their full parameters, with gradients averaged over ranks: {listed}",
                  ReplicatedLayerWarning, stacklevel=3)


def disable_nested_tensor_paths(model: nn.Module) -> None:
    """nn.TransformerEncoder may turn inputs into nested tensors at inference; sharded layers take plain ones."""
    for m in model.modules():
        if isinstance(m, nn.TransformerEncoder):
            m.use_nested_tensor = False
