"""How one parameter is cut into N shards along one dimension.

A `Split` is pure bookkeeping: for every shard index it lists the ranges of the
parameter's split dimension that the shard owns. Ranges (rather than one slice) let
a shard own a head's rows in each of the q, k and v sections of a packed projection.
Shards may be uneven or empty; nothing here refuses a size that does not divide.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Split:
    """The shards of one parameter: `ranges[s]` along `dim` belong to shard `s`."""

    full_shape: tuple[int, ...]
    dim: int
    ranges: tuple[Ranges, ...]

    @property
    def n_shards(self) -> int:
        return len(self.ranges)

    def length(self, s: int) -> int:
        return sum(b - a for a, b in self.ranges[s])

    def shape(self, s: int) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = self.length(s)
        return tuple(shape)

    def numel(self, s: int) -> int:
        n = 1
        for d in self.shape(s):
            n *= d
        return n

    def take(self, full: torch.Tensor, s: int) -> torch.Tensor:
        """Shard `s` of `full`, as a new contiguous tensor."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"expected a tensor of shape {self.full_shape}, got {tuple(full.shape)}")
        parts = [full.narrow(self.dim, a, b - a) for a, b in self.ranges[s]]
        if not parts:
            return full.new_empty(self.shape(s))
        if len(parts) == 1:
            return parts[0].clone(memory_format=torch.contiguous_format)
        return torch.cat(parts, self.dim)

    def assemble(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every shard's piece, in shard order."""
        if len(pieces) != self.n_shards:
            raise ValueError(f"expected {self.n_shards} pieces, got {len(pieces)}")
        full = pieces[0].new_empty(self.full_shape)
        for s, piece in enumerate(pieces):
            if tuple(piece.shape) != self.shape(s):
                raise ValueError(f"piece {s} has shape {tuple(piece.shape)}, expected {self.shape(s)}")
            at = 0
            for a, b in self.ranges[s]:
                full.narrow(self.dim, a, b - a).copy_(piece.narrow(self.dim, at, b - a))
                at += b - a
        return full

    def chunks(self, k: int) -> list[Split]:
        """Cut every shard's (single) range into `k` consecutive, balanced pieces; piece c of
        every shard makes chunk c. Rotating chunk by chunk bounds the bytes in flight."""
        per_shard = []
        for s in range(self.n_shards):
            at, length = self.single_range(s)
            base, spare = divmod(length, k)
            pieces, start = [], at
            for c in range(k):
                n = base + (1 if c < spare else 0)
                pieces.append(((start, start + n),) if n else ())
                start += n
            per_shard.append(pieces)
        return [Split(self.full_shape, self.dim, tuple(per_shard[s][c] for s in range(self.n_shards)))
                for c in range(k)]

    def single_range(self, s: int) -> tuple[int, int]:
        """(start, length) of shard `s` when it is one contiguous range (empty shards give (0, 0))."""
        if len(self.ranges[s]) > 1:
            raise ValueError("shard spans several ranges")
        if not self.ranges[s]:
            return 0, 0
        a, b = self.ranges[s][0]
        return a, b - a


class Splitter:
    """Cuts counts of units into N balanced parts.

    When units do not divide by N, the spare units go to different shards on
    successive calls, so a model of many uneven layers still ends near 1/N per rank
    instead of piling every remainder on shard 0.
    """

    def __init__(self, n_shards: int):
        if n_shards < 1:
            raise ValueError(f"n_shards must be >= 1, got {n_shards}")
        self.n = n_shards
        self._next_spare = 0

    def counts(self, n_units: int) -> list[int]:
        base, spare = divmod(n_units, self.n)
        start = self._next_spare
        self._next_spare = (start + spare) % self.n
        return [base + (1 if (s - start) % self.n < spare else 0) for s in range(self.n)]

    def even(self, full_shape: tuple[int, ...], dim: int) -> Split:
        """Contiguous, balanced ranges of `dim`."""
        return units(full_shape, dim, self.counts(full_shape[dim]), unit_len=1)


def units(full_shape: tuple[int, ...], dim: int, counts: list[int], unit_len: int,
          sections: int = 1, section_len: int = 0) -> Split:
    """A split by whole units (heads, conv groups) of `unit_len` along `dim`.

    With `sections` > 1 the dimension holds that many consecutive sections of
    `section_len` (e.g. q, k, v of a packed projection) and each shard owns the same
    units in every section.
    """
    ranges = []
    first = 0
    for c in counts:
        ranges.append(tuple(
            (j * section_len + first * unit_len, j * section_len + (first + c) * unit_len)
            for j in range(sections) if c > 0
        ))
        first += c
    return Split(tuple(full_shape), dim, tuple(ranges))
