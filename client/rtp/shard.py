"""One layer's shards as seen from one rank: what it owns, what it is visiting, where the rest are.

`RotatingShard` is the layer's state and its lifecycle (`Position`); the rotation that
moves its chunks is rotation.py, and the hook that starts one is hooks.py.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import nn

from .layer_plan import LayerChunk, LayerPlan, chunk_layer
from .ring import FORWARD, Ring, RingBuffers
from .rules import ShardRule


class Position(enum.Enum):
    """Lifecycle of a layer's shards on a rank."""

    HOME = "home"  # only the owned shard is materialised; nothing in flight
    ROTATING_FORWARD = "rotating_forward"  # visiting shards arrive from the previous rank
    ROTATING_BACKWARD = "rotating_backward"  # shards travel back with their gradient accumulators


class RotatingShard:
    """A sharded layer on one rank.

    The owned shard stays in the module's parameters for the whole run; rotation only
    ever moves copies through leased ring buffers, so whatever interrupts a forward
    (no_grad, eval, an exception) cannot leave a rank holding another's weights.
    A layer whose shard is larger than `chunk_bytes` rotates in chunks, so that no more
    than about that many bytes of it are in flight per buffer.
    """

    def __init__(self, name: str, module: nn.Module, rule: ShardRule, plan: LayerPlan, ring: Ring,
                 buffers: RingBuffers, chunk_bytes: int | None = None):
        self.name = name
        self.module = module
        self.rule = rule
        self.plan = plan
        self.ring = ring
        self.buffers = buffers
        self.position = Position.HOME
        self.visiting: int | None = None
        whole = LayerChunk(module, plan, ring.size, ring.rank, None)
        k = 1
        if chunk_bytes and rule.chunkable(plan):
            longest = max(p.split.length(s) for p in plan.params for s in range(ring.size))
            k = min(math.ceil(whole.max_numel * self.dtype.itemsize / chunk_bytes), max(longest, 1))
        self.chunks = chunk_layer(module, plan, ring.size, ring.rank, k)

    @property
    def dtype(self) -> torch.dtype:
        return self.own()[0].dtype

    @property
    def device(self) -> torch.device:  # read each time: the model may be moved after wrapping
        return self.own()[0].device

    @property
    def rank(self) -> int:
        return self.ring.rank

    @property
    def n_shards(self) -> int:
        return self.ring.size

    @property
    def max_numel(self) -> int:
        """Elements of this layer's largest shard."""
        return max(sum(p.split.numel(s) for p in self.plan.params) for s in range(self.n_shards))

    @property
    def max_chunk_numel(self) -> int:
        return max(c.max_numel for c in self.chunks)

    def own(self) -> list[nn.Parameter]:
        """This rank's shard: the module's current parameters (re-read, so loads are seen)."""
        return [getattr(p.owner, p.name) for p in self.plan.params]

    def shard_at(self, step: int, direction: int) -> int:
        """Index of the shard this rank computes with at `step` of a rotation."""
        return (self.rank - step) % self.n_shards if direction == FORWARD else (self.rank + step) % self.n_shards

    def holder(self, s: int, step: int, direction: int) -> int:
        """Group rank holding shard `s` at `step` of a rotation."""
        return (s + step) % self.n_shards if direction == FORWARD else (s - step) % self.n_shards

    def lease(self, count: int) -> AbstractContextManager[list[torch.Tensor]]:
        """`count` flat buffers, each large enough for any shard chunk of this layer."""
        return self.buffers.lease(count if self.n_shards > 1 else 0, self.max_chunk_numel, self.dtype, self.device)

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

    def __repr__(self) -> str:
        return (f"RotatingShard({self.name!r}, {type(self.module).__name__}, shard {self.rank}/{self.n_shards}, "
                f"{len(self.chunks)} chunk(s), {self.position.value})")
