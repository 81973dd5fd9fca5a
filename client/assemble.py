"""Rebuild batches from chunks that arrive in completion order.

Every sample is placed at its (batch, position) tag, so a batch comes out the same,
bit for bit, whatever order the network delivered its samples in.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from croupier.v1 import croupier_pb2 as pb


class ProtocolError(RuntimeError):
    """The server sent something that contradicts the stream's own header."""


@dataclass
class RawBatch:
    """One complete batch, samples in position order, payloads still encoded."""

    epoch: int
    batch: int
    indices: np.ndarray  # global index of each position
    padding: np.ndarray  # bool per position
    table: pa.Table | None = None  # table datasets: row i is position i
    images: list[pb.Image] | None = None  # image datasets: images[i] is position i

    def __len__(self) -> int:
        return len(self.indices)


@dataclass
class _Partial:
    size: int
    indices: np.ndarray
    padding: np.ndarray
    filled: np.ndarray
    count: int = 0
    parts: list[tuple[pa.RecordBatch, Any]] = field(default_factory=list)  # rows, their positions (list or array)
    images: list[Any] | None = None


@dataclass
class ArrivalStats:
    samples: int = 0
    bytes: int = 0
    chunks: int = 0
    #: Samples that arrived after a sample placed later in the plan: out-of-order deliveries.
    out_of_order: int = 0
    _high: int = -1  # largest batch * (batch_size + 1) + position seen


#: A chunk's tags are walked as Python lists up to this many samples, by NumPy past it.
SMALL_CHUNK = 64
#: A chunk's tags sorted by batch, as lists (small chunks) or arrays: batches, positions,
#: indices, padding (None: none), the chunk's row of each (None: in order), and where each
#: batch's run starts (and the end).
_Tags = tuple[Any, Any, Any, Any, Any, list[int]]


class BatchAssembler:
    """Feeds on `StreamEpochResponse` chunks; hands out complete `RawBatch`es."""

    def __init__(self, header: pb.StreamHeader, skip_batches: frozenset[int] = frozenset()):
        self.header = header
        self.epoch = header.epoch
        self.is_table = header.dataset.kind == pb.DATASET_KIND_TABLE
        self.skip = skip_batches
        self.partial: dict[int, _Partial] = {}
        self.stats = ArrivalStats()

    def _size(self, batch: int) -> int:
        h = self.header
        if not h.start_batch <= batch < h.end_batch:
            raise ProtocolError(f"batch {batch} is outside this stream's {h.start_batch}..{h.end_batch - 1}")
        return h.last_batch_size if batch == h.num_batches - 1 else h.batch_size

    def _partial(self, batch: int) -> _Partial:
        p = self.partial.get(batch)
        if p is None:
            size = self._size(batch)
            p = _Partial(size, np.zeros(size, np.uint64), np.zeros(size, bool), np.zeros(size, bool))
            if not self.is_table:
                p.images = [None] * size
            self.partial[batch] = p
        return p

    def add(self, chunk: pb.Chunk) -> list[RawBatch]:
        """Place a chunk's samples; return the batches it completed."""
        if chunk.epoch != self.epoch:
            raise ProtocolError(f"chunk of epoch {chunk.epoch} in a stream of epoch {self.epoch}")
        n = len(chunk.indices)
        record_batch = None
        if self.is_table:
            record_batch = pa.ipc.open_stream(chunk.arrow_ipc).read_next_batch() if n else None
            if record_batch is not None and record_batch.num_rows != n:
                raise ProtocolError(f"chunk carries {record_batch.num_rows} rows for {n} tags")
            self.stats.bytes += len(chunk.arrow_ipc)
        else:
            if len(chunk.images) != n:
                raise ProtocolError(f"chunk carries {len(chunk.images)} images for {n} tags")
            self.stats.bytes += sum(len(im.data) for im in chunk.images)
        self.stats.samples += n
        self.stats.chunks += 1
        if not n:
            return self._completed(chunk)
        # The tags checked and grouped by batch (for tables one take here, not a take per
        # batch per chunk: ~20 us a sample): as Python lists up to SMALL_CHUNK samples, where
        # two dozen NumPy calls on arrays that small cost more (150 us a chunk) than walking
        # them; by NumPy past it, where a walk costs 0.5 us a sample.
        tags = self._small_tags(chunk) if n <= SMALL_CHUNK else self._large_tags(chunk)
        batches, positions, indices, padding, source, cuts = tags
        if source is not None and record_batch is not None:
            record_batch = record_batch.take(pa.array(source))
        for a, e in zip(cuts, cuts[1:]):
            if int(batches[a]) not in self.skip:
                self._place(int(batches[a]), a, e, positions, indices, padding, record_batch, source, chunk)
        return self._completed(chunk)

    def _small_tags(self, chunk: pb.Chunk) -> _Tags:
        batches, positions, indices = list(chunk.batches), list(chunk.positions), list(chunk.indices)
        padding = list(chunk.padding) if len(chunk.padding) else None
        h = self.header
        # Out of order: a sample whose (batch, position) is below one that came before it.
        keys = list(map(operator.add, map(operator.mul, batches, itertools.repeat(h.batch_size + 1)), positions))
        running = list(itertools.accumulate(keys, max, initial=self.stats._high))
        self.stats.out_of_order += sum(map(operator.lt, keys, running))
        self.stats._high = running[-1]
        self._check_ranges(min(batches), max(batches), min(positions), max(positions), batches, positions)
        source: list[int] | None = None  # row of the chunk that each (sorted) sample came from
        if any(map(operator.gt, batches, batches[1:])):
            source = sorted(range(len(batches)), key=batches.__getitem__)
            batches, positions = [batches[i] for i in source], [positions[i] for i in source]
            indices = [indices[i] for i in source]
            padding = [padding[i] for i in source] if padding is not None else None
        cuts = [0, *itertools.compress(range(1, len(batches)), map(operator.ne, batches[1:], batches)), len(batches)]
        return batches, positions, indices, padding, source, cuts

    def _large_tags(self, chunk: pb.Chunk) -> _Tags:
        b = np.asarray(chunk.batches, dtype=np.int64)
        q = np.asarray(chunk.positions, dtype=np.int64)
        i = np.asarray(chunk.indices, dtype=np.uint64)
        f = np.asarray(chunk.padding, dtype=bool) if len(chunk.padding) else None
        keys = b * (self.header.batch_size + 1) + q
        before = np.maximum.accumulate(np.concatenate(([self.stats._high], keys)))
        self.stats.out_of_order += int((keys < before[:-1]).sum())
        self.stats._high = int(before[-1])
        self._check_ranges(int(b.min()), int(b.max()), int(q.min()), int(q.max()), b, q)
        source = None
        if (b[1:] < b[:-1]).any():
            order = np.argsort(b, kind="stable")
            b, q, i, f = b[order], q[order], i[order], (f[order] if f is not None else None)
            source = order
        cuts = [0, *(np.flatnonzero(b[1:] != b[:-1]) + 1).tolist(), len(b)]
        return b, q, i, f, source, cuts

    def _check_ranges(self, lo: int, hi: int, qlo: int, qhi: int, batches: Any, positions: Any) -> None:
        """Refuse tags (lists or arrays) outside the stream's batches, or outside their batch,
        naming the first; from their bounds, walking them only where those say one may be."""
        h = self.header
        if lo < h.start_batch or hi >= h.end_batch:
            batches = np.asarray(batches).tolist()
            self._size(next(b for b in batches if not h.start_batch <= b < h.end_batch))  # raises, naming it
        last = h.num_batches - 1
        if qlo < 0 or qhi >= min(h.batch_size, h.last_batch_size if lo <= last <= hi else h.batch_size):
            for b, q in zip(np.asarray(batches).tolist(), np.asarray(positions).tolist()):
                size = h.last_batch_size if b == last else h.batch_size
                if not 0 <= q < size:
                    raise ProtocolError(f"position {q} outside 0..{size - 1} in batch {b}")

    def _place(self, b: int, a: int, e: int, positions: Any, indices: Any, padding: Any,
               record_batch: pa.RecordBatch | None, source: Any, chunk: pb.Chunk) -> None:
        """Samples a..e of the (sorted) chunk, all of batch `b`, at their positions (the
        tags are lists or arrays: NumPy takes either as an index)."""
        p = self._partial(b)
        pos = positions[a:e]
        seen = p.filled[pos]
        p.filled[pos] = True
        if seen.any() or int(p.filled.sum()) != p.count + e - a:  # before, or twice in this chunk
            at = np.asarray(pos)
            twice = at[seen][0] if seen.any() else next(q for q in at.tolist() if (at == q).sum() > 1)
            raise ProtocolError(f"batch {b}: position {int(twice)} delivered twice")
        p.indices[pos] = indices[a:e]
        if padding is not None:
            p.padding[pos] = padding[a:e]
        p.count += e - a
        if record_batch is not None:
            p.parts.append((record_batch.slice(a, e - a), pos))
        elif p.images is not None:
            images, into = chunk.images, p.images
            rows = range(a, e) if source is None else np.asarray(source[a:e]).tolist()  # the chunk's rows
            for r, q in zip(rows, np.asarray(pos).tolist()):
                into[q] = images[r]

    def _completed(self, chunk: pb.Chunk) -> list[RawBatch]:
        done = []
        for b in chunk.completed_batches:
            if b in self.skip:
                continue
            p = self.partial.pop(b, None)
            if p is None or p.count != p.size:
                got = 0 if p is None else p.count
                raise ProtocolError(f"batch {b} marked complete with {got} of {self._size(b)} samples")
            done.append(self._finish(b, p))
        return done

    def _finish(self, batch: int, p: _Partial) -> RawBatch:
        out = RawBatch(self.epoch, batch, p.indices, p.padding)
        if self.is_table:
            # The batch's slices of every chunk, joined once, then put in position order.
            rows = pa.concat_batches([part for part, _ in p.parts]) if len(p.parts) > 1 else p.parts[0][0]
            positions = np.concatenate([pos for _, pos in p.parts]) if len(p.parts) > 1 else np.asarray(p.parts[0][1])
            if len(positions) > 1 and not (positions[1:] > positions[:-1]).all():
                rows = rows.take(pa.array(np.argsort(positions, kind="stable")))
            out.table = pa.Table.from_batches([rows])
        else:
            out.images = p.images
        return out
