"""A trainer that stops mid-epoch (its step budget met, a Loader closed) ends its stream: the
server counts the call cancelled and logs it at info, never an ERROR with a traceback.

The race this pins down: a write issued after grpc's core ended the call but before the
handler's task was cancelled fails inside grpc (`grpc.aio.InternalError`, "execute_batch"),
which grpc logged as an ERROR with its traceback (seen about once in eight runs of a Loader
closed mid-epoch). Real server on loopback, a real Arrow IPC file, the generated stubs; the
order of the race is made certain by wrapping the server's real write."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

import grpc
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from croupier.protocol.options import StreamOptions
from croupier.server.service.servicer import _IdleWatch
from croupier.v1 import croupier_pb2_grpc


def test_a_write_after_the_client_cancelled_ends_the_stream_counted_cancelled_and_logged_without_an_error(
    serve_inprocess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    table = pa.table({"id": list(range(256)), "text": [f"{i:08d}".ljust(200, "x") for i in range(256)]})
    with ipc.new_file(str(tmp_path / "t.arrow"), table.schema) as w:
        w.write_table(table, max_chunksize=32)
    srv = serve_inprocess(datasets=[f"t={tmp_path / 't.arrow'}"])
    writing, seen = threading.Event(), []
    write = _IdleWatch.write

    async def write_once_cancelled(self, message):
        # The race, in its order: the first chunk's write is issued after grpc's core has
        # ended the call but before the task's cancellation is delivered (here it is taken
        # back, as if it had not arrived yet). grpc's own write then fails.
        if not message.HasField("chunk") or seen:
            return await write(self, message)
        writing.set()
        try:
            await asyncio.sleep(30)  # until the client's cancel is delivered
        except asyncio.CancelledError:
            asyncio.current_task().uncancel()
        try:
            return await write(self, message)
        except BaseException as exc:
            seen.append(type(exc).__name__)
            raise

    monkeypatch.setattr(_IdleWatch, "write", write_once_cancelled)
    metrics = srv.running.service.metrics
    caplog.set_level(logging.INFO)
    with grpc.insecure_channel(srv.address) as ch:
        call = croupier_pb2_grpc.CroupierStub(ch).StreamEpoch(StreamOptions("t", batch_size=8, seed=0).to_proto())
        first = next(call)
        assert first.HasField("header")
        assert writing.wait(10)
        call.cancel()
    deadline = time.monotonic() + 10
    while metrics.active_streams._value.get() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert seen == ["ExecuteBatchError"] and metrics.active_streams._value.get() == 0
    assert metrics.streams_total.labels("CANCELLED")._value.get() == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    said = [r.getMessage() for r in caplog.records if r.name.startswith("croupier")]
    assert any("the client went away while a chunk was being written" in m for m in said), said
    assert any("cancelled by the client" in m for m in said), said
