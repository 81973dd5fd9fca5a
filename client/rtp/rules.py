"""What a layer-specific sharding rule provides, and how shard outputs combine.

A rule knows three things about one module type: how to cut its parameters (`plan`),
what one shard computes for this rank's input (`forward_piece`), and that shard's
contribution to the input gradient and to its own weight gradient (`backward_piece`).
The rotation itself (which shard is where, sends, receives) lives in `rotation.py`;
a rule's `forward` reaches it only through the `rotate` callable it is handed.
The `layer` a piece method receives is a `LayerChunk`: its `plan` holds the splits of
what rotates (the whole shards, or one slice of each) and `module` the layer's module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .layer_plan import LayerChunk, LayerPlan
from .split import Split, Splitter


class Unsupported(Exception):
    """This module's configuration cannot be sharded; it stays replicated."""


@dataclass(frozen=True)
class Concat:
    """Shard `s` produces the `split` ranges of output dimension `dim`."""

    dim: int
    split: Split

    def grad(self, gy: torch.Tensor, s: int) -> torch.Tensor:
        at, length = self.split.single_range(s)
        return gy.narrow(self.dim, at, length)


@dataclass(frozen=True)
class Sum:
    """Every shard produces a full-size partial output; they add up."""

    def grad(self, gy: torch.Tensor, s: int) -> torch.Tensor:
        return gy


Combine = Concat | Sum


class Combiner:
    """Builds one output from the pieces as they are produced, without keeping them."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None

    def add(self, how: Combine, s: int, piece: torch.Tensor) -> None:
        if isinstance(how, Sum):
            # Pieces are fresh tensors, so the first one can become the accumulator.
            self.out = piece if self.out is None else self.out.add_(piece)
            return
        if self.out is None:
            shape = list(piece.shape)
            shape[how.dim] = how.split.full_shape[how.split.dim]
            self.out = piece.new_empty(shape)
        at, length = how.split.single_range(s)
        self.out.narrow(how.dim, at, length).copy_(piece)

    def result(self) -> torch.Tensor:
        assert self.out is not None
        return self.out


GradAdder = Callable[[list[torch.Tensor]], None]
#: Runs the layer across the ring on inputs a rule's `forward` prepared: `rotate(call, inputs)`
#: returns the combined outputs (rotation.rotate, bound to the layer).
Rotate = Callable[[Any, Sequence[torch.Tensor]], Any]


def rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as a matrix of its last dimension (explicit sizes: a dimension may be 0)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


class ShardRule:
    """Base of the layer rules. Subclasses set `types` and implement the hooks below."""

    types: tuple[type[nn.Module], ...] = ()

    def claimed(self, module: nn.Module) -> list[tuple[nn.Module, str]]:
        """(owner, name) of every parameter this rule shards for `module`, in flat order."""
        raise NotImplementedError

    def split_dims(self, module: nn.Module, owner: nn.Module, name: str) -> tuple[int, ...]:
        """Dimensions this rule can cut `owner.name` along, preferred first (used for tied weights)."""
        return ()

    def plan(self, module: nn.Module, splitter: Splitter, fixed: dict[tuple[int, str], Split]) -> LayerPlan:
        """Cut the parameters; `fixed[(id(owner), name)]` is a split already chosen for a tied weight."""
        raise NotImplementedError

    def forward(self, module: nn.Module, rotate: Rotate, *args: Any, **kwargs: Any) -> Any:
        """The module's forward, replaced: prepares the inputs and hands them to `rotate`."""
        raise NotImplementedError

    def combines(self, layer: LayerChunk, call: Any) -> list[Combine]:
        """How each output of `forward_piece` combines across shards (first output differentiable)."""
        raise NotImplementedError

    def forward_piece(self, layer: LayerChunk, call: Any, inputs: Sequence[torch.Tensor],
                      w: list[torch.Tensor], s: int) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def chunkable(self, plan: LayerPlan) -> bool:
        """Whether a large shard may rotate in slices: each parameter is one range per shard
        and a slice of the shards computes a slice (or a partial sum) of the output."""
        return False

    def uses_rng(self, layer: LayerChunk, call: Any) -> bool:
        """Whether a piece draws random numbers (dropout): then backward replays the RNG state."""
        return False

    def backward_needs_weights(self, layer: LayerChunk, call: Any, need_in: Sequence[bool]) -> bool:
        """Whether backward must see the weights; if not, only gradient accumulators travel."""
        return True

    def backward_piece(self, layer: LayerChunk, call: Any, inputs: Sequence[torch.Tensor],
                       w: list[torch.Tensor] | None, s: int, gy: torch.Tensor,
                       dx: list[torch.Tensor | None], need_w: bool) -> GradAdder | None:
        """Add shard `s`'s input-gradient contribution into `dx`; return a function that adds its
        weight gradient into the travelling accumulator (called once that has arrived). `w` is
        None when `backward_needs_weights` said no.

        The default recomputes the piece under autograd; rules with a closed form override it
        so the weight gradient is written straight into the accumulator, with no temporary.
        """
        want_x = [d is not None for d in dx]
        if not any(want_x) and not need_w:
            return None
        with torch.enable_grad():
            xs = [x.detach().requires_grad_(want) for x, want in zip(inputs, want_x)]
            ws = [t.detach().requires_grad_(need_w) for t in w]
            out = self.forward_piece(layer, call, xs, ws, s)[0]
            wrt = [x for x, want in zip(xs, want_x) if want] + (ws if need_w else [])
            # An empty shard's piece may depend on nothing: its gradients are all zero.
            grads = (torch.autograd.grad(out, wrt, gy, allow_unused=True) if out.requires_grad
                     else [None] * len(wrt))
        it = iter(grads)
        for d, want in zip(dx, want_x):
            if want:
                g = next(it)
                if g is not None:
                    d.add_(g)
        if not need_w:
            return None
        wgrads = list(it)

        def add(acc: list[torch.Tensor]) -> None:
            for a, g in zip(acc, wgrads):
                if g is not None:
                    a.add_(g)
        return add
