"""`chunk_to_proto` (server/service/messages.py), built field by field in place: every
field of a chunk reaches the wire as it was, table and image payloads, with and without
padding, and parses back to the same values."""

from __future__ import annotations

import os

import pytest

from croupier.server.readers.base import ImagePayload, ImageRecord, TablePayload
from croupier.server.service.messages import chunk_to_proto
from croupier.server.stream.sample_chunks import SampleChunk, SampleRef
from croupier.v1 import croupier_pb2 as pb


def _refs(n: int, padded: set[int]) -> list[SampleRef]:
    return [SampleRef(batch=7 + i // 5, position=i % 5, index=1000 - 3 * i, padding=i in padded) for i in range(n)]


def _parsed(chunk: SampleChunk, epoch: int) -> pb.Chunk:
    wire = chunk_to_proto(chunk, epoch).SerializeToString()
    response = pb.StreamEpochResponse.FromString(wire)
    assert response.WhichOneof("kind") == "chunk"
    return response.chunk


@pytest.mark.parametrize("padded", [set(), {0, 4}])
def test_a_table_chunk_reaches_the_wire_as_it_was(padded: set[int]) -> None:
    ipc = os.urandom(300_000)
    refs = _refs(12, padded)
    got = _parsed(SampleChunk(refs, TablePayload(ipc, len(ipc)), completed_batches=[7, 8]), epoch=3)
    assert got.epoch == 3 and got.arrow_ipc == ipc and list(got.completed_batches) == [7, 8]
    assert list(got.batches) == [r.batch for r in refs] and list(got.positions) == [r.position for r in refs]
    assert list(got.indices) == [r.index for r in refs]
    assert list(got.padding) == ([r.padding for r in refs] if padded else [])
    assert len(got.images) == 0


def test_an_image_chunk_reaches_the_wire_as_it_was() -> None:
    records = [ImageRecord(os.urandom(100 + i), label=i % 3, format="jpeg" if i % 2 else "raw", key=f"c/{i}.jpg",
                           height=i, width=2 * i, channels=3 if i % 2 == 0 else 0) for i in range(9)]
    refs = _refs(9, {8})
    got = _parsed(SampleChunk(refs, ImagePayload(records)), epoch=0)
    assert [(im.data, im.label, im.format, im.key, im.height, im.width, im.channels) for im in got.images] == [
        (r.data, r.label, r.format, r.key, r.height, r.width, r.channels) for r in records]
    assert list(got.indices) == [r.index for r in refs] and list(got.padding) == [False] * 8 + [True]
    assert got.arrow_ipc == b"" and list(got.completed_batches) == []


def test_an_empty_chunk_is_still_a_chunk() -> None:
    got = _parsed(SampleChunk([], TablePayload(b"", 0)), epoch=0)
    assert got.epoch == 0 and len(got.indices) == 0 and got.arrow_ipc == b""


def test_an_unknown_payload_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unknown payload type"):
        chunk_to_proto(SampleChunk(_refs(1, set()), payload="rows"), 0)  # type: ignore[arg-type]
