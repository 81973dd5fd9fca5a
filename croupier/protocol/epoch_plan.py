"""The epoch plan: which global index each rank gets at each (batch, position).

Guarantees, pinned by tests/test_planner.py:

* The permutation P of 0..N-1 is a pure function of (seed, epoch, N): the same on
  every machine, process and run, and a different one for every epoch.
* Global batch b is the contiguous block P[b*G : (b+1)*G] with G = batch_size *
  world_size; rank r gets the r-th equal slice of it (batch-aligned, unlike
  DistributedSampler's strided `indices[rank::world]`).
* Exactly once: over one epoch the ranks together get every index once, plus, when
  `drop_last` is false, the padding described below.
* O(1) memory in N: P is a keyed bijection (a Feistel network over the next power
  of four, cycle-walked into 0..N-1) evaluated on demand, never an array of N.

Tail handling mirrors `DistributedSampler` followed by a per-rank `DataLoader`:

* drop_last=False: P is padded by wrapping around to its start until its length is a
  multiple of world_size (those samples are flagged as padding); the last global
  batch may then be short, and every rank gets an equal, shorter last batch.
* drop_last=True: only the N // G full global batches are dealt; the tail of P is
  not served this epoch (a different tail each epoch).

Elastic resume (`PlanStart`): a plan may begin part-way through P, after samples an
earlier shape delivered. It then deals the rest of P, in P's order, cut anew into global
batches of its own batch_size * world_size, numbered from 0; the padding above wraps
around to the start of that rest. The permutation itself never changes. Pinned by
tests/test_elastic_resume.py (old ranks' batches and the new plan's: every index once).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

_ROUNDS = 6
_SLICE = 1 << 16
_U64 = (1 << 64) - 1
#: Values still walking once this few are left finish in Python ints (see `_walk`).
_SCALAR_TAIL = 16
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


class PlanError(ValueError):
    """Options that no plan can satisfy (rank outside the world, batch size 0...)."""


class BatchRangeError(PlanError):
    """A start or end batch outside the epoch."""


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(x: np.ndarray) -> np.ndarray:
    # splitmix64's finaliser: a cheap, well-spread, fully portable round function. In
    # place (x is the caller's temporary), its shifts' scalars made once: on a batch's
    # few values a NumPy call's fixed cost is all there is.
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


@dataclass(frozen=True)
class Permutation:
    """A bijection of 0..n-1 keyed by (seed, epoch, n), evaluated element-wise."""

    n: int
    seed: int
    epoch: int
    _half_bits: int = field(init=False, repr=False)
    _keys: tuple[int, ...] = field(init=False, repr=False)
    _np_keys: tuple[np.uint64, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise PlanError(f"a permutation needs at least one element, got n={self.n}")
        if self.n > 2**62:
            raise PlanError(f"n={self.n} is above the supported 2**62 rows")
        bits = max(2, math.ceil(math.log2(self.n))) if self.n > 1 else 2
        object.__setattr__(self, "_half_bits", (bits + 1) // 2)
        digest = hashlib.blake2b(
            f"croupier.plan.v1:{self.seed}:{self.epoch}:{self.n}".encode(), digest_size=8 * _ROUNDS
        ).digest()
        keys = tuple(int.from_bytes(digest[8 * i : 8 * i + 8], "little") for i in range(_ROUNDS))
        object.__setattr__(self, "_keys", keys)
        object.__setattr__(self, "_np_keys", tuple(np.uint64(k) for k in keys))

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self._half_bits)
        mask = np.uint64((1 << self._half_bits) - 1)
        left, right = x >> h, x & mask
        with np.errstate(over="ignore"):
            for key in self._np_keys:
                t = _mix(right ^ key)
                t &= mask
                t ^= left
                left, right = right, t
        return (left << h) | right

    def __call__(self, positions: np.ndarray | int) -> np.ndarray:
        """P[positions]; positions must lie in 0..n-1."""
        x = np.asarray(positions, dtype=np.uint64)
        if self.n == 1:
            return np.zeros_like(x)
        if x.ndim == 0:
            return self._walk(x.reshape(1)).reshape(())
        if x.ndim == 1 and x.size > _SLICE:
            # In slices: each numpy call then holds the GIL for a millisecond, not for
            # the whole of a huge batch (planned in a worker thread, beside the loop).
            return np.concatenate([self._walk(x[i : i + _SLICE]) for i in range(0, x.size, _SLICE)])
        return self._walk(x)

    def _feistel_int(self, v: int) -> int:
        """`_feistel` of one value, in Python ints (the same bits: products wrap at 2**64)."""
        h, mask = self._half_bits, (1 << self._half_bits) - 1
        left, right = v >> h, v & mask
        for key in self._keys:
            x = right ^ key
            x ^= x >> 30
            x = (x * 0xBF58476D1CE4E5B9) & _U64
            x ^= x >> 27
            x = (x * 0x94D049BB133111EB) & _U64
            left, right = right, left ^ ((x ^ (x >> 31)) & mask)
        return (left << h) | right

    def _walk(self, x: np.ndarray) -> np.ndarray:
        y = self._feistel(x)
        # Cycle-walk: the Feistel domain is up to 4n, so re-encrypt values that land
        # outside 0..n-1; the walk stays a bijection on 0..n-1 and ends in ~2 steps on
        # average, but the last of a batch's values can take a dozen. Those few finish
        # in Python ints: a NumPy pass costs its ~60 calls' fixed cost however few values
        # it has (a batch of 16 took 680 us, nearly all in its walk's tail).
        n = self.n
        walking = np.flatnonzero(y >= np.uint64(n))
        while walking.size > _SCALAR_TAIL:
            y[walking] = self._feistel(y[walking])
            walking = walking[y[walking] >= np.uint64(n)]
        for i in walking.tolist():
            v = self._feistel_int(int(y[i]))
            while v >= n:
                v = self._feistel_int(v)
            y[i] = v
        return y


@dataclass(frozen=True)
class PlanStart:
    """Where an epoch's plan begins in its permutation P (an elastic resume).

    P[0:position] and the ranges [start, end) in `delivered` (flattened: start, end,
    start, end, ... as on the wire; sorted, apart, all past `position`) were delivered
    under an earlier shape. The plan deals the rest of P, in order: its position q is P's
    q-th position not yet delivered. The default is the whole of P.
    """

    position: int = 0
    delivered: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return self.position != 0 or bool(self.delivered)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        d = self.delivered
        return list(zip(d[0::2], d[1::2]))

    def check(self, num_rows: int) -> None:
        """Refuse a start that no plan of `num_rows` rows can begin at, naming the value."""
        if not 0 <= self.position <= num_rows:
            raise PlanError(f"plan_position {self.position} is outside 0..{num_rows} (rows in the dataset)")
        if len(self.delivered) % 2:
            raise PlanError(f"plan_delivered holds {len(self.delivered)} values: it must be (start, end) pairs")
        last = self.position
        for start, end in self.ranges:
            if not last < start < end <= num_rows:
                raise PlanError(
                    f"plan_delivered range [{start}, {end}) must be non-empty, sorted and apart, after "
                    f"{last} and within the dataset's {num_rows} rows"
                )
            last = end

    @property
    def skipped(self) -> int:
        """Positions of P delivered before the plan begins."""
        return self.position + sum(end - start for start, end in self.ranges)

    def to_positions(self, q: np.ndarray) -> np.ndarray:
        """The positions in P of the plan's positions `q` (uint64): each skips what was delivered."""
        q = np.asarray(q, dtype=np.uint64)
        if not self.delivered:
            return q + np.uint64(self.position)
        starts = np.array(self.delivered[0::2], dtype=np.uint64)
        lengths = np.array(self.delivered[1::2], dtype=np.uint64) - starts
        before = np.concatenate(([0], np.cumsum(lengths))).astype(np.uint64)
        # A range's start expressed as a plan position: where the plan meets it.
        meets = starts - np.uint64(self.position) - before[:-1]
        return q + np.uint64(self.position) + before[np.searchsorted(meets, q, side="right")]

    def _gaps(self) -> list[tuple[int, int, int]]:
        """(first plan position, last plan position + 1, P position of the first) of each
        run of P between delivered ranges; the last run is open-ended."""
        runs, q, p = [], 0, self.position
        for start, end in self.ranges:
            runs.append((q, q + start - p, p))
            q, p = q + start - p, end
        runs.append((q, 2**63, p))
        return runs

    def after(self, ranges: list[tuple[int, int]], remaining: int) -> "PlanStart":
        """The start once the plan's positions in `ranges` ([start, end) pairs, any order)
        are delivered too; positions at or past `remaining` (padding) are ignored. Costs
        O(ranges x delivered ranges), whatever their lengths."""
        spans = [(0, self.position), *self.ranges]
        gaps = self._gaps()
        for a, b in ranges:
            b = min(b, remaining)
            for q0, q1, p0 in gaps:  # the P ranges [a, b) covers, one per run it crosses
                lo, hi = max(a, q0), min(b, q1)
                if lo < hi:
                    spans.append((p0 + lo - q0, p0 + hi - q0))
        merged: list[list[int]] = []
        for a, b in sorted(s for s in spans if s[0] < s[1]):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        if not merged or merged[0][0] != 0:
            merged.insert(0, [0, 0])
        return PlanStart(merged[0][1], tuple(v for a, b in merged[1:] for v in (a, b)))


@dataclass(frozen=True)
class RankBatch:
    """One rank's batch: global indices in batch-position order."""

    batch: int
    indices: np.ndarray  # uint64, len == batch length
    padding: np.ndarray  # bool, True where the sample repeats an index to fill the tail


@dataclass(frozen=True)
class EpochPlan:
    """The deal of one epoch of an N-row dataset to `world_size` ranks."""

    num_rows: int
    seed: int
    epoch: int
    batch_size: int
    world_size: int = 1
    drop_last: bool = False
    #: Where in P the plan begins (an elastic resume); default: at its start.
    start: PlanStart = PlanStart()

    def __post_init__(self) -> None:
        if self.num_rows < 1:
            raise PlanError("the dataset is empty")
        if self.world_size < 1:
            raise PlanError(f"world_size must be at least 1, got {self.world_size}")
        if self.batch_size < 1:
            raise PlanError(f"batch_size must be at least 1, got {self.batch_size}")
        if self.batch_size > self.num_rows:
            raise PlanError(f"batch_size {self.batch_size} is larger than the dataset ({self.num_rows} rows)")
        if self.drop_last and self.num_rows < self.global_batch_size:
            raise PlanError(
                f"drop_last with batch_size {self.batch_size} x world_size {self.world_size} = "
                f"{self.global_batch_size} leaves no full batch of a {self.num_rows}-row dataset"
            )
        self.start.check(self.num_rows)

    @cached_property
    def permutation(self) -> Permutation:
        return Permutation(self.num_rows, self.seed, self.epoch)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def remaining(self) -> int:
        """Rows of P this plan deals: all of them, unless it begins after a resume."""
        return self.num_rows - self.start.skipped

    @property
    def total_size(self) -> int:
        """Samples dealt over all ranks this epoch, padding included."""
        if self.drop_last:
            return (self.remaining // self.global_batch_size) * self.global_batch_size
        return math.ceil(self.remaining / self.world_size) * self.world_size

    @property
    def num_batches(self) -> int:
        """Batches each rank gets this epoch."""
        return math.ceil(self.total_size / self.global_batch_size)

    @property
    def samples_per_rank(self) -> int:
        return self.total_size // self.world_size

    def batch_length(self, batch: int) -> int:
        """Samples in one rank's `batch` (all ranks get the same)."""
        self._check_batch(batch)
        start = batch * self.global_batch_size
        return (min(start + self.global_batch_size, self.total_size) - start) // self.world_size

    @property
    def last_batch_size(self) -> int:
        # 0 when nothing is left to deal (a resume after the last full batch, drop_last)
        return self.batch_length(self.num_batches - 1) if self.num_batches else 0

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise PlanError(f"rank {rank} is outside the world of size {self.world_size} (0..{self.world_size - 1})")

    def _check_batch(self, batch: int) -> None:
        if not 0 <= batch < self.num_batches:
            raise PlanError(f"batch {batch} is outside 0..{self.num_batches - 1} for this epoch")

    def samples_in(self, start: int, end: int) -> int:
        """Samples in one rank's batches start..end-1, without visiting them."""
        if end <= start:
            return 0
        full = (end - start) * self.batch_size
        return full - (self.batch_size - self.last_batch_size if end == self.num_batches else 0)

    def slot_range(self, rank: int, batch: int) -> tuple[int, int]:
        """The plan positions [start, end) of `rank`'s `batch` (P's, unless the plan has a start)."""
        length = self.batch_length(batch)
        first = batch * self.global_batch_size + rank * length
        return first, first + length

    def _slots(self, rank: int, batch: int) -> np.ndarray:
        return np.arange(*self.slot_range(rank, batch), dtype=np.uint64)

    def rank_batch(self, rank: int, batch: int) -> RankBatch:
        """Global indices of `rank`'s `batch`, in position order."""
        return next(self.rank_batches(rank, batch, batch + 1))

    def rank_batches(
        self, rank: int, start: int = 0, end: int | None = None, block: int = 32, block_samples: int = 1 << 16
    ) -> Iterator[RankBatch]:
        """`rank`'s batches start..end-1 (end defaults to the epoch's end).

        The permutation is evaluated for `block` batches at a time (fewer when that
        would pass `block_samples`): one vectorised call instead of one per batch, in
        memory bounded by the block, not by N. One batch is never split.
        """
        self.check_rank(rank)
        end = self.num_batches if end is None else end
        block = max(1, min(block, block_samples // self.batch_size))
        n = np.uint64(self.remaining)
        for lo in range(start, end, block):
            batches = range(lo, min(lo + block, end))
            slots = [self._slots(rank, b) for b in batches]
            flat = np.concatenate(slots)
            padding = flat >= n
            # Padding wraps around to the start of P (of its rest, after a resume), as
            # DistributedSampler's does.
            positions = np.where(padding, flat % n, flat)
            indices = self.permutation(self.start.to_positions(positions) if self.start else positions)
            offset = 0
            for b, s in zip(batches, slots):
                yield RankBatch(batch=b, indices=indices[offset : offset + len(s)], padding=padding[offset : offset + len(s)])
                offset += len(s)
