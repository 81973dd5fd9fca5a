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
    parts: list[tuple[pa.RecordBatch, np.ndarray, np.ndarray]] = field(default_factory=list)
    images: list[Any] | None = None


@dataclass
class ArrivalStats:
    samples: int = 0
    bytes: int = 0
    chunks: int = 0
    #: Samples that arrived after a sample placed later in the plan: out-of-order deliveries.
    out_of_order: int = 0
    _high: tuple[int, int] = (-1, -1)


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
        high = self.stats._high
        for i, key in enumerate(zip(batches.tolist(), positions.tolist())):
            if key < high:
                self.stats.out_of_order += 1
            else:
                high = key
        self.stats._high = high
        for b in np.unique(batches).tolist():
            if b in self.skip:
                continue
            rows = np.nonzero(batches == b)[0]
            p = self._partial(b)
            pos = positions[rows]
            if (pos < 0).any() or (pos >= p.size).any():
                raise ProtocolError(f"position outside 0..{p.size - 1} in batch {b}")
            if p.filled[pos].any():
                raise ProtocolError(f"batch {b}: position {int(pos[p.filled[pos]][0])} delivered twice")
            p.filled[pos] = True
            p.indices[pos] = indices[rows]
            p.padding[pos] = padding[rows]
            p.count += len(rows)
            if record_batch is not None:
                p.parts.append((record_batch, rows, pos))
            elif p.images is not None:
                for r, q in zip(rows.tolist(), pos.tolist()):
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
            # Gather the rows of every chunk, then one take puts them in position order.
            tables = [
                pa.Table.from_batches([rb if len(rows) == rb.num_rows else rb.take(pa.array(rows))])
                for rb, rows, _ in p.parts
            ]
            positions = np.concatenate([pos for _, _, pos in p.parts])
            table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
            order = np.argsort(positions, kind="stable")
            in_place = bool((order == np.arange(len(order))).all())
            out.table = table if in_place else table.take(pa.array(order))
        else:
            out.images = p.images
        return out
