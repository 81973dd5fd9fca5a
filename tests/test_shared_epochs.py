"""Shared epochs: K jobs streaming the same rank of the same epoch read each sample once,
and each still gets exactly the stream it gets alone. Real in-process servers on
loopback, real Arrow files; counts and contents, never times.

Streams start together deterministically: the dataset's reads wait on a gate until the
server reports every stream attached to the shared epoch. A slow job is a client that
stops reading (held on an event) until the fast ones have finished.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
import pytest

from croupier.protocol.options import StreamOptions
from croupier.server.readers.base import Reader
from croupier.v1 import croupier_pb2_grpc as pb_grpc

ROWS = 600
ROW_BYTES = 2048


def _write_table(path: Path, rows: int = ROWS, row_bytes: int = ROW_BYTES) -> None:
    rng = np.random.default_rng(0)
    blobs = [rng.bytes(row_bytes) for _ in range(rows)]
    table = pa.table({"id": np.arange(rows, dtype=np.int64), "blob": pa.array(blobs, pa.binary())})
    with pa.ipc.new_file(str(path), table.schema) as w:
        for b in table.to_batches(max_chunksize=50):
            w.write_batch(b)


class GatedReader(Reader):
    """The served reader, counting reads per index; reads wait on `gate` while it is set up."""

    def __init__(self, inner: Reader, read_first: bool = False):
        super().__init__(inner.name, inner.path, inner.executor, inner.store)
        self.inner = inner
        self.read_first = read_first  # read, then wait on the gate: all land in its turn
        self.held = 0  # reads done and waiting on the gate (read_first)
        self.format = inner.format  # type: ignore[misc]
        self.gate: asyncio.Event | None = None
        self.reads: collections.Counter[int] = collections.Counter()

    def __len__(self) -> int:
        return len(self.inner)

    def info(self):
        return self.inner.info()

    async def read(self, index: int, columns: Sequence[str] = ()) -> Any:
        self.reads[index] += 1
        value = await self.inner.read(index, columns) if self.read_first else None
        self.held += self.read_first
        if self.gate is not None:
            await self.gate.wait()
        return value if self.read_first else await self.inner.read(index, columns)

    def item_sizer(self, columns: Sequence[str] = ()):
        return self.inner.item_sizer(columns)

    def encode(self, items, columns=(), decode_images=False):
        return self.inner.encode(items, columns, decode_images)


@dataclass
class Received:
    samples: dict[tuple[int, int], tuple[int, bool, int]] = field(default_factory=dict)
    completed: list[int] = field(default_factory=list)

    def batches(self) -> dict[int, list[tuple[int, bool, int]]]:
        out: dict[int, list] = collections.defaultdict(list)
        for (b, p), v in sorted(self.samples.items()):
            assert p == len(out[b]), f"batch {b} misses position {len(out[b])}"
            out[b].append(v)
        return dict(out)


async def _collect(address: str, opts: StreamOptions, *, hold_after: int = -1, hold: asyncio.Event | None = None,
                   progress: Callable[[int], None] | None = None, channel_options: Sequence = ()) -> Received:
    """One stream, checked as it arrives: each (batch, position) once, each batch marked
    complete once and only once all its samples came, nothing of it after the mark.
    With `hold`, stops reading after `hold_after` completed batches until it is set."""
    got = Received()
    per_batch: collections.Counter[int] = collections.Counter()
    done: set[int] = set()
    async with grpc.aio.insecure_channel(address, options=list(channel_options)) as channel:
        call = pb_grpc.CroupierStub(channel).StreamEpoch(opts.to_proto())
        header = None
        async for msg in call:
            if msg.WhichOneof("kind") == "header":
                header = msg.header
                continue
            chunk = msg.chunk
            ids = pa.ipc.open_stream(chunk.arrow_ipc).read_all().column("id").to_pylist()
            padding = list(chunk.padding) or [False] * len(chunk.indices)  # sent only when some sample pads
            for b, p, i, pad, rid in zip(chunk.batches, chunk.positions, chunk.indices, padding, ids, strict=True):
                assert (b, p) not in got.samples, f"sample (batch {b}, position {p}) came twice"
                assert b not in done, f"a sample of batch {b} came after the batch was marked complete"
                got.samples[(b, p)] = (i, pad, rid)
                per_batch[b] += 1
            for b in chunk.completed_batches:
                assert b not in done, f"batch {b} was marked complete twice"
                done.add(b)
                got.completed.append(b)
            if progress is not None:
                progress(len(got.completed))
            if hold is not None and len(got.completed) >= hold_after:
                await hold.wait()
                hold = None
        assert header is not None
    batches = got.batches()
    for b in got.completed:
        assert per_batch[b] == len(batches[b])
    return got


def _expected_batches(got: Received, opts: StreamOptions, rows: int = ROWS) -> None:
    """Every sample is its own row, and the batches are exactly start..end-1."""
    for (b, _p), (index, _pad, rid) in got.samples.items():
        assert rid == index, f"batch {b}: sample of index {index} carried row {rid}"
    assert sorted(got.completed) == sorted(got.batches())


def _install_gate(server, name: str, read_first: bool = False) -> GatedReader:
    async def install() -> GatedReader:
        catalog = server.running.catalog
        gated = GatedReader(catalog._by_name[name], read_first)
        gated.gate = asyncio.Event()
        catalog._by_name[name] = gated
        return gated

    return server.call(install())


def _open_gate(server, gated: GatedReader) -> None:
    server.loop.call_soon_threadsafe(gated.gate.set)


def _shared_stats(server):
    return server.running.service.shared.stats


async def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _storage_reads(server) -> float:
    return server.running.service.metrics.registry.get_sample_value("croupier_storage_reads_total", {"scheme": "file"})


@pytest.fixture
def table(tmp_path: Path) -> Path:
    path = tmp_path / "rows.arrow"
    _write_table(path)
    return path


def _alone(serve_inprocess, table: Path, requests: Sequence[StreamOptions]) -> list[Received]:
    """Each request streamed by itself, on a server with sharing off: the reference."""
    server = serve_inprocess(datasets=[f"rows={table}"], shared_epochs=False)

    async def run() -> list[Received]:
        return [await _collect(server.address, r) for r in requests]

    return asyncio.run(run())


def _run_together(server, gated: GatedReader, requests: Sequence[StreamOptions], **kwargs) -> list[Received]:
    async def run() -> list[Received]:
        tasks = [asyncio.create_task(_collect(server.address, r, **kwargs)) for r in requests]
        await _wait_for(lambda: _shared_stats(server).subscribers == len(requests), "every stream to attach")
        _open_gate(server, gated)
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    return asyncio.run(run())


def test_identical_jobs_read_once_and_get_their_own_streams(serve_inprocess, table: Path) -> None:
    opts = StreamOptions(dataset="rows", batch_size=8, seed=7, epoch=1, world_size=2, rank=1)
    [alone] = _alone(serve_inprocess, table, [opts])
    server = serve_inprocess(datasets=[f"rows={table}"])
    gated = _install_gate(server, "rows")
    before = _storage_reads(server)
    got = _run_together(server, gated, [opts, opts, opts])
    shared_reads = _storage_reads(server) - before
    for g in got:
        _expected_batches(g, opts)
        assert g.batches() == alone.batches()
        assert sorted(g.completed) == sorted(alone.completed) == list(range(len(alone.batches())))
    # Each sample of the rank read once for the three jobs, at the reader and at the store.
    assert sorted(gated.reads) == sorted({i for i, _pad, _r in alone.samples.values()})
    assert set(gated.reads.values()) == {1}
    samples = len(alone.samples)
    assert samples <= shared_reads <= 1.2 * samples, (shared_reads, samples)
    stats = _shared_stats(server)
    assert stats.max_subscribers == 3 and stats.joins["started"] == 1 and stats.joins["joined"] == 2
    assert stats.detaches == 0 and stats.reads == samples and stats.delivered == 3 * samples
    assert stats.window_bytes == 0 and stats.epochs == 0 and stats.subscribers == 0


def test_sharing_off_reads_k_times(serve_inprocess, table: Path) -> None:
    opts = StreamOptions(dataset="rows", batch_size=8, seed=7, epoch=1, world_size=2, rank=0)
    server = serve_inprocess(datasets=[f"rows={table}"], shared_epochs=False)
    gated = _install_gate(server, "rows")
    gated.gate.set()  # nothing to wait for: the streams do not share

    async def run() -> list[Received]:
        return await asyncio.gather(*(_collect(server.address, opts) for _ in range(3)))

    before = _storage_reads(server)
    got = asyncio.run(run())
    reads = _storage_reads(server) - before
    samples = len(got[0].samples)
    assert all(g.batches() == got[0].batches() for g in got)
    assert set(gated.reads.values()) == {3} and len(gated.reads) == samples
    assert reads >= 3 * samples
    assert server.running.service.shared is None


def test_slow_job_detaches_and_never_stalls_the_fast_ones(serve_inprocess, table: Path) -> None:
    # world 1: 75 batches of 8 rows of 2 KiB (16 KiB) per stream; prefetch 2 (a horizon of
    # ~48 KiB) under a window of 512 KiB (32 batches): the two fast jobs, in one event loop
    # here, keep within it even on a loaded machine (128 KiB was not: one fell 7 batches
    # behind in CI), and the slow one, held at its third batch, leaves it about halfway.
    opts = StreamOptions(dataset="rows", batch_size=8, seed=3, prefetch=2)
    [alone] = _alone(serve_inprocess, table, [opts])
    server = serve_inprocess(datasets=[f"rows={table}"], shared_window_bytes=512 << 10)
    gated = _install_gate(server, "rows")
    slow_hold = asyncio.Event
    done_fast: list[Received] = []

    async def run() -> Received:
        hold = slow_hold()
        # The slow client stops reading after 2 batches; without BDP probing its
        # flow-control window stays at 64 KiB, so its server-side stream stalls.
        slow = asyncio.create_task(_collect(server.address, opts, hold_after=2, hold=hold,
                                            channel_options=[("grpc.http2.bdp_probe", 0)]))
        fast = [asyncio.create_task(_collect(server.address, opts)) for _ in range(2)]
        await _wait_for(lambda: _shared_stats(server).subscribers == 3, "every stream to attach")
        _open_gate(server, gated)
        # The fast jobs finish while the slow one is still held: it never stalls them.
        done_fast.extend(await asyncio.wait_for(asyncio.gather(*fast), 60))
        assert not slow.done()
        hold.set()
        return await asyncio.wait_for(slow, 60)

    slow_got = asyncio.run(run())
    for g in [*done_fast, slow_got]:
        _expected_batches(g, opts)
        assert g.batches() == alone.batches()
        assert sorted(g.completed) == list(range(len(alone.batches())))
    stats = _shared_stats(server)
    assert stats.detaches >= 1
    # The slow job's own reads are at most the rest of its stream; the fast ones shared theirs.
    samples = len(alone.samples)
    assert sum(gated.reads.values()) < 2 * samples
    assert stats.window_bytes == 0 and stats.epochs == 0


def test_late_job_gets_its_stream_from_its_own_reads(serve_inprocess, table: Path) -> None:
    opts = StreamOptions(dataset="rows", batch_size=8, seed=5, world_size=2, rank=0, prefetch=2)
    [alone] = _alone(serve_inprocess, table, [opts])
    half = len(alone.batches()) // 2
    server = serve_inprocess(datasets=[f"rows={table}"])
    gated = _install_gate(server, "rows")
    progress = [0, 0]

    async def run() -> list[Received]:
        hold = asyncio.Event()
        first = [
            asyncio.create_task(_collect(server.address, opts, hold_after=half, hold=hold,
                                         progress=lambda n, k=k: progress.__setitem__(k, n)))
            for k in range(2)
        ]
        await _wait_for(lambda: _shared_stats(server).subscribers == 2, "both streams to attach")
        _open_gate(server, gated)
        await _wait_for(lambda: min(progress) >= half, "the first jobs to consume half the epoch")
        late = await asyncio.wait_for(_collect(server.address, opts), 60)
        hold.set()
        return [late, *await asyncio.wait_for(asyncio.gather(*first), 60)]

    got = asyncio.run(run())
    for g in got:
        _expected_batches(g, opts)
        assert g.batches() == alone.batches()
        assert sorted(g.completed) == list(range(len(alone.batches())))
    stats = _shared_stats(server)
    assert stats.joins["late"] == 1 and stats.joins["joined"] == 1
    # The first two shared one read per sample; the late one read its whole stream alone.
    assert set(gated.reads.values()) == {2} and len(gated.reads) == len(alone.samples)


def test_resume_within_a_shared_epoch(serve_inprocess, table: Path) -> None:
    whole = StreamOptions(dataset="rows", batch_size=8, seed=9, world_size=2, rank=1, prefetch=16)
    resumed = whole.with_(start_batch=5, end_batch=20, prefetch=3)
    ahead = whole.with_(start_batch=30)
    alone = _alone(serve_inprocess, table, [whole, resumed, ahead])
    # Reads in flight pinned (256): the cursor must issue past batch 5 while the gate
    # holds every read, before any completion could teach a tuner to grow.
    server = serve_inprocess(datasets=[f"rows={table}"], autotune_pinned=("max_reads_per_stream",))
    gated = _install_gate(server, "rows")

    def cursor() -> int:
        epochs = list(server.running.service.shared.open.values())
        return epochs[0].cursor if epochs else -1

    async def run() -> list[Received]:
        first = asyncio.create_task(_collect(server.address, whole))
        # The whole epoch's stream has read (issued) past batch 5 but not to 30 (prefetch 16).
        await _wait_for(lambda: cursor() > 5, "the shared cursor to pass batch 5")
        assert cursor() <= 17
        tasks = [first, asyncio.create_task(_collect(server.address, resumed)),
                 asyncio.create_task(_collect(server.address, ahead))]
        await _wait_for(lambda: sum(_shared_stats(server).joins.values()) == 3, "the resumed streams to arrive")
        _open_gate(server, gated)
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    got = asyncio.run(run())
    for g, ref, opts in zip(got, alone, [whole, resumed, ahead]):
        _expected_batches(g, opts)
        assert g.batches() == ref.batches()
        assert sorted(g.completed) == sorted(ref.completed)
    assert sorted(got[1].completed) == list(range(5, 20))
    stats = _shared_stats(server)
    assert stats.joins == {"started": 1, "joined": 1, "ahead": 1}
    # Batches 5..19 were read once for both streams; batches from 30 once more by the one ahead.
    for (b, _p), (index, _pad, _r) in got[0].samples.items():
        assert gated.reads[index] == (2 if b >= 30 else 1), (b, index)


def test_batches_completed_together_go_in_one_message_not_one_each(serve_inprocess, table: Path) -> None:
    """A batch that completes is sent at once (urgent), and what has arrived of the batches
    after it goes in the same message, up to the chunk's size: a message costs the server's
    loop about 100 us in grpc whatever its size. Here every read of the first window waits on
    a gate, so when it opens four batches of 16 complete in one turn of the loop: one message
    of 64 samples, where each batch used to go alone."""
    from croupier.server.stream.fetch_limits import FetchLimits

    server = serve_inprocess(datasets=[f"rows={table}"], autotune=False,
                             limits=FetchLimits(chunk_samples=64, default_prefetch=4, flush_delay_s=5.0,
                                                max_reads_per_stream=64))
    gated = _install_gate(server, "rows", read_first=True)  # after the gate, each read lands in the same turn
    opts = StreamOptions(dataset="rows", batch_size=16, seed=3, epoch=0, prefetch=3)

    async def run() -> list[tuple[int, list[int]]]:
        messages: list[tuple[int, list[int]]] = []
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = pb_grpc.CroupierStub(channel).StreamEpoch(opts.to_proto())
            async for msg in call:
                if msg.WhichOneof("kind") == "chunk":
                    messages.append((len(msg.chunk.indices), list(msg.chunk.completed_batches)))
                    if sum(n for n, _ in messages) >= 64:
                        call.cancel()
                        break
                elif not gated.gate.is_set():
                    await _wait_for(lambda: gated.held >= 64, "the first window's reads")
                    _open_gate(server, gated)
        return messages

    messages = asyncio.run(run())
    assert messages[0] == (64, [0, 1, 2, 3]), messages
