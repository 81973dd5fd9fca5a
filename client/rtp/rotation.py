"""The rotation schedule of one layer call: forward around the ring, backward around it again.

Forward, step k on group rank r computes with shard (r - k) mod N while that shard is
already on its way to rank r + 1 and shard (r - k - 1) arrives from rank r - 1: two
weight buffers, one being computed with (and sent), one being received.

Backward runs the other way: step k computes with shard (r + k) mod N, starting from
the owned one. Each shard's gradient accumulator starts at its owner, picks up every
rank's contribution as it travels r -> r - 1, and after N hops is back home fully
reduced. An accumulator's hop overlaps the next step's compute; the weight transfer
overlaps the current one's. When the layer's input needs no gradient and its weight
gradient does not read the weights (Linear, Embedding, LayerNorm), only accumulators move.

A layer larger than the chunk size repeats all this for each slice of its shards in turn.

`rotate` is the entry: a rule's `forward` prepares the inputs and hands them to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from .ring import BACKWARD, FORWARD, TAG_GRADS, TAG_WEIGHTS
from .rules import Combiner
from .shard import Position, RotatingShard


class RngReplay:
    """RNG states at the start of each piece, so a recomputed piece draws the same dropout."""

    def __init__(self, device: torch.device):
        self.device = device
        self._states: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}

    def save(self, key: tuple[int, int]) -> None:
        dev = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        self._states[key] = (torch.get_rng_state(), dev)

    def restore(self, key: tuple[int, int]) -> None:
        cpu, dev = self._states[key]
        torch.set_rng_state(cpu)
        if dev is not None:
            torch.cuda.set_rng_state(dev, self.device)

    def fork(self) -> contextlib.AbstractContextManager:
        """Leaves the caller's RNG stream as it was once the replay is over."""
        devices = [self.device] if self.device.type == "cuda" else []
        return torch.random.fork_rng(devices=devices)


def rotate_forward(layer: RotatingShard, c: int, combiners: list[Combiner], call: Any,
                   inputs: Sequence[torch.Tensor], own: Sequence[torch.Tensor], rng: RngReplay | None) -> None:
    """One chunk's forward rotation; pieces go straight into `combiners`."""
    n, rule, chunk = layer.n_shards, layer.rule, layer.chunks[c]
    hows = rule.combines(chunk, call)
    with layer.lease(2) as bufs:
        # The owned shard is sent as a copy: the parameters never leave home.
        cur = chunk.pack(own, bufs[0], layer.rank) if n > 1 else None
        for k in range(n):
            s = layer.shard_at(k, FORWARD)
            layer.visiting = s
            transfer = nxt = None
            if k < n - 1:
                nxt = bufs[(k + 1) % 2][: chunk.numel(layer.shard_at(k + 1, FORWARD))]
                transfer = layer.ring.shift(cur, nxt, FORWARD, TAG_WEIGHTS)
            w = list(own) if k == 0 else chunk.views(cur, s)
            if rng is not None:
                rng.save((c, s))
            for combiner, how, piece in zip(combiners, hows, rule.forward_piece(chunk, call, inputs, w, s)):
                combiner.add(how, s, piece)
            if transfer is not None:
                transfer.wait()
                cur = nxt


def rotate_backward(layer: RotatingShard, c: int, call: Any, inputs: Sequence[torch.Tensor], gy: torch.Tensor,
                    dx: list[torch.Tensor | None], need_w: bool, own: Sequence[torch.Tensor] | None,
                    rng: RngReplay | None) -> list[torch.Tensor] | None:
    """One chunk's backward rotation: adds into `dx`, returns the owned chunk's reduced gradient.

    `own` is None when the rule needs no weights in backward: then only accumulators travel.
    """
    n, rank, rule, ring, chunk = layer.n_shards, layer.rank, layer.rule, layer.ring, layer.chunks[c]
    how = rule.combines(chunk, call)[0]
    final: torch.Tensor | None = None
    grads_moving = None
    with layer.lease(0 if own is None else 2) as wbufs, layer.lease(2 if need_w else 0) as gbufs:
        cur = chunk.pack(own, wbufs[0], rank) if wbufs else None
        for k in range(n):
            s = layer.shard_at(k, BACKWARD)
            layer.visiting = s
            weights_moving = nxt = None
            if wbufs and k < n - 1:
                nxt = wbufs[(k + 1) % 2][: chunk.numel(layer.shard_at(k + 1, BACKWARD))]
                weights_moving = ring.shift(cur, nxt, BACKWARD, TAG_WEIGHTS)
            w = None if own is None else list(own) if k == 0 else chunk.views(cur, s)
            if rng is not None:
                rng.restore((c, s))
            add_grad = rule.backward_piece(chunk, call, inputs, w, s, how.grad(gy, s), dx, need_w)
            if need_w:
                if n == 1:
                    acc = final = torch.zeros(chunk.numel(s), dtype=layer.dtype, device=layer.device)
                elif k == 0:
                    acc = gbufs[0][: chunk.numel(s)].zero_()
                else:
                    grads_moving.wait()  # the accumulator of shard s, from rank r + 1
                    acc = gbufs[k % 2][: chunk.numel(s)]
                if add_grad is not None:
                    add_grad(chunk.views(acc, s))
                if n > 1:
                    if k < n - 1:
                        target = gbufs[(k + 1) % 2][: chunk.numel(layer.shard_at(k + 1, BACKWARD))]
                    else:  # the owned shard's accumulator comes home: it becomes the gradient
                        target = final = torch.empty(chunk.numel(rank), dtype=layer.dtype, device=layer.device)
                    grads_moving = ring.shift(acc, target, BACKWARD, TAG_GRADS)
            if weights_moving is not None:
                weights_moving.wait()
                cur = nxt
        if grads_moving is not None:
            grads_moving.wait()
    if final is None:
        return None
    final.div_(n)  # the mean over ranks' micro-batches, as DDP
    return chunk.views(final, rank)


class RotatedLayer(torch.autograd.Function):
    """Autograd node of one layer call: inputs and the owned shard in, combined outputs out.

    Only the inputs are saved; the weights are fetched again by the backward rotation.
    Outputs after the first (e.g. attention weights) are not differentiable.
    """

    @staticmethod
    def forward(ctx: Any, layer: RotatingShard, call: Any, n_in: int, *tensors: torch.Tensor) -> Any:
        inputs, own = tensors[:n_in], tensors[n_in:]
        rng = RngReplay(layer.device) if layer.rule.uses_rng(layer.chunks[0], call) else None
        combiners = [Combiner() for _ in layer.rule.combines(layer.chunks[0], call)]
        with layer.rotating(Position.ROTATING_FORWARD):
            for c, chunk in enumerate(layer.chunks):
                rotate_forward(layer, c, combiners, call, inputs, chunk.own(own), rng)
        outs = tuple(combiner.result() for combiner in combiners)
        ctx.layer, ctx.call, ctx.n_in, ctx.rng = layer, call, n_in, rng
        ctx.save_for_backward(*inputs)
        if len(outs) > 1:
            ctx.mark_non_differentiable(*outs[1:])
            return outs
        return outs[0]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gy: torch.Tensor, *_aux: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        layer, call, rng = ctx.layer, ctx.call, ctx.rng
        inputs = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]
        need_in, need_own = needs[: ctx.n_in], needs[ctx.n_in:]
        need_w = any(need_own)
        dx = [torch.zeros(x.shape, dtype=x.dtype, device=x.device) if need else None
              for x, need in zip(inputs, need_in)]
        # A first layer (no input gradient) whose weight gradient does not read the weights
        # needs only the accumulators to travel.
        with_weights = layer.rule.backward_needs_weights(layer.chunks[0], call, need_in)
        own = [p.detach() for p in layer.own()]
        grads: list[torch.Tensor] | None = None
        with (rng.fork() if rng is not None else contextlib.nullcontext()), \
                layer.rotating(Position.ROTATING_BACKWARD):
            for c, chunk in enumerate(layer.chunks):
                got = rotate_backward(layer, c, call, inputs, gy, dx, need_w,
                                      chunk.own(own) if with_weights else None, rng)
                if got is None:
                    continue
                if len(layer.chunks) == 1:
                    grads = got
                    continue
                if grads is None:
                    grads = [torch.empty_like(p) for p in own]
                for into, g in zip(chunk.own(grads), got):
                    into.copy_(g)
        own_grads = ([g if need else None for g, need in zip(grads, need_own)] if grads is not None
                     else [None] * len(need_own))
        return (None, None, None, *dx, *own_grads)


def rotate(layer: RotatingShard, call: Any, inputs: Sequence[torch.Tensor]) -> Any:
    """Run `layer` on `inputs` across the ring (differentiable in the inputs and the owned shard)."""
    if torch.is_autocast_enabled(layer.device.type):
        # Pieces would come out in the autocast dtype while backward's closed forms mix it
        # with full-precision saved inputs; cast the model instead (model.to(torch.bfloat16)).
        raise RuntimeError(f"layer {layer.name!r}: RotatedTensorParallel does not support autocast")
    own = layer.own()
    return RotatedLayer.apply(layer, call, len(inputs), *inputs, *own)
