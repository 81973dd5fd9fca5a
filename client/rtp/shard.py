"""One layer's shards as seen from one rank: what it owns, what it is visiting, where the rest are."""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from .ring import FORWARD, Ring, RingBuffers
from .rules import LayerPlan, ShardRule


class Position(enum.Enum):
    """Lifecycle of a layer's shards on a rank."""

    HOME = "home"  # only the owned shard is materialised; nothing in flight
    ROTATING_FORWARD = "rotating_forward"  # visiting shards arrive from the previous rank
    ROTATING_BACKWARD = "rotating_backward"  # shards travel back with their gradient accumulators


class RotatingShard:
    """A sharded layer on one rank.

    The owned shard stays in the module's parameters for the whole run; rotation only
    ever moves copies through the shared `RingBuffers`, so whatever interrupts a
    forward (no_grad, eval, an exception) cannot leave a rank holding another's weights.
    All tensors of one shard travel as one flat message; `views` unpacks it.
    """

    def __init__(self, name: str, module: nn.Module, rule: ShardRule, plan: LayerPlan, ring: Ring,
                 buffers: RingBuffers):
        self.name = name
        self.module = module
        self.rule = rule
        self.plan = plan
        self.ring = ring
        self.buffers = buffers
        self.position = Position.HOME
        self.visiting: int | None = None
        n = ring.size
        self._shapes = [[p.split.shape(s) for p in plan.params] for s in range(n)]
        self._numels = [[p.split.numel(s) for p in plan.params] for s in range(n)]
        first = self.own()[0]
        self.dtype, self.device = first.dtype, first.device

    @property
    def rank(self) -> int:
        return self.ring.rank

    @property
    def n_shards(self) -> int:
        return self.ring.size

    @property
    def max_numel(self) -> int:
        return max(sum(n) for n in self._numels)

    def numel(self, s: int) -> int:
        return sum(self._numels[s])

    def own(self) -> list[nn.Parameter]:
        """This rank's shard: the module's current parameters (re-read, so loads are seen)."""
        return [getattr(p.owner, p.name) for p in self.plan.params]

    def shard_at(self, step: int, direction: int) -> int:
        """Index of the shard this rank computes with at `step` of a rotation."""
        return (self.rank - step) % self.n_shards if direction == FORWARD else (self.rank + step) % self.n_shards

    def holder(self, s: int, step: int, direction: int) -> int:
        """Group rank holding shard `s` at `step` of a rotation."""
        return (s + step) % self.n_shards if direction == FORWARD else (s - step) % self.n_shards

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

    def lease(self, count: int) -> AbstractContextManager[list[torch.Tensor]]:
        """`count` flat buffers, each large enough for any shard of this layer."""
        return self.buffers.lease(count if self.n_shards > 1 else 0, self.max_numel, self.dtype, self.device)

    @contextmanager
    def rotating(self, position: Position) -> Iterator[None]:
        if self.position is not Position.HOME:
            raise RuntimeError(f"layer {self.name!r} entered a rotation while {self.position.value}; "
                               "a layer must finish one rotation before the next starts")
        self.position = position
        try:
            yield
        finally:
            self.position, self.visiting = Position.HOME, None

    def apply(self, call: Any, inputs: Sequence[torch.Tensor]) -> Any:
        """Run this layer on `inputs` across the ring (differentiable in inputs and owned shard)."""
        from .rotation import RotatedLayer

        own = self.own()
        outs = RotatedLayer.apply(self, call, len(inputs), *inputs, *own)
        return outs

    def __repr__(self) -> str:
        return (f"RotatingShard({self.name!r}, {type(self.module).__name__}, shard {self.rank}/{self.n_shards}, "
                f"{self.position.value})")
