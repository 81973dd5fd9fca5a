"""The fetch scheduler: one rank's part of an epoch, read concurrently, sent as it completes.

Unordered mode (the point of croupier): the reads of the current batch and of the next
`prefetch` batches are all in flight at once, bounded per stream and per server, and
each completed sample is sent in completion order. A batch therefore costs about the
slowest of its reads, not their sum. Completed samples are grouped into chunks,
flushed when a chunk holds `chunk_samples` samples or `chunk_bytes` bytes, when
`flush_delay_s` has passed since its first sample, or as soon as the oldest batch not
yet whole is whole (the one the trainer waits on; later batches that complete first
ride along with it, in fewer and larger messages).
Bytes are the reader's `item_sizer` (an estimate per row for memory-mapped tables,
whose items are bare indices); an encoded chunk over the message size limit is split.

Ordered mode (the ablation): one read at a time, in plan order.

Backpressure: the window only moves past a batch once all its samples were handed to
the consumer (the gRPC writer, which waits on HTTP/2 flow control), and no new read is
issued while more than `max_buffered_bytes` of completed samples wait to be sent. A
slow trainer therefore slows its own stream, and holds at most about
`max_buffered_bytes` plus `max_reads_per_stream` samples of memory. Over all streams,
a `BufferBudget` caps the total: past it, a stream issues reads only while it holds
less than one chunk (and has at most `chunk_samples` reads in flight), so every
stream still moves and stalled ones cannot grow.
A stalled stream arms no timer and runs no loop: its issuer and sender both wait on
events that only a sent chunk (the client reading) or a finished read sets.

Planning is bounded per step: the planner evaluates at most `block_samples` indices at
a time, and batches of `OFFLOAD_BATCH_SIZE` samples or more are planned in the
executor, so a huge batch never holds the event loop.

Autotuning (server/stream/tuner.py): with a `tuner`, the stream's in-flight bound, prefetch,
chunk size and flush delay are the tuner's, replaced between chunks when it decides; the
hot path only adds to its counters (latency and count per read, times per wake-up and
per chunk).

Here: the `Dealer` (a stream's parts: reader, plan, span, limits; the in-order path
and chunk encoding). The unordered path is server/stream/unordered.py; the shared
budgets server/stream/budgets.py. Nothing here knows about gRPC: the service turns
`SampleChunk`s into messages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from croupier.protocol.epoch_plan import EpochPlan
from croupier.server.access.limits import LimitExceeded
from croupier.server.readers.base import Reader
from croupier.server.stream.budgets import BufferBudget, FairShare, ReadBudget
from croupier.server.stream.fetch_limits import FetchLimits
from croupier.server.stream.rank_batches import StreamRange, plan_batches
from croupier.server.stream.read_observer import FetchObserver, NoObserver
from croupier.server.stream.sample_chunks import PendingChunk, SampleChunk, SampleRef
from croupier.server.stream.tuner import StreamTuner
from croupier.server.stream.unordered import UnorderedStream


class ChunkTooLargeError(Exception):
    """One sample alone encodes to more than a message may carry."""


class BatchSizeLimitError(LimitExceeded):
    """A stream asked for batches larger than the server's max_batch_size."""


#: Room for a chunk's tags (batch, position, index, padding) per sample, and fixed.
_TAG_BYTES = 64
_FRAME_BYTES = 4096


class Dealer:
    """Streams one rank's batches of one epoch from a reader as `SampleChunk`s."""

    def __init__(
        self,
        reader: Reader,
        plan: EpochPlan,
        span: StreamRange,
        *,
        ordered: bool = False,
        prefetch: int | None = None,
        columns: Sequence[str] = (),
        decode_images: bool = False,
        limits: FetchLimits = FetchLimits(),
        server_reads: ReadBudget | None = None,
        server_buffer: BufferBudget | None = None,
        executor: concurrent.futures.Executor | None = None,
        observer: FetchObserver | None = None,
        max_message_bytes: int | None = None,
        fair: FairShare | None = None,
        lane: str = "",
        tuner: StreamTuner | None = None,
    ):
        if plan.batch_size > limits.max_batch_size:
            raise BatchSizeLimitError(
                "max_batch_size", limits.max_batch_size, "--max-batch-size",
                f"batch_size {plan.batch_size} is larger than this server plans",
            )
        self.reader = reader
        self.plan = plan
        self.span = span
        self.ordered = ordered
        # Clamped: the window (and what it may hold) must not grow at a client's word.
        self.prefetch = min(limits.default_prefetch if prefetch is None else prefetch, limits.max_prefetch)
        self.columns = tuple(columns)
        self.max_message_bytes = max_message_bytes
        self._nbytes = reader.item_sizer(self.columns)
        self.decode_images = decode_images
        self.limits = limits
        self.server_reads = server_reads
        self.server_buffer = server_buffer
        self.executor = executor
        #: Encodes take turns by client (`lane`), not by stream.
        self.fair = fair
        self.lane = lane
        self.observer = observer or NoObserver()
        #: server/stream/tuner.py's StreamTuner: sets the in-flight bound, prefetch, chunk size
        #: and flush delay from this stream's counters (None: the limits as given).
        self.tuner = tuner
        if tuner is not None:
            self.limits = tuner.settings.apply(limits)
            self.prefetch = tuner.settings.prefetch

    @property
    def num_samples(self) -> int:
        return self.plan.samples_in(self.span.start_batch, self.span.end_batch)

    async def encode_chunks(self, refs: list[SampleRef], items: list[Any], completed: list[int],
                            nbytes: int) -> list[SampleChunk]:
        """Items of this stream's columns (about `nbytes`, by the reader's sizer) as its
        chunks: the unordered stream and a shared epoch's subscribers use it."""
        return await self._encode_part(refs, items, completed, nbytes)

    async def _encode(self, pending: PendingChunk) -> list[SampleChunk]:
        return await self._encode_part(pending.refs, pending.items, pending.completed, pending.nbytes)

    async def _encode_part(self, refs: list[SampleRef], items: list[Any], completed: list[int],
                           nbytes: int) -> list[SampleChunk]:
        """One chunk, or several when its message would exceed `max_message_bytes`
        (rows larger than the estimate); `completed` rides on the last one."""
        loop = asyncio.get_running_loop()
        if self.reader.encodes_on_loop(self.decode_images, nbytes):  # less work than a hop to the pool and back
            payload = self.reader.encode(items, self.columns, self.decode_images)
        elif self.fair is None:
            payload = await loop.run_in_executor(self.executor, self.reader.encode, items, self.columns, self.decode_images)
        else:
            await self.fair.acquire(self.lane)
            try:
                payload = await loop.run_in_executor(
                    self.executor, self.reader.encode, items, self.columns, self.decode_images
                )
            finally:
                self.fair.release()
        limit = self.max_message_bytes
        if limit is None or payload.nbytes + _TAG_BYTES * len(refs) + _FRAME_BYTES <= limit:
            return [SampleChunk(refs=refs, payload=payload, completed_batches=completed)]
        if len(refs) == 1:
            r = refs[0]
            raise ChunkTooLargeError(
                f"sample {r.index} (batch {r.batch}, position {r.position}) alone encodes to "
                f"{payload.nbytes} bytes, larger than max message size {limit}: raise "
                f"`croupier serve --max-message-mb` (and the client's grpc.max_receive_message_length)"
            )
        half = len(refs) // 2
        share = nbytes * half // len(refs)
        head = await self._encode_part(refs[:half], items[:half], [], share)
        return head + await self._encode_part(refs[half:], items[half:], completed, nbytes - share)

    async def _timed_read(self, index: int) -> Any:
        observer = self.observer
        observer.read_started()
        t0 = time.perf_counter()
        ok = False
        try:
            item = await self.reader.read(index, self.columns)
            ok = True
            return item
        finally:
            observer.read_finished(time.perf_counter() - t0, ok)

    def _batches(self) -> AsyncIterator[tuple[int, list[int], list[bool]]]:
        return plan_batches(self.plan, self.span.rank, self.span.start_batch, self.span.end_batch, self.executor)

    def __aiter__(self) -> AsyncIterator[SampleChunk]:
        # Without I/O to overlap (memory-mapped Arrow, no injected latency) there is
        # nothing to reorder: both modes take the cheaper in-order path.
        return self._unordered() if self.reader.read_does_io and not self.ordered else self._in_order()

    async def _in_order(self) -> AsyncIterator[SampleChunk]:
        """The ablation (and the path for readers without I/O): samples in plan order."""
        io = self.reader.read_does_io
        nbytes = self._nbytes
        pending = PendingChunk()
        async for batch, indices, padding in self._batches():
            last = len(indices) - 1
            for pos, (index, pad) in enumerate(zip(indices, padding)):
                if not io:
                    item = await self.reader.read(index, self.columns)
                elif self.server_reads is not None:
                    await self.server_reads.take()
                    try:
                        item = await self._timed_read(index)
                    finally:
                        self.server_reads.give()
                else:
                    item = await self._timed_read(index)
                pending.add(SampleRef(batch, pos, index, pad), item, nbytes(item), 0.0)
                if pos == last:
                    pending.completed.append(batch)
                    pending.urgent = True  # in order, every batch is the oldest when it completes
                if pending.full(self.limits):
                    for chunk in await self._encode(pending):
                        yield chunk
                    pending = PendingChunk()
        if pending.refs:
            for chunk in await self._encode(pending):
                yield chunk

    async def _unordered(self) -> AsyncIterator[SampleChunk]:
        """The point of croupier: every read of the window in flight, sent as it completes
        (server/stream/unordered.py); closing this generator closes the stream."""
        stream = UnorderedStream(
            self.reader, self.columns, self._batches(), self.span, self.num_samples,
            encode=self.encode_chunks, limits=self.limits, prefetch=self.prefetch, observer=self.observer,
            server_reads=self.server_reads, server_buffer=self.server_buffer, tuner=self.tuner,
        )
        stream.start()
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                yield chunk
