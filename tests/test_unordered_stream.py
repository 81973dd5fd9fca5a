"""The unordered stream's contract, driven by hand: the test decides when each read
finishes, and asserts what was read, what was sent and in which order (never times)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from croupier.server.stream.budgets import BufferBudget, ReadBudget
from croupier.server.stream.fetch_limits import FetchLimits
from croupier.server.stream.rank_batches import StreamRange
from croupier.server.stream.sample_chunks import SampleChunk, SampleRef
from croupier.server.stream.unordered import UnorderedStream

ITEM_BYTES = 10


class HandReader:
    """A reader whose every read waits until the test finishes it."""

    read_does_io = True

    def __init__(self) -> None:
        self.issued: list[int] = []
        self.waiting: dict[int, asyncio.Future[Any]] = {}

    def item_sizer(self, columns: tuple[str, ...]) -> Callable[[Any], int]:
        return lambda item: ITEM_BYTES

    def read_later(self, index: int) -> None:
        return None  # no injected latency: every read is a task

    def start_read(self, index: int, columns: tuple[str, ...], callback: Any) -> bool:
        return False

    async def read(self, index: int, columns: tuple[str, ...] = ()) -> Any:
        self.issued.append(index)
        self.waiting[index] = asyncio.get_running_loop().create_future()
        return await self.waiting[index]

    def finish(self, *indices: int, error: Exception | None = None) -> None:
        for index in indices:
            fut = self.waiting.pop(index)
            if error is None:
                fut.set_result(f"row {index}")
            else:
                fut.set_exception(error)


class CountingObserver:
    def __init__(self) -> None:
        self.started = self.finished = self.abandoned = 0

    def read_started(self, count: int = 1) -> None:
        self.started += count

    def read_finished(self, seconds: float, ok: bool, count: int = 1) -> None:
        self.finished += count

    def reads_abandoned(self, count: int) -> None:
        self.abandoned += count


async def _batches(batches: list[list[int]]) -> AsyncIterator[tuple[int, list[int], list[bool]]]:
    for b, indices in enumerate(batches):
        yield b, indices, [False] * len(indices)


async def _encode(refs: list[SampleRef], items: list[Any], completed: list[int], nbytes: int) -> list[SampleChunk]:
    return [SampleChunk(refs=refs, payload=list(items), completed_batches=completed)]


def _stream(reader: HandReader, batches: list[list[int]], *, prefetch: int = 4, **kw: Any) -> UnorderedStream:
    # A long flush delay: chunks leave only when full or when the oldest batch is whole.
    limits = kw.pop("limits", FetchLimits(chunk_samples=2, flush_delay_s=60.0))
    return UnorderedStream(reader, (), _batches(batches), StreamRange(0, 0, len(batches)),
                           sum(len(b) for b in batches), encode=_encode, limits=limits, prefetch=prefetch, **kw)


async def _settle() -> None:
    """Let the issuer and the reads' tasks run until they wait again."""
    for _ in range(20):
        await asyncio.sleep(0)


def _indices(chunk: SampleChunk) -> list[int]:
    return [r.index for r in chunk.refs]


def test_samples_are_sent_in_the_order_their_reads_complete() -> None:
    async def scenario() -> None:
        reader = HandReader()
        stream = _stream(reader, [[10, 11], [12, 13]])
        stream.start()
        await _settle()
        assert reader.issued == [10, 11, 12, 13] and stream.get_state().in_flight == 4
        reader.finish(13, 12)  # batch 1 first: a full chunk, though not the oldest batch
        await _settle()
        first = await stream.next()
        reader.finish(11, 10)
        await _settle()
        second = await stream.next()
        assert (_indices(first), first.completed_batches) == ([13, 12], [1])
        assert (_indices(second), second.completed_batches) == ([11, 10], [0])
        assert first.payload == ["row 13", "row 12"]
        with pytest.raises(StopAsyncIteration):
            await stream.next()
        state = stream.get_state()
        assert (state.oldest, state.remaining, state.in_flight, state.buffered) == (2, 0, 0, 0)
        await stream.aclose()

    asyncio.run(scenario())


def test_the_oldest_batch_becoming_whole_flushes_a_chunk_that_is_not_full() -> None:
    async def scenario() -> None:
        reader = HandReader()
        stream = _stream(reader, [[10], [11, 12, 13]], limits=FetchLimits(chunk_samples=64, flush_delay_s=60.0))
        stream.start()
        await _settle()
        reader.finish(12, 10)
        await _settle()
        chunk = await stream.next()
        assert (_indices(chunk), chunk.completed_batches) == ([12, 10], [0])
        await stream.aclose()

    asyncio.run(scenario())


def test_reads_in_flight_stay_within_the_per_stream_bound() -> None:
    async def scenario() -> None:
        reader = HandReader()
        stream = _stream(reader, [[10, 11, 12, 13, 14]], limits=FetchLimits(max_reads_per_stream=2, chunk_samples=2,
                                                                               flush_delay_s=60.0))
        stream.start()
        await _settle()
        assert reader.issued == [10, 11]
        reader.finish(11)
        await _settle()
        assert reader.issued == [10, 11, 12] and stream.get_state().in_flight == 2
        await stream.aclose()

    asyncio.run(scenario())


def test_reads_wait_for_a_server_read_slot() -> None:
    async def scenario() -> None:
        reader, slots = HandReader(), ReadBudget(3)
        stream = _stream(reader, [[10, 11, 12, 13, 14]], server_reads=slots)
        stream.start()
        await _settle()
        assert reader.issued == [10, 11, 12] and slots.available == 0
        reader.finish(10)
        await _settle()
        assert reader.issued == [10, 11, 12, 13] and slots.available == 0
        await stream.aclose()
        assert slots.available == 3

    asyncio.run(scenario())


def test_the_window_moves_only_once_the_consumer_comes_back_for_more() -> None:
    async def scenario() -> None:
        reader = HandReader()
        stream = _stream(reader, [[10, 11], [12, 13]], prefetch=0)
        stream.start()
        await _settle()
        assert reader.issued == [10, 11]  # prefetch 0: only the oldest batch
        reader.finish(10, 11)
        await _settle()
        chunk = await stream.next()
        assert _indices(chunk) == [10, 11]
        await _settle()
        assert reader.issued == [10, 11], "a chunk handed out is not yet taken"
        taking = asyncio.ensure_future(stream.next())  # the consumer is back: batch 0 was taken
        await _settle()
        assert reader.issued == [10, 11, 12, 13] and stream.get_state().oldest == 1
        reader.finish(12, 13)
        assert _indices(await taking) == [12, 13]
        await stream.aclose()

    asyncio.run(scenario())


def test_bytes_past_the_stream_bound_stop_new_reads_until_sent() -> None:
    async def scenario() -> None:
        reader = HandReader()
        limits = FetchLimits(max_reads_per_stream=2, max_buffered_bytes=2 * ITEM_BYTES - 1, chunk_samples=2,
                             flush_delay_s=60.0)
        stream = _stream(reader, [[10, 11, 12, 13, 14, 15]], limits=limits)
        stream.start()
        await _settle()
        reader.finish(10, 11)
        await _settle()
        # Two samples (20 bytes) wait unsent, over the 19-byte bound: no new read, none in flight.
        state = stream.get_state()
        assert reader.issued == [10, 11] and (state.in_flight, state.buffered) == (0, 2 * ITEM_BYTES)
        assert _indices(await stream.next()) == [10, 11]
        await _settle()
        assert reader.issued == [10, 11], "handed out, not yet taken: still buffered"
        taking = asyncio.ensure_future(stream.next())
        await _settle()
        assert reader.issued == [10, 11, 12, 13] and stream.get_state().buffered == 0
        taking.cancel()
        await stream.aclose()

    asyncio.run(scenario())


def test_a_failed_read_is_raised_by_next() -> None:
    async def scenario() -> None:
        reader = HandReader()
        stream = _stream(reader, [[10, 11]])
        stream.start()
        await _settle()
        reader.finish(11, error=OSError("disk says no"))
        await _settle()
        with pytest.raises(OSError, match="disk says no"):
            await stream.next()
        await stream.aclose()

    asyncio.run(scenario())


def test_closing_cancels_reads_in_flight_and_gives_back_every_slot_and_byte() -> None:
    async def scenario() -> None:
        reader, slots, buffer = HandReader(), ReadBudget(8), BufferBudget(1 << 20)
        observer = CountingObserver()
        stream = _stream(reader, [[10, 11, 12], [13, 14]], server_reads=slots, server_buffer=buffer,
                         observer=observer)
        stream.start()
        await _settle()
        reader.finish(12)
        await _settle()
        assert (slots.available, buffer.used) == (4, ITEM_BYTES)  # 4 in flight, 1 completed unsent
        await stream.aclose()
        assert (slots.available, buffer.used) == (8, 0)
        assert (observer.started, observer.finished, observer.abandoned) == (5, 1, 4)
        assert stream.get_state().closed and not stream.reads and stream.issuer.done()
        await stream.aclose()  # a second close changes nothing
        assert (slots.available, observer.abandoned) == (8, 4)

    asyncio.run(scenario())


def test_next_before_start_is_refused() -> None:
    async def scenario() -> None:
        stream = _stream(HandReader(), [[10]])
        with pytest.raises(RuntimeError, match="start"):
            await stream.next()

    asyncio.run(scenario())
