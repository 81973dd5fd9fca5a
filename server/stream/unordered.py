"""The unordered stream: one rank's reads all in flight at once, sent in completion order.

A stage with a fixed contract, as torchdata's nodes have: `start()` begins issuing
reads, `next()` returns the next chunk (StopAsyncIteration at the end), `get_state()`
says where the stream stands, and `aclose()` is its one shutdown path. Its state is in
named fields; the reads it issues and the issuer task are its own, and `aclose()` ends
them all and hands back every slot they held.

Two sides share the fields. The issuer (a task) walks the plan and issues reads while
the window, the in-flight bound and the byte budgets allow; each read's completion (a
callback: no task per sample where the reader can avoid one) appends to `ready`. The
sender (`next()`, in the consumer's task) takes completed samples into a pending chunk,
flushes it when full, urgent or due, and once the consumer has taken every chunk of a
flush, counts them sent and moves the window.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from croupier.server.readers.base import Reader
from croupier.server.readers.latency import TICK_S
from croupier.server.stream.budgets import BufferBudget, ReadBudget
from croupier.server.stream.fetch_limits import FetchLimits
from croupier.server.stream.rank_batches import StreamRange
from croupier.server.stream.read_groups import GroupIssuer, Results, settle
from croupier.server.stream.read_observer import FetchObserver, NoObserver
from croupier.server.stream.sample_chunks import PendingChunk, SampleChunk, SampleRef
from croupier.server.stream.timer_wheel import TimerWheel
from croupier.server.stream.tuner import StreamTuner

#: (refs, items, completed batches, their bytes) -> the chunks that carry them (one, or more when split).
Encode = Callable[[list[SampleRef], list[Any], list[int], int], Awaitable[list[SampleChunk]]]
#: A completed read: (where it goes, the item, its bytes, the error it raised).
Completion = tuple[SampleRef, Any, int, BaseException | None]


@dataclass(frozen=True)
class UnorderedState:
    """Where an unordered stream stands (a snapshot, for tests and logs)."""

    #: The oldest batch not yet wholly handed to the consumer.
    oldest: int
    #: Samples not yet taken into a chunk.
    remaining: int
    #: Reads issued and not yet completed.
    in_flight: int
    #: Bytes of completed samples not yet sent.
    buffered: int
    closed: bool


class UnorderedStream(GroupIssuer):
    """One rank's batches `span` of a plan, read concurrently and sent as they complete.

    Guarantees: every sample of `span` exactly once, in completion order; each batch
    named once in `completed_batches`, on the chunk that carries its last sample; reads
    only for batches up to `prefetch` past the oldest one not yet handed out; at most
    `limits.max_reads_per_stream` in flight (and one `server_reads` slot each); no new
    read while more than `limits.max_buffered_bytes` wait unsent, or, past the server's
    `server_buffer`, while holding a chunk's worth. A read's error is raised by `next()`.
    A chunk counts as handed out when `next()` is called again (the consumer came back
    for more), as an async generator's `yield` does.

    With a `tuner` (server/stream/tuner.py), `limits` and `prefetch` are replaced after
    a flush when it decides, and the counters it reads are added to here.
    """

    def __init__(
        self,
        reader: Reader,
        columns: Sequence[str],
        batches: AsyncIterator[tuple[int, list[int], list[bool]]],
        span: StreamRange,
        num_samples: int,
        *,
        encode: Encode,
        limits: FetchLimits,
        prefetch: int,
        observer: FetchObserver | None = None,
        server_reads: ReadBudget | None = None,
        server_buffer: BufferBudget | None = None,
        tuner: StreamTuner | None = None,
    ):
        """Built on the event loop it runs on. `batches` yields (batch, indices, padding)
        in plan order, `num_samples` in all."""
        self.reader = reader
        self.columns = tuple(columns)
        self.span = span
        self.encode = encode
        self.limits = limits
        self.prefetch = prefetch
        self.observer = observer or NoObserver()
        self.server_reads = server_reads
        self.server_buffer = server_buffer
        self.tuner = tuner
        self._batches = batches
        self._sizer = reader.item_sizer(self.columns)
        self._loop = asyncio.get_running_loop()
        # The window, by batch. Entries are added on issue and dropped when done, so a
        # stream's memory does not grow with the epoch's length.
        self.oldest = span.start_batch
        self.unreceived: dict[int, int] = {}  # batch -> samples not yet in a chunk
        self.unsent: dict[int, int] = {}  # batch -> samples not yet handed to the consumer
        self.remaining = num_samples
        self.in_flight = 0
        self.buffered = 0
        self.closed = False
        # Issuer -> sender: completed reads in completion order, and the sender's wake-up.
        self.ready: collections.deque[Completion] = collections.deque()
        self.got_ready = asyncio.Event()
        #: The window advanced, a read slot freed, or bytes were sent: the issuer may go on.
        self.moved = asyncio.Event()
        self.pending = PendingChunk()
        # The flush being handed out: its chunks not yet returned, the one returned last,
        # and its samples and bytes (counted sent once the consumer has taken them all).
        self._out: collections.deque[SampleChunk] = collections.deque()
        self._handed: SampleChunk | None = None
        self._out_samples = 0
        self._out_bytes = 0
        # What this stream owns and `aclose()` ends.
        self.issuer: asyncio.Task[None] | None = None
        self.reads: set[asyncio.Task[None]] = set()
        self.timers = TimerWheel(self._loop)

    # ---- the contract -------------------------------------------------------------

    def start(self) -> None:
        """Begin issuing reads (once)."""
        if self.issuer is not None:
            raise RuntimeError("this unordered stream has started already")
        self.issuer = self._loop.create_task(self._issue())
        self.issuer.add_done_callback(self._issuer_done)

    async def next(self) -> SampleChunk:
        """The next chunk; StopAsyncIteration once every sample of the span was handed out."""
        if self.issuer is None:
            raise RuntimeError("start() the unordered stream before taking chunks")
        self._acknowledge()
        if not self._out:
            await self._fill()
        chunk = self._handed = self._out.popleft()
        return chunk

    def get_state(self) -> UnorderedState:
        return UnorderedState(self.oldest, self.remaining, self.in_flight, self.buffered, self.closed)

    async def aclose(self) -> None:
        """End the stream: stop issuing, cancel the reads in flight, give back their read
        slots and the bytes it held of the server's buffer. Safe to call twice."""
        if self.closed:
            return
        self.closed = True  # reads that land from now on were given back below
        budget = self.server_buffer
        if budget is not None:
            budget.forget(self.moved)
            budget.release(self.buffered)
        if self.issuer is not None:
            self.issuer.cancel()
        self.timers.cancel_all()
        for task in list(self.reads):
            task.cancel()
        owned = [*self.reads] if self.issuer is None else [self.issuer, *self.reads]
        await asyncio.gather(*owned, return_exceptions=True)
        # Reads that never completed (timers that never fired, tasks cancelled before or
        # during their read) give their slots back here.
        abandoned = self.in_flight
        if abandoned:
            self.observer.reads_abandoned(abandoned)
            if self.server_reads is not None:
                self.server_reads.give(abandoned)

    def __aiter__(self) -> "UnorderedStream":
        return self

    __anext__ = next

    # ---- the sender -----------------------------------------------------------------

    def _acknowledge(self) -> None:
        """The consumer came back: the chunk handed out last was taken."""
        chunk, self._handed = self._handed, None
        if chunk is None:
            return
        unsent = self.unsent
        for ref in chunk.refs:
            unsent[ref.batch] -= 1
        if not self._out:
            self._flushed()

    async def _fill(self) -> None:
        """Wait for completed reads until a chunk is due, and encode it into `_out`."""
        while self.remaining:
            if not self.ready:
                await self._wait_for_reads()
                if not self.ready and not self.pending.refs:
                    continue
            self._take_ready()
            pending = self.pending
            if not pending.refs:
                continue
            # The flush timer may fire up to a tick early (see TimerWheel._fire): count
            # that as due, or the loop spins re-arming it.
            if not pending.full(self.limits) and self.remaining and time.monotonic() + TICK_S < pending.deadline:
                continue
            chunks = await self.encode(pending.refs, pending.items, pending.completed, pending.nbytes)
            self._out_samples = sum(len(c.refs) for c in chunks)
            self._out_bytes = pending.nbytes
            self.pending = PendingChunk()
            self._out.extend(chunks)
            return
        raise StopAsyncIteration

    async def _wait_for_reads(self) -> None:
        """Sleep until a read completes, the pending chunk's flush delay passes, or the
        issuer ends; raise what the issuer raised (the plan or the reader failed)."""
        issuer = self.issuer
        if issuer.done() and not issuer.cancelled() and issuer.exception() is not None:
            issuer.result()
        self.got_ready.clear()
        pending, loop = self.pending, self._loop
        # A timer, not wait_for: no task per wake-up on this hot path.
        flush_timer = (loop.call_at(loop.time() + max(pending.deadline - time.monotonic(), 0), self.got_ready.set)
                       if pending.refs else None)
        tuner = self.tuner
        if tuner is None:
            await self.got_ready.wait()
        else:
            w0 = time.perf_counter()
            await self.got_ready.wait()
            tuner.starved_s += time.perf_counter() - w0
        if flush_timer is not None:
            flush_timer.cancel()

    def _take_ready(self) -> None:
        """Move completed reads into the pending chunk, until it is full."""
        ready, pending, limits, unreceived = self.ready, self.pending, self.limits, self.unreceived
        while ready:
            ref, item, nbytes, err = ready.popleft()
            if err is not None:
                raise err
            self.remaining -= 1
            pending.add(ref, item, nbytes, limits.flush_delay_s)
            unreceived[ref.batch] -= 1
            if unreceived[ref.batch] == 0:
                # Batches enter `unreceived` in order, so its first key is the oldest.
                pending.urgent |= ref.batch == next(iter(unreceived))
                del unreceived[ref.batch]
                pending.completed.append(ref.batch)
            if pending.full(limits):
                break

    def _flushed(self) -> None:
        """Every chunk of a flush was handed out: its bytes leave the buffers, the tuner
        may decide, and the window moves past the batches now wholly sent."""
        sent_bytes = self._out_bytes
        self.buffered -= sent_bytes
        tuner = self.tuner
        if tuner is not None:
            tuner.sent += self._out_samples
            tuner.sent_bytes += sent_bytes
            settings = tuner.maybe_decide()
            if settings is not None:
                self.limits = settings.apply(self.limits)
                self.prefetch = settings.prefetch
        if self.server_buffer is not None:
            self.server_buffer.release(sent_bytes)
        unsent, end = self.unsent, self.span.end_batch
        while self.oldest < end and unsent.get(self.oldest) == 0:
            del unsent[self.oldest]
            self.oldest += 1
        self.moved.set()

    # ---- the issuer -----------------------------------------------------------------

    async def _issue(self) -> None:
        """Issue every read of the span, each once the window and the bounds allow it, in
        groups where the reader reads groups (server/stream/read_groups.py), else one by
        one the cheapest way the reader offers; each lands in `_complete_group`."""
        # Bound once: this loop runs once per group of reads.
        observer, server_reads, tuner = self.observer, self.server_reads, self.tuner
        async for batch, indices, padding in self._batches:
            while batch > self.oldest + self.prefetch:
                if tuner is not None:
                    tuner.bound_hits += 1  # the window holds the issuer: the bound's kin
                self.moved.clear()
                await self.moved.wait()
            self.unreceived[batch] = self.unsent[batch] = len(indices)
            await self._issue_batch(batch, indices, padding, (), self.reads, observer, server_reads, self.server_buffer)

    def _no_room(self) -> bool:
        limits = self.limits
        if self.buffered > limits.max_buffered_bytes or self.in_flight >= limits.max_reads_per_stream:
            return True
        # Past the server-wide total, read on only while holding under a chunk, with at
        # most a chunk's samples in flight: every stream moves, none grows.
        budget = self.server_buffer
        return (budget is not None and budget.used > budget.limit
                and (self.buffered >= limits.chunk_bytes or self.in_flight >= limits.chunk_samples))

    async def _wait_for_room(self) -> None:
        """Until something moves; past the server's buffer total, also until it is back under."""
        self.moved.clear()
        budget = self.server_buffer
        if budget is not None and budget.used > budget.limit:
            budget.wait_for_room(self.moved)
        await self.moved.wait()

    def _fetch_after_wait(self, ref: SampleRef, fetch: Any, t0: float) -> None:
        try:
            item, err = fetch(ref.index), None
        except Exception as exc:  # handed to the sender, which raises it
            item, err = None, exc
        self._complete(ref, item, err, t0)

    def _complete_read(self, ref: SampleRef, t0: float, item: Any, err: BaseException | None) -> None:
        self._complete(ref, item, err, t0)

    async def _read_one(self, ref: SampleRef, t0: float) -> None:
        try:
            item, err = await self.reader.read(ref.index, self.columns), None
        except Exception as exc:  # handed to the sender, which raises it
            item, err = None, exc
        self._complete(ref, item, err, t0)

    def _complete(self, ref: SampleRef, item: Any, err: BaseException | None, t0: float) -> None:
        self._complete_group([ref], t0, [(0, item, err)])

    def _complete_group(self, refs: list[SampleRef], t0: float, results: Results) -> None:
        """Reads of `refs` landed: (position in refs, item, error) each."""
        if self.closed:
            return  # reads that landed after the stream ended: their slots were given back
        total = settle(refs, results, time.perf_counter() - t0, self._sizer, self.observer, self.tuner,
                       self.server_reads, self.ready)
        self.in_flight -= len(results)
        self.buffered += total
        if self.server_buffer is not None:
            self.server_buffer.used += total
        self.got_ready.set()
        self.moved.set()

    def _issuer_done(self, _: asyncio.Task[None]) -> None:
        self.got_ready.set()  # wake the sender: the issuer may have failed
