"""The client's batch assembly: whatever the chunking and arrival order, batches come out
in position order, bit for bit; contradictions of the stream header are refused."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from croupier.client import assemble
from croupier.client.assemble import BatchAssembler, ProtocolError
from croupier.server.readers.tables import to_ipc_payload
from croupier.v1 import croupier_pb2 as pb

BATCH, LAST, NUM = 5, 3, 4  # four batches of 5, 5, 5 and 3 samples


def _header(kind: int) -> pb.StreamHeader:
    h = pb.StreamHeader(epoch=2, start_batch=0, end_batch=NUM, num_batches=NUM, batch_size=BATCH, last_batch_size=LAST)
    h.dataset.kind = kind
    return h


def _samples() -> list[tuple[int, int]]:
    return [(b, p) for b in range(NUM) for p in range(LAST if b == NUM - 1 else BATCH)]


def _index(b: int, p: int) -> int:
    return 100 * b + p


def _chunks(order: list[tuple[int, int]], cuts: list[int], table: bool) -> list[pb.Chunk]:
    chunks, left = [], {b: (LAST if b == NUM - 1 else BATCH) for b in range(NUM)}
    bounds = sorted({0, len(order), *[c % (len(order) + 1) for c in cuts]})
    for a, e in zip(bounds, bounds[1:]):
        part = order[a:e]
        done = []
        for b, _ in part:
            left[b] = left.get(b, 1) - 1
            if left[b] == 0:
                done.append(b)
        idx = [_index(b, p) for b, p in part]
        c = pb.Chunk(epoch=2, batches=[b for b, _ in part], positions=[p for _, p in part], indices=idx,
                     padding=[_padded(i) for i in idx], completed_batches=done)
        if table:
            rows = pa.table({"i": pa.array(idx, pa.int64()), "s": pa.array([f"row{i}" for i in idx])})
            c.arrow_ipc = to_ipc_payload(rows).arrow_ipc
        else:
            c.images.extend(pb.Image(data=f"img{i}".encode()) for i in idx)
        chunks.append(c)
    return chunks


def _padded(index: int) -> bool:
    return index % 7 == 0


def _naive_out_of_order(order: list[tuple[int, int]]) -> int:
    high, count = (-1, -1), 0
    for key in order:
        if key < high:
            count += 1
        high = max(high, key)
    return count


@settings(max_examples=80, deadline=None)
@given(st.permutations(_samples()), st.lists(st.integers(0, 18), max_size=8), st.booleans(), st.sampled_from([0, 4, 64]))
def test_batches_come_out_in_position_order_whatever_the_chunking_and_arrival_order(order, cuts, table, small):
    # `small`: chunks of up to this many samples are walked as Python lists, larger ones by
    # NumPy (assemble.SMALL_CHUNK): both ways, and a stream mixing them, give the same.
    kind = pb.DATASET_KIND_TABLE if table else pb.DATASET_KIND_IMAGE
    asm = BatchAssembler(_header(kind))
    saved, assemble.SMALL_CHUNK = assemble.SMALL_CHUNK, small
    try:
        out = [raw for c in _chunks(list(order), cuts, table) for raw in asm.add(c)]
    finally:
        assemble.SMALL_CHUNK = saved
    assert sorted(raw.batch for raw in out) == list(range(NUM))
    for raw in out:
        want = [_index(raw.batch, p) for p in range(len(raw))]
        assert raw.indices.tolist() == want
        assert raw.padding.tolist() == [_padded(i) for i in want]
        if table:
            assert raw.table.column("i").to_pylist() == want
            assert raw.table.column("s").to_pylist() == [f"row{i}" for i in want]
        else:
            assert [im.data for im in raw.images] == [f"img{i}".encode() for i in want]
    assert asm.stats.samples == len(order)
    assert asm.stats.out_of_order == _naive_out_of_order(list(order))
    assert not asm.partial


@pytest.mark.parametrize("small", [0, 64])
def test_a_position_delivered_twice_is_refused(small: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(assemble, "SMALL_CHUNK", small)
    asm = BatchAssembler(_header(pb.DATASET_KIND_TABLE))
    c = _chunks([(1, 0), (0, 1), (1, 0)], [], table=True)[0]
    with pytest.raises(ProtocolError, match="batch 1: position 0 delivered twice"):
        asm.add(c)


@pytest.mark.parametrize("small", [0, 64])
def test_a_position_outside_its_batch_is_refused(small: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(assemble, "SMALL_CHUNK", small)
    asm = BatchAssembler(_header(pb.DATASET_KIND_IMAGE))
    with pytest.raises(ProtocolError, match=r"position 3 outside 0..2 in batch 3"):
        asm.add(_chunks([(0, 1), (3, 3)], [], table=False)[0])


@pytest.mark.parametrize("small", [0, 64])
def test_a_batch_outside_the_stream_is_refused(small: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(assemble, "SMALL_CHUNK", small)
    asm = BatchAssembler(_header(pb.DATASET_KIND_IMAGE))
    with pytest.raises(ProtocolError, match="batch 4 is outside"):
        asm.add(_chunks([(4, 0)], [], table=False)[0])


@pytest.mark.parametrize("small", [0, 64])
def test_a_batch_marked_complete_early_is_refused(small: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(assemble, "SMALL_CHUNK", small)
    asm = BatchAssembler(_header(pb.DATASET_KIND_TABLE))
    c = _chunks([(0, 0), (0, 1)], [], table=True)[0]
    c.completed_batches.append(0)
    with pytest.raises(ProtocolError, match="batch 0 marked complete with 2 of 5 samples"):
        asm.add(c)
