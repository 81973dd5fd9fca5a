"""One layer's shards as seen from one rank: what it owns, what it is visiting, where the rest are."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from .ring import FORWARD, Ring, RingBuffers
from .rules import LayerPlan, ShardedParam, ShardRule


class Position(enum.Enum):
    """Lifecycle of a layer's shards on a rank."""

    HOME = "home"  # only the owned shard is materialised; nothing in flight
    ROTATING_FORWARD = "rotating_forward"  # visiting shards arrive from the previous rank
    ROTATING_BACKWARD = "rotating_backward"  # shards travel back with their gradient accumulators


class Chunk:
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


def _chunked(module: nn.Module, plan: LayerPlan, n_shards: int, rank: int, k: int) -> list[Chunk]:
    if k <= 1:
        return [Chunk(module, plan, n_shards, rank, None)]
    per_param = [sp.split.chunks(k) for sp in plan.params]
    chunks, offsets = [], [0] * len(plan.params)
    for c in range(k):
        params = [ShardedParam(sp.owner, sp.name, splits[c]) for sp, splits in zip(plan.params, per_param)]
        chunks.append(Chunk(module, LayerPlan(params, plan.detail), n_shards, rank, list(offsets)))
        offsets = [at + splits[c].length(rank) for at, splits in zip(offsets, per_param)]
    return chunks


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
        whole = Chunk(module, plan, ring.size, ring.rank, None)
        k = 1
        if chunk_bytes and rule.chunkable(plan):
            longest = max(p.split.length(s) for p in plan.params for s in range(ring.size))
            k = min(math.ceil(whole.max_numel * self.dtype.itemsize / chunk_bytes), max(longest, 1))
        self.chunks = _chunked(module, plan, ring.size, ring.rank, k)

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

    def apply(self, call: Any, inputs: Sequence[torch.Tensor]) -> Any:
        """Run this layer on `inputs` across the ring (differentiable in inputs and owned shard)."""
        from .rotation import RotatedLayer

        if torch.is_autocast_enabled(self.device.type):
            # Pieces would come out in the autocast dtype while backward's closed forms mix it
            # with full-precision saved inputs; cast the model instead (model.to(torch.bfloat16)).
            raise RuntimeError(f"layer {self.name!r}: RotatedTensorParallel does not support autocast")
        own = self.own()
        return RotatedLayer.apply(self, call, len(inputs), *inputs, *own)

    def __repr__(self) -> str:
        return (f"RotatingShard({self.name!r}, {type(self.module).__name__}, shard {self.rank}/{self.n_shards}, "
                f"{len(self.chunks)} chunk(s), {self.position.value})")
