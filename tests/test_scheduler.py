"""The fetch scheduler's guarantees, driven deterministically by an in-memory reader."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pytest

from croupier.protocol.epoch_plan import EpochPlan
from croupier.server.readers.synthetic import SyntheticReader
from croupier.server.stream.budgets import ReadBudget
from croupier.server.stream.dealer import ChunkTooLargeError, Dealer
from croupier.server.stream.fetch_limits import FetchLimits
from croupier.server.stream.rank_batches import StreamRange


class GatedReader(SyntheticReader):
    """A reader whose reads finish when the test says so; it counts what is in flight."""

    read_does_io = True

    def __init__(self, n: int, delays: dict[int, float] | None = None, default: float = 0.0, row_bytes: int = 64):
        super().__init__("gated", n, row_bytes)
        self.delays = delays or {}
        self.default = default
        self.issued: list[int] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def read(self, index: int, columns=()) -> int:
        self.issued.append(index)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delays.get(index, self.default))
        finally:
            self.in_flight -= 1
        return index


def _rows(chunk) -> list[int]:
    return pa.ipc.open_stream(chunk.payload.arrow_ipc).read_all().column("index").to_pylist()


async def _collect(dealer: Dealer):
    return [c async for c in dealer]


def test_a_slow_read_does_not_hold_back_the_rest_of_its_batch() -> None:
    n = 64
    plan = EpochPlan(n, seed=0, epoch=0, batch_size=16)
    slow = int(plan.rank_batch(0, 0).indices[0])  # position 0 of batch 0
    reader = GatedReader(n, delays={slow: 0.3}, default=0.001)
    chunks = asyncio.run(_collect(Dealer(reader, plan, StreamRange.of(plan, 0), prefetch=3)))
    order = [r.index for c in chunks for r in c.refs]
    assert order[-1] == slow, "the slow read should arrive after every other sample"
    assert sorted(order) == list(range(n))
    for c in chunks:
        assert _rows(c) == [r.index for r in c.refs], "payload rows must follow the tags"
    # Batches 1..3 completed before batch 0, whose first sample was slow.
    completed = [b for c in chunks for b in c.completed_batches]
    assert completed[-1] == 0 and sorted(completed) == [0, 1, 2, 3]


def test_ordered_mode_reads_one_sample_at_a_time_in_plan_order() -> None:
    n = 50
    plan = EpochPlan(n, seed=1, epoch=0, batch_size=8)
    reader = GatedReader(n, default=0.0005)
    chunks = asyncio.run(_collect(Dealer(reader, plan, StreamRange.of(plan, 0), ordered=True)))
    expected = [i for rb in plan.rank_batches(0) for i in rb.indices.tolist()]
    assert [r.index for c in chunks for r in c.refs] == expected
    assert reader.issued == expected
    assert reader.max_in_flight == 1


def test_unordered_mode_keeps_batch_plus_prefetch_in_flight() -> None:
    n = 256
    plan = EpochPlan(n, seed=1, epoch=0, batch_size=16)
    reader = GatedReader(n, default=0.02)
    asyncio.run(_collect(Dealer(reader, plan, StreamRange.of(plan, 0), prefetch=2)))
    assert reader.max_in_flight == 16 * 3


def test_in_flight_reads_are_bounded_per_stream_and_per_server() -> None:
    n = 200
    plan = EpochPlan(n, seed=1, epoch=0, batch_size=50)
    reader = GatedReader(n, default=0.005)
    limits = FetchLimits(max_reads_per_stream=7)
    asyncio.run(_collect(Dealer(reader, plan, StreamRange.of(plan, 0), limits=limits)))
    assert reader.max_in_flight == 7

    async def two_streams_one_budget() -> None:
        budget = ReadBudget(5)
        shared = GatedReader(n, default=0.005)
        d = [Dealer(shared, plan, StreamRange.of(plan, 0), server_reads=budget) for _ in range(2)]
        await asyncio.gather(*(_collect(x) for x in d))
        assert shared.max_in_flight == 5

    asyncio.run(two_streams_one_budget())


def test_a_stalled_consumer_stalls_only_its_own_reads() -> None:
    n = 1000
    plan = EpochPlan(n, seed=2, epoch=0, batch_size=20)

    async def scenario() -> None:
        reader = GatedReader(n, default=0.0)
        dealer = Dealer(reader, plan, StreamRange.of(plan, 0), prefetch=2).__aiter__()
        await dealer.__anext__()  # take one chunk, then stop consuming
        await asyncio.sleep(0.2)
        # The window is the oldest unsent batch plus `prefetch` more: no read beyond it.
        assert len(reader.issued) <= 20 * 3
        other = GatedReader(n, default=0.0)
        chunks = await _collect(Dealer(other, plan, StreamRange.of(plan, 0)))
        assert sum(len(c.refs) for c in chunks) == n
        await dealer.aclose()

    asyncio.run(scenario())


def _reads_issued_by_a_stalled_consumer(reader: GatedReader, plan: EpochPlan) -> int:
    """Reads issued while the consumer takes one chunk and then stalls."""

    async def scenario() -> int:
        limits = FetchLimits(max_buffered_bytes=5_000, chunk_samples=4, max_reads_per_stream=10)
        dealer = Dealer(reader, plan, StreamRange.of(plan, 0), prefetch=20, limits=limits).__aiter__()
        await dealer.__anext__()
        await asyncio.sleep(0.2)
        await dealer.aclose()
        return len(reader.issued)

    return asyncio.run(scenario())


def test_buffered_bytes_bound_pauses_new_batches() -> None:
    n = 400
    plan = EpochPlan(n, seed=3, epoch=0, batch_size=10)

    class BigItems(GatedReader):
        async def read(self, index: int, columns=()) -> bytes:  # type: ignore[override]
            await super().read(index)
            return b"x" * 1000

        def encode(self, items, columns=(), decode_images=False):
            return super().encode(list(range(len(items))))

        def item_sizer(self, columns=()):
            return len  # its items are the bytes themselves, not indices

    # Prefetch alone would allow 21 batches (210 reads); the byte bound stops reading
    # once ~5 KB wait unsent: at most that, plus the reads in flight, plus one chunk.
    assert _reads_issued_by_a_stalled_consumer(BigItems(n), plan) <= 4 + 6 + 10 + 1


def test_buffered_bytes_bound_counts_the_rows_of_table_datasets() -> None:
    # Table readers' items are bare indices: the bound must count their rows' bytes.
    n = 400
    plan = EpochPlan(n, seed=3, epoch=0, batch_size=10)
    assert _reads_issued_by_a_stalled_consumer(GatedReader(n, row_bytes=1000), plan) <= 4 + 6 + 10 + 1


def test_prefetch_is_clamped_to_the_server_maximum() -> None:
    n = 1000
    plan = EpochPlan(n, seed=2, epoch=0, batch_size=20)

    async def scenario() -> None:
        reader = GatedReader(n)
        limits = FetchLimits(max_prefetch=2)
        dealer = Dealer(reader, plan, StreamRange.of(plan, 0), prefetch=2**32 - 1, limits=limits)
        assert dealer.prefetch == 2
        stream = dealer.__aiter__()
        await stream.__anext__()  # take one chunk, then stop consuming
        await asyncio.sleep(0.2)
        assert len(reader.issued) <= 20 * 3
        await stream.aclose()

    asyncio.run(scenario())


def test_chunks_flush_by_bytes_for_table_rows() -> None:
    n = 96
    plan = EpochPlan(n, seed=4, epoch=0, batch_size=32)
    reader = GatedReader(n, row_bytes=10_000)
    limits = FetchLimits(chunk_samples=64, chunk_bytes=32 << 10, flush_delay_s=10.0)
    chunks = asyncio.run(_collect(Dealer(reader, plan, StreamRange.of(plan, 0), limits=limits, prefetch=0)))
    # 4 rows of ~10 KB reach 32 KiB: far fewer samples than the count limit.
    assert max(len(c.refs) for c in chunks) == 4
    assert sum(len(c.refs) for c in chunks) == n


def test_chunks_flush_after_the_delay_while_their_batch_waits() -> None:
    n = 64
    plan = EpochPlan(n, seed=4, epoch=0, batch_size=64)
    fast = plan.rank_batch(0, 0).indices[:3].tolist()
    reader = GatedReader(n, delays={i: 0.0 for i in fast}, default=0.5)
    limits = FetchLimits(chunk_samples=64, chunk_bytes=1 << 30, flush_delay_s=0.01)
    chunks = asyncio.run(_collect(Dealer(reader, plan, StreamRange.of(plan, 0), limits=limits)))
    # Neither count, bytes nor a whole batch: only the delay can have flushed them.
    assert sorted(r.index for r in chunks[0].refs) == sorted(fast)
    assert not chunks[0].completed_batches


def test_a_chunk_over_the_message_limit_is_split() -> None:
    n = 64
    plan = EpochPlan(n, seed=4, epoch=0, batch_size=64)
    reader = GatedReader(n, row_bytes=10_000)
    limits = FetchLimits(chunk_samples=64, chunk_bytes=1 << 30, flush_delay_s=10.0)
    dealer = Dealer(reader, plan, StreamRange.of(plan, 0), limits=limits, max_message_bytes=100_000)
    chunks = asyncio.run(_collect(dealer))
    assert len(chunks) > 1 and all(c.payload.nbytes < 100_000 for c in chunks)
    assert sorted(r.index for c in chunks for r in c.refs) == list(range(n))
    for c in chunks:
        assert _rows(c) == [r.index for r in c.refs]
    assert [c.completed_batches for c in chunks] == [[]] * (len(chunks) - 1) + [[0]]

    one_row = Dealer(reader, plan, StreamRange.of(plan, 0), limits=limits, max_message_bytes=5_000)
    with pytest.raises(ChunkTooLargeError, match="larger than max message size 5000"):
        asyncio.run(_collect(one_row))


def test_chunks_flush_by_count_and_when_a_batch_completes() -> None:
    n = 100
    plan = EpochPlan(n, seed=4, epoch=0, batch_size=30)
    reader = GatedReader(n, default=0.0)
    limits = FetchLimits(chunk_samples=8, flush_delay_s=10.0)
    chunks = asyncio.run(_collect(Dealer(reader, plan, StreamRange.of(plan, 0), limits=limits, prefetch=0)))
    assert all(len(c.refs) <= 8 for c in chunks)
    # With a 10 s flush delay, only count and batch completion can have flushed them.
    assert sum(len(c.refs) for c in chunks) == n


def test_cancelled_stream_returns_every_server_read_slot() -> None:
    n = 500
    plan = EpochPlan(n, seed=5, epoch=0, batch_size=100)

    async def scenario() -> None:
        budget = ReadBudget(64)
        reader = GatedReader(n, default=10.0)  # reads that never finish in time
        dealer = Dealer(reader, plan, StreamRange.of(plan, 0), server_reads=budget).__aiter__()
        task = asyncio.ensure_future(dealer.__anext__())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await dealer.aclose()
        assert budget.available == 64

    asyncio.run(scenario())


def test_the_oldest_batch_completing_flushes_at_once_a_later_one_waits_for_company() -> None:
    # Batch 0 waits on one slow read while batches 1 and 2 complete: the trainer cannot use
    # them before batch 0, so they ride along in the chunk that batch 0's last sample sends.
    n = 12
    plan = EpochPlan(n, seed=2, epoch=0, batch_size=4)
    slow = int(plan.rank_batch(0, 0).indices[1])
    reader = GatedReader(n, delays={slow: 0.2}, default=0.0)
    limits = FetchLimits(chunk_samples=64, flush_delay_s=10.0)
    chunks = asyncio.run(_collect(Dealer(reader, plan, StreamRange.of(plan, 0), limits=limits, prefetch=2)))
    assert len(chunks) == 1, [c.completed_batches for c in chunks]
    assert chunks[0].completed_batches[-1] == 0 and sorted(chunks[0].completed_batches) == [0, 1, 2]
    assert chunks[0].refs[-1].index == slow

    # In order, the oldest batch is always the one completing: every batch goes out at once.
    ordered = asyncio.run(_collect(Dealer(GatedReader(n), plan, StreamRange.of(plan, 0), limits=limits, ordered=True)))
    assert [c.completed_batches for c in ordered] == [[0], [1], [2]]
