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
a time, and batches of `_OFFLOAD_BATCH_SIZE` samples or more are planned in the
executor, so a huge batch never holds the event loop.

Autotuning (server/stream/tuner.py): with a `tuner`, the stream's in-flight bound, prefetch,
chunk size and flush delay are the tuner's, replaced between chunks when it decides; the
hot path only adds to its counters (latency and count per read, times per wake-up and
per chunk).

Nothing here knows about gRPC: the service turns `Chunk`s into messages.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import heapq
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from croupier.server.stream.fairshare import FairShare
from croupier.server.access.limits import LimitExceeded
from croupier.protocol.epoch_plan import BatchRangeError, EpochPlan
from croupier.server.readers.base import Payload, Reader
from croupier.server.readers.latency import TICK_S, on_tick


@dataclass(frozen=True)
class FetchLimits:
    """Concurrency and buffering knobs of one stream (server-wide ones live in the service).

    `default_prefetch` is how far ahead reads may go (batches past the oldest one not
    yet sent); `max_reads_per_stream` is how many are in flight at once. A read-ahead
    horizon wider than the in-flight bound keeps the bound busy while a batch waits
    for its slowest read, instead of letting the pipeline drain behind the straggler.
    """

    max_reads_per_stream: int = 256
    max_buffered_bytes: int = 64 << 20
    chunk_samples: int = 64
    #: 1 MiB: well under grpc's default 4 MiB receive limit of clients built from stubs.
    chunk_bytes: int = 1 << 20
    flush_delay_s: float = 0.005
    default_prefetch: int = 16
    #: Largest prefetch a stream gets: larger requests (and defaults) are clamped to it.
    max_prefetch: int = 256
    #: Largest batch_size a stream may ask for (a batch is planned and tracked whole).
    max_batch_size: int = 1 << 18

    def __post_init__(self) -> None:
        for name in ("max_reads_per_stream", "max_buffered_bytes", "chunk_samples", "chunk_bytes", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.flush_delay_s < 0 or self.default_prefetch < 0 or self.max_prefetch < 0:
            raise ValueError("flush_delay_s, default_prefetch and max_prefetch must not be negative")


class SampleRef(NamedTuple):
    """Where a sample goes: (batch, position in batch) of this rank, and its global index."""

    batch: int
    position: int
    index: int
    padding: bool = False


@dataclass
class Chunk:
    refs: list[SampleRef]
    payload: Payload
    # Batches whose every sample has been sent once this chunk is.
    completed_batches: list[int] = field(default_factory=list)


class FetchObserver(Protocol):
    """Hooks for metrics; every method must be cheap and never raise."""

    def read_started(self) -> None: ...

    def read_finished(self, seconds: float, ok: bool) -> None: ...

    def reads_abandoned(self, count: int) -> None:
        """`count` started reads will never finish (their stream ended first)."""


class _NoObserver:
    def read_started(self) -> None:
        pass

    def read_finished(self, seconds: float, ok: bool) -> None:
        pass

    def reads_abandoned(self, count: int) -> None:
        pass


@dataclass(frozen=True)
class StreamRange:
    """Which of one rank's batches a stream covers."""

    rank: int
    start_batch: int
    end_batch: int

    @classmethod
    def of(cls, plan: EpochPlan, rank: int, start_batch: int = 0, end_batch: int = 0) -> "StreamRange":
        plan.check_rank(rank)
        end = plan.num_batches if end_batch == 0 else end_batch
        if not 0 <= start_batch <= plan.num_batches:
            raise BatchRangeError(
                f"start_batch {start_batch} is outside 0..{plan.num_batches} (batches in this epoch)"
            )
        if not start_batch <= end <= plan.num_batches:
            raise BatchRangeError(f"end_batch {end_batch} is outside {start_batch}..{plan.num_batches}")
        return cls(rank, start_batch, end)


class ReadBudget:
    """Reads in flight over all streams of a server: a counter with FIFO waiters.

    asyncio.Semaphore would do, but its `acquire` costs several times more on a path
    taken once per sample read.
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"a read budget needs at least 1 slot, got {limit}")
        self.limit = limit
        self.available = limit
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def try_take(self) -> bool:
        """Take a slot if one is free now, without awaiting (the hot path's common case)."""
        if self.available > 0 and not self._waiters:
            self.available -= 1
            return True
        return False

    async def take(self) -> None:
        if self.try_take():
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # give() handed this waiter its slot
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.give()  # the slot arrived as we were cancelled: pass it on
            raise

    def give(self, count: int = 1) -> None:
        for _ in range(count):
            while self._waiters:
                fut = self._waiters.popleft()
                if not fut.done():
                    fut.set_result(None)
                    break
            else:
                self.available += 1


class BufferBudget:
    """Completed-but-unsent bytes over all streams of a server, against one limit.

    Streams add what their reads complete and release what they send; a stream that
    waits for room registers its wake-up event, set once the total is back under.
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"a buffer budget needs at least 1 byte, got {limit}")
        self.limit = limit
        self.used = 0
        self._waiters: set[asyncio.Event] = set()

    def release(self, nbytes: int) -> None:
        self.used -= nbytes
        if self._waiters and self.used <= self.limit:
            waiters, self._waiters = self._waiters, set()
            for event in waiters:
                event.set()

    def wait_for_room(self, event: asyncio.Event) -> None:
        self._waiters.add(event)

    def forget(self, event: asyncio.Event) -> None:
        self._waiters.discard(event)


#: Batches this large are planned in the executor (with their index lists), off the loop.
_OFFLOAD_BATCH_SIZE = 4096


def _to_list(a: Any) -> list:
    """ndarray.tolist() in slices, so a worker thread lets go of the GIL between them."""
    step = 1 << 16
    return a.tolist() if len(a) <= step else [v for i in range(0, len(a), step) for v in a[i : i + step].tolist()]


class _TimerWheel:
    """Many delayed callbacks on one loop timer: a heap instead of a timer per sample."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.heap: list[tuple[float, int, Any, tuple]] = []
        self.handle: asyncio.TimerHandle | None = None
        self.armed_for = float("inf")
        self.seq = 0

    def __len__(self) -> int:
        return len(self.heap)

    def call_later(self, delay: float, fn: Any, *args: Any) -> None:
        when = on_tick(self.loop.time() + delay)  # reads due together share a wake-up
        self.seq += 1
        heapq.heappush(self.heap, (when, self.seq, fn, args))
        if when < self.armed_for:
            self._arm(when)

    def _arm(self, when: float) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.armed_for = when
        self.handle = self.loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self.handle, self.armed_for = None, float("inf")
        # uvloop runs timers on libuv's millisecond clock and may call this up to a
        # millisecond before loop.time() reaches `when`: taking only what is due by
        # loop.time() re-armed the same deadline and spun the loop until it passed
        # (48,000 wake-ups for 19,200 reads at 20 ms; a third of the server's CPU).
        now = self.loop.time() + TICK_S
        heap = self.heap
        while heap and heap[0][0] <= now:
            _, _, fn, args = heapq.heappop(heap)
            fn(*args)
        if heap:
            self._arm(heap[0][0])

    def cancel_all(self) -> int:
        n = len(self.heap)
        self.heap.clear()
        if self.handle is not None:
            self.handle.cancel()
            self.handle, self.armed_for = None, float("inf")
        return n


class ChunkTooLargeError(Exception):
    """One sample alone encodes to more than a message may carry."""


class BatchSizeLimitError(LimitExceeded):
    """A stream asked for batches larger than the server's max_batch_size."""


#: Room for a chunk's tags (batch, position, index, padding) per sample, and fixed.
_TAG_BYTES = 64
_FRAME_BYTES = 4096


class _Pending:
    """Completed samples waiting to be flushed as one chunk."""

    def __init__(self) -> None:
        self.refs: list[SampleRef] = []
        self.items: list[Any] = []
        self.nbytes = 0
        self.completed: list[int] = []
        #: The oldest batch not yet whole became whole: the trainer waits on it, send now.
        self.urgent = False
        self.deadline = 0.0

    def add(self, ref: SampleRef, item: Any, nbytes: int, flush_delay_s: float) -> None:
        if not self.refs:
            self.deadline = time.monotonic() + flush_delay_s
        self.refs.append(ref)
        self.items.append(item)
        self.nbytes += nbytes

    def full(self, limits: FetchLimits) -> bool:
        return len(self.refs) >= limits.chunk_samples or self.nbytes >= limits.chunk_bytes or self.urgent


async def plan_batches(plan: EpochPlan, rank: int, start: int, end: int,
                       executor: concurrent.futures.Executor | None) -> AsyncIterator[tuple[int, list[int], list[bool]]]:
    """(batch, indices, padding) of `rank`'s batches start..end, as plain lists.

    Small batches are planned inline (a planner block is at most 64 Ki indices); large
    ones in the executor, one batch per hop, so the loop never waits on them.
    """
    batches = plan.rank_batches(rank, start, end)
    if plan.batch_size < _OFFLOAD_BATCH_SIZE:
        for rb in batches:
            yield rb.batch, rb.indices.tolist(), rb.padding.tolist()
        return
    loop = asyncio.get_running_loop()

    def plan_next() -> tuple[int, list[int], list[bool]] | None:
        rb = next(batches, None)
        return None if rb is None else (rb.batch, _to_list(rb.indices), _to_list(rb.padding))

    while (item := await loop.run_in_executor(executor, plan_next)) is not None:
        yield item


class Dealer:
    """Streams one rank's batches of one epoch from a reader as `Chunk`s."""

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
        tuner: Any = None,
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
        self.observer = observer or _NoObserver()
        #: server/stream/tuner.py's StreamTuner: sets the in-flight bound, prefetch, chunk size
        #: and flush delay from this stream's counters (None: the limits as given).
        self.tuner = tuner
        if tuner is not None:
            self.limits = tuner.settings.apply(limits)
            self.prefetch = tuner.settings.prefetch

    @property
    def num_samples(self) -> int:
        return self.plan.samples_in(self.span.start_batch, self.span.end_batch)

    async def encode_chunks(self, refs: list[SampleRef], items: list[Any], completed: list[int]) -> list[Chunk]:
        """Items of this stream's columns as its chunks (a shared epoch's subscriber uses it)."""
        return await self._encode_part(refs, items, completed)

    async def _encode(self, pending: _Pending) -> list[Chunk]:
        return await self._encode_part(pending.refs, pending.items, pending.completed)

    async def _encode_part(self, refs: list[SampleRef], items: list[Any], completed: list[int]) -> list[Chunk]:
        """One chunk, or several when its message would exceed `max_message_bytes`
        (rows larger than the estimate); `completed` rides on the last one."""
        loop = asyncio.get_running_loop()
        if self.fair is None:
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
            return [Chunk(refs=refs, payload=payload, completed_batches=completed)]
        if len(refs) == 1:
            r = refs[0]
            raise ChunkTooLargeError(
                f"sample {r.index} (batch {r.batch}, position {r.position}) alone encodes to "
                f"{payload.nbytes} bytes, larger than max message size {limit}: raise "
                f"`croupier serve --max-message-mb` (and the client's grpc.max_receive_message_length)"
            )
        half = len(refs) // 2
        head = await self._encode_part(refs[:half], items[:half], [])
        return head + await self._encode_part(refs[half:], items[half:], completed)

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

    def __aiter__(self) -> AsyncIterator[Chunk]:
        # Without I/O to overlap (memory-mapped Arrow, no injected latency) there is
        # nothing to reorder: both modes take the cheaper in-order path.
        return self._unordered() if self.reader.read_does_io and not self.ordered else self._in_order()

    async def _in_order(self) -> AsyncIterator[Chunk]:
        """The ablation (and the path for readers without I/O): samples in plan order."""
        io = self.reader.read_does_io
        nbytes = self._nbytes
        pending = _Pending()
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
                    pending = _Pending()
        if pending.refs:
            for chunk in await self._encode(pending):
                yield chunk

    async def _unordered(self) -> AsyncIterator[Chunk]:
        limits = self.limits  # rebound when the tuner changes a setting (closures see it)
        tuner = self.tuner
        perf = time.perf_counter
        loop = asyncio.get_running_loop()
        observer = self.observer
        reader = self.reader
        server_reads = self.server_reads
        budget = self.server_buffer
        sizer = self._nbytes
        columns = self.columns
        # Completed reads, in completion order: (ref, item, nbytes, error).
        ready: collections.deque[tuple[SampleRef, Any, int, BaseException | None]] = collections.deque()
        got_ready = asyncio.Event()
        # Per batch in the window only (entries are added on issue, dropped when done),
        # so a stream's memory does not grow with the epoch's length.
        unreceived: dict[int, int] = {}  # batch -> samples not yet in a chunk
        unsent: dict[int, int] = {}  # batch -> samples not yet handed to the consumer
        moved = asyncio.Event()  # the window advanced, a read slot freed, or bytes were sent
        state = {"oldest": self.span.start_batch, "buffered": 0, "in_flight": 0, "closed": 0}
        reads: set[asyncio.Task[None]] = set()
        timers = _TimerWheel(loop)

        def complete(ref: SampleRef, item: Any, err: BaseException | None, t0: float) -> None:
            if state["closed"]:
                return  # a callback read that landed after the stream ended: its slot was given back
            seconds = perf() - t0
            observer.read_finished(seconds, err is None)
            if tuner is not None:
                tuner.lat_sum += seconds
                tuner.done += 1
            state["in_flight"] -= 1
            if server_reads is not None:
                server_reads.give()
            nbytes = sizer(item) if err is None else 0
            state["buffered"] += nbytes
            if budget is not None:
                budget.used += nbytes
            ready.append((ref, item, nbytes, err))
            got_ready.set()
            moved.set()

        def fetch_after_wait(ref: SampleRef, fetch: Any, t0: float) -> None:
            try:
                item, err = fetch(ref.index), None
            except Exception as exc:  # handed to the sender, which raises it
                item, err = None, exc
            complete(ref, item, err, t0)

        def complete_read(ref: SampleRef, t0: float, item: Any, err: BaseException | None) -> None:
            complete(ref, item, err, t0)

        start_read = reader.start_read

        async def read_one(ref: SampleRef, t0: float) -> None:
            try:
                item, err = await reader.read(ref.index, columns), None
            except Exception as exc:  # handed to the sender, which raises it
                item, err = None, exc
            complete(ref, item, err, t0)

        def no_room() -> bool:
            if state["buffered"] > limits.max_buffered_bytes or state["in_flight"] >= limits.max_reads_per_stream:
                return True
            # Past the server-wide total, read on only while holding under a chunk, with
            # at most a chunk's samples in flight: every stream moves, none grows.
            return (budget is not None and budget.used > budget.limit
                    and (state["buffered"] >= limits.chunk_bytes or state["in_flight"] >= limits.chunk_samples))

        async def issue() -> None:
            async for batch, indices, padding in self._batches():
                while batch > state["oldest"] + self.prefetch:
                    if tuner is not None:
                        tuner.bound_hits += 1  # the window holds the issuer: the bound's kin
                    moved.clear()
                    await moved.wait()
                unreceived[batch] = unsent[batch] = len(indices)
                for pos, (index, pad) in enumerate(zip(indices, padding)):
                    ref = SampleRef(batch, pos, index, pad)
                    while no_room():
                        if tuner is not None and state["in_flight"] >= limits.max_reads_per_stream:
                            tuner.bound_hits += 1
                        moved.clear()
                        if budget is not None and budget.used > budget.limit:
                            budget.wait_for_room(moved)
                        await moved.wait()
                    if server_reads is not None and not server_reads.try_take():
                        await server_reads.take()
                    state["in_flight"] += 1
                    observer.read_started()
                    t0 = time.perf_counter()
                    later = reader.read_later(index)
                    if later is not None:
                        # A wait then a cheap fetch (injected latency over memory-mapped
                        # data): a timer callback, no task, no coroutine per sample.
                        delay, fetch = later
                        timers.call_later(delay, fetch_after_wait, ref, fetch, t0)
                    elif start_read(index, columns, functools.partial(complete_read, ref, t0)):
                        pass  # a warm table row: the read's own future calls back, no task
                    else:
                        task = loop.create_task(read_one(ref, t0))
                        reads.add(task)
                        task.add_done_callback(reads.discard)

        issuer = asyncio.create_task(issue())
        issuer.add_done_callback(lambda _: got_ready.set())  # wake the sender on an issuer error
        try:
            remaining = self.num_samples
            pending = _Pending()
            while remaining:
                if not ready:
                    if issuer.done() and not issuer.cancelled() and issuer.exception() is not None:
                        issuer.result()  # the plan or the reader failed while issuing
                    got_ready.clear()
                    # A timer, not wait_for: no task per wake-up on this hot path.
                    flush_timer = (
                        loop.call_at(loop.time() + max(pending.deadline - time.monotonic(), 0), got_ready.set)
                        if pending.refs
                        else None
                    )
                    if tuner is None:
                        await got_ready.wait()
                    else:
                        w0 = perf()
                        await got_ready.wait()
                        tuner.starved_s += perf() - w0
                    if flush_timer is not None:
                        flush_timer.cancel()
                    if not ready and not pending.refs:
                        continue
                while ready:
                    ref, item, nbytes, err = ready.popleft()
                    if err is not None:
                        raise err
                    remaining -= 1
                    pending.add(ref, item, nbytes, limits.flush_delay_s)
                    unreceived[ref.batch] -= 1
                    if unreceived[ref.batch] == 0:
                        # Batches enter `unreceived` in order, so its first key is the oldest.
                        pending.urgent |= ref.batch == next(iter(unreceived))
                        del unreceived[ref.batch]
                        pending.completed.append(ref.batch)
                    if pending.full(limits):
                        break
                if not pending.refs:
                    continue
                # The flush timer may fire up to a tick early (see _TimerWheel._fire): count
                # that as due, or the loop spins re-arming it.
                if not pending.full(limits) and remaining and time.monotonic() + TICK_S < pending.deadline:
                    continue
                chunks = await self._encode(pending)
                sent_bytes = pending.nbytes
                pending = _Pending()
                for chunk in chunks:
                    yield chunk
                    for ref in chunk.refs:
                        unsent[ref.batch] -= 1
                state["buffered"] -= sent_bytes
                if tuner is not None:
                    tuner.sent += sum(len(c.refs) for c in chunks)
                    tuner.sent_bytes += sent_bytes
                    settings = tuner.maybe_decide()
                    if settings is not None:
                        limits = settings.apply(limits)
                        self.prefetch = settings.prefetch
                if budget is not None:
                    budget.release(sent_bytes)
                while state["oldest"] < self.span.end_batch and unsent.get(state["oldest"]) == 0:
                    del unsent[state["oldest"]]
                    state["oldest"] += 1
                moved.set()
        finally:
            state["closed"] = 1
            if budget is not None:
                budget.forget(moved)
                budget.release(state["buffered"])
            issuer.cancel()
            timers.cancel_all()
            for task in list(reads):
                task.cancel()
            await asyncio.gather(issuer, *reads, return_exceptions=True)
            # Reads that never completed (timers that never fired, tasks cancelled
            # before or during their read) give their slots back here.
            abandoned = state["in_flight"]
            if abandoned:
                observer.reads_abandoned(abandoned)
                if server_reads is not None:
                    server_reads.give(abandoned)
