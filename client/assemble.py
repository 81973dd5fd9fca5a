"""Rebuild batches from chunks that arrive in completion order.

Every sample is placed at its (batch, position) tag, so a batch comes out the same,
bit for bit, whatever order the network delivered its samples in.
"""

from __future__ import annotations

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
    parts: list[tuple[pa.RecordBatch, np.ndarray]] = field(default_factory=list)  # rows, their positions
    images: list[Any] | None = None


@dataclass
class ArrivalStats:
    samples: int = 0
    bytes: int = 0
    chunks: int = 0
    #: Samples that arrived after a sample placed later in the plan: out-of-order deliveries.
    out_of_order: int = 0
    _high: int = -1  # largest batch * (batch_size + 1) + position seen


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
        batches = np.asarray(chunk.batches, dtype=np.int64)
        positions = np.asarray(chunk.positions, dtype=np.int64)
        indices = np.asarray(chunk.indices, dtype=np.uint64)
        padding = np.asarray(chunk.padding, dtype=bool) if len(chunk.padding) else np.zeros(n, bool)
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
        if n:
            # Out of order: a sample whose (batch, position) is below one that came before it.
            keys = batches * (self.header.batch_size + 1) + positions
            running = np.maximum.accumulate(np.concatenate(([self.stats._high], keys)))
            self.stats.out_of_order += int((keys < running[:-1]).sum())
            self.stats._high = int(running[-1])
            h = self.header
            outside = np.flatnonzero((batches < h.start_batch) | (batches >= h.end_batch))
            if len(outside):
                self._size(int(batches[outside[0]]))  # raises, naming the batch and the range
            last = h.num_batches - 1
            sizes = np.where(batches == last, h.last_batch_size, h.batch_size)
            bad = np.flatnonzero((positions < 0) | (positions >= sizes))
            if len(bad):
                i = int(bad[0])
                raise ProtocolError(f"position {positions[i]} outside 0..{sizes[i] - 1} in batch {batches[i]}")
        source = np.arange(n)  # row of the chunk that each (sorted) sample came from
        if n > 1 and (np.diff(batches) < 0).any():
            # Group the chunk's samples by batch, so each batch's part below is one slice
            # (for tables one take here, not a take per batch per chunk: ~20 us a sample).
            source = np.argsort(batches, kind="stable")
            batches, positions, indices, padding = batches[source], positions[source], indices[source], padding[source]
            if record_batch is not None:
                record_batch = record_batch.take(pa.array(source))
        cuts = (np.flatnonzero(np.diff(batches)) + 1).tolist()
        for a, e in zip([0, *cuts], [*cuts, n]):
            b = int(batches[a])
            if b in self.skip:
                continue
            p = self._partial(b)
            pos = positions[a:e]
            seen = p.filled[pos]
            p.filled[pos] = True
            if seen.any() or int(p.filled.sum()) != p.count + e - a:  # before, or twice in this chunk
                twice = pos[seen][0] if seen.any() else next(q for q in pos.tolist() if (pos == q).sum() > 1)
                raise ProtocolError(f"batch {b}: position {int(twice)} delivered twice")
            p.indices[pos] = indices[a:e]
            p.padding[pos] = padding[a:e]
            p.count += e - a
            if record_batch is not None:
                p.parts.append((record_batch.slice(a, e - a), pos))
            elif p.images is not None:
                for r, q in zip(source[a:e].tolist(), pos.tolist()):
                    p.images[q] = chunk.images[r]
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
            positions = np.concatenate([pos for _, pos in p.parts])
            order = np.argsort(positions, kind="stable")
            in_place = bool((order == np.arange(len(order))).all())
            out.table = pa.Table.from_batches([rows if in_place else rows.take(pa.array(order))])
        else:
            out.images = p.images
        return out
