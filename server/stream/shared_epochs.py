"""Shared epochs: jobs that stream the same rank of the same epoch share its reads.

A hyperparameter sweep starts K jobs on one dataset with one seed; each asks for the
same (dataset, seed, epoch, world_size, batch_size, drop_last, rank, columns) stream.
Alone, each would read every sample of it. Here a `SharedEpoch` per such key reads each
sample once, keeps completed samples in a window of bounded bytes, and every job (a
`Subscriber`) takes them from there at its own pace, into its own chunks.

* Reads: one cursor walks the rank's batches in order. It reads batch b only while
  some attached subscriber wants it (b within its read-ahead horizon, `oldest +
  prefetch`, as alone), so reads run ahead of the fastest job by its prefetch.
* The window holds the batches [base, cursor). A batch leaves it once every attached
  subscriber that will deliver it has taken all of its samples.
* Memory: over `window_bytes`, the subscribers furthest behind (holding the window's
  oldest batch, while others are ahead of them) are detached, until the window fits. A detached subscriber keeps the batches
  of its horizon it already had (their reads finish into them), drains them, and then
  reads the rest of its stream alone with its own `Dealer`: it never stalls the others.
  When every subscriber is equally far, the window is just their read-ahead: reading
  waits, as one stream's `max_buffered_bytes` makes it wait alone.
* Tuning: with the autotuner on, one tuner per shared epoch sets the cursor's reads in
  flight and the read-ahead, chunk size and flush delay of the attached subscribers, fed
  the cursor's read latencies and the mean attached subscriber's sends and waits. Each
  subscriber's own tuner idles while attached and takes over if it detaches.
* A job whose start batch already left the window (it joined late), or lies past the
  cursor (it resumes ahead of the others), reads alone from the start.
* When the last attached subscriber leaves, reading stops at the batch boundary; reads
  still in flight finish for detached subscribers draining them, then the epoch closes.

What a job gets is what it would get alone: the same samples in the same batches and
positions, each once, every batch named once in `completed_batches` (on the chunk that
sends its last sample), and `start_batch`/`end_batch` as alone. Samples of a batch
arrive in an order its own reads could have completed in, within its own horizon of
`prefetch` batches past the oldest one not yet sent; a subscriber takes what the window
holds oldest batch first. Ordered streams (the one-read-at-a-time ablation) and readers
without I/O are never shared: there is nothing to save, or the point is to measure it.

Nothing here knows about gRPC.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import logging
import operator
import time
from collections.abc import AsyncIterator, Hashable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from croupier.server.stream.tuner import Autotuner, job_key
from croupier.protocol.epoch_plan import EpochPlan
from croupier.server.readers.base import Reader
from croupier.server.readers.latency import TICK_S
from croupier.server.stream.budgets import BufferBudget, ReadBudget
from croupier.server.stream.dealer import Dealer
from croupier.server.stream.fetch_limits import FetchLimits
from croupier.server.stream.rank_batches import StreamRange, plan_batches
from croupier.server.stream.read_groups import GroupIssuer, Results, settle
from croupier.server.stream.read_observer import FetchObserver, NoObserver
from croupier.server.stream.sample_chunks import PendingChunk, SampleRef
from croupier.server.stream.timer_wheel import TimerWheel

log = logging.getLogger("croupier.server.shared")
#: An arrival's bytes: (ref, item, bytes, error)[2].
_size_of = operator.itemgetter(2)

#: Default byte budget of one shared epoch's window (`croupier serve --shared-window-mb`).
DEFAULT_WINDOW_BYTES = 256 << 20


class SharedStats:
    """Counters and gauges of all shared epochs, collected as Prometheus families."""

    def __init__(self) -> None:
        self.epochs = 0
        self.subscribers = 0
        self.max_subscribers = 0
        self.window_bytes = 0
        self.joins: collections.Counter[str] = collections.Counter()
        self.detaches = 0
        self.reads = 0
        self.delivered = 0

    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily("croupier_shared_epochs", "Shared epochs reading now", value=self.epochs)
        yield GaugeMetricFamily("croupier_shared_subscribers", "Streams attached to a shared epoch now",
                                value=self.subscribers)
        yield GaugeMetricFamily("croupier_shared_subscribers_max", "Most streams one shared epoch served at once",
                                value=self.max_subscribers)
        yield GaugeMetricFamily("croupier_shared_window_bytes", "Completed sample bytes held in shared windows",
                                value=self.window_bytes)
        joins = CounterMetricFamily("croupier_shared_joins", "Streams that asked to share an epoch, by outcome: "
                                    "started (a new shared epoch), joined (an open one), late (its start had "
                                    "left the window: read alone), ahead (past the cursor: read alone)",
                                    labels=["outcome"])
        for outcome, n in sorted(self.joins.items()):
            joins.add_metric([outcome], n)
        yield joins
        detaches = CounterMetricFamily("croupier_shared_detaches", "Subscribers that fell behind a full window "
                                       "and went on with their own reads")
        detaches.add_metric([], self.detaches)
        yield detaches
        reads = CounterMetricFamily("croupier_shared_reads", "Sample reads issued by shared epochs")
        reads.add_metric([], self.reads)
        yield reads
        delivered = CounterMetricFamily("croupier_shared_samples_delivered",
                                        "Samples subscribers sent from shared reads (reads/delivered = 1/K "
                                        "while K jobs keep pace)")
        delivered.add_metric([], self.delivered)
        yield delivered


class _Batch:
    """One batch in the window: its samples in completion order."""

    __slots__ = ("size", "issued", "arrivals", "nbytes", "counted", "lead")

    def __init__(self, size: int):
        self.size = size
        self.issued = 0
        #: (ref, item, nbytes, error), appended as reads complete; never reordered.
        self.arrivals: list[tuple[SampleRef, Any, int, BaseException | None]] = []
        self.nbytes = 0
        #: Its bytes are in the window's total (until it leaves the window).
        self.counted = True
        #: Arrivals the furthest subscriber has taken (the rest wait on every subscriber).
        self.lead = 0


def share_key(reader: Reader, plan: EpochPlan, rank: int, columns: tuple[str, ...]) -> Hashable:
    """Everything that decides which bytes a stream's reads return and in which batches.

    The reader by identity (one open dataset); the plan's every field (rows, seed, epoch,
    batch size, world size, drop_last); the rank; the columns read. Not decode_images,
    prefetch, start/end batch: each subscriber encodes its own chunks, has its own
    read-ahead and its own range.
    """
    return (reader, plan, rank, columns)


class SharedEpoch(GroupIssuer):
    """One reading cursor over one rank's batches, and the window its subscribers share."""

    def __init__(
        self,
        owner: "SharedEpochs",
        key: Hashable,
        reader: Reader,
        plan: EpochPlan,
        rank: int,
        columns: tuple[str, ...],
        start_batch: int,
    ):
        self.owner = owner
        self.key = key
        self.reader = reader
        self.plan = plan
        self.rank = rank
        self.columns = columns
        #: The cursor's reads in flight and read-ahead, and the subscribers' chunk size and
        #: flush delay: the tuner's (one per shared epoch), else the server's limits.
        self.tuner = (owner.autotuner.stream(batch_size=plan.batch_size, name=f"shared {reader.name!r} rank {rank}",
                                             job=job_key(reader.name, plan), epoch=plan.epoch)
                      if owner.autotuner is not None else None)
        if self.tuner is not None:  # a rank resumed mid-epoch is that far into it
            self.tuner.delivered = start_batch * plan.batch_size
        self.limits: FetchLimits = owner.limits if self.tuner is None else self.tuner.settings.apply(owner.limits)
        self.sizer = reader.item_sizer(columns)
        self.base = self.cursor = start_batch
        self.batches: dict[int, _Batch] = {}
        self.window_used = 0
        #: Bytes ever completed, and those of them the furthest subscriber took: their
        #: difference is what no stream has taken yet (one stream's `buffered` alone).
        self.completed_bytes = 0
        self.lead_bytes = 0
        self.attached: list[Subscriber] = []
        #: Attached subscribers and detached ones still draining batches of this window.
        self.listeners: set[Subscriber] = set()
        self.in_flight = 0
        self.closed = False
        self.stopping = False  # no subscriber is attached: read no further batch
        self.most = 0
        self.reads = 0
        self.delivered = 0
        self.moved = asyncio.Event()
        self.timers = TimerWheel(asyncio.get_running_loop())
        self.tasks: set[asyncio.Task[None]] = set()
        self.issuer = asyncio.get_running_loop().create_task(self._issue())
        self.issuer.add_done_callback(self._issuer_done)
        self.error: BaseException | None = None
        self.label = (f"{reader.name!r} seed {plan.seed} epoch {plan.epoch} rank {rank}/{plan.world_size} "
                      f"batch_size {plan.batch_size}")

    # ---- membership ----

    def can_join(self, span: StreamRange) -> str:
        """'joined', or why a stream starting at span.start_batch cannot share this window."""
        if span.start_batch < self.base:
            return "late"
        if span.start_batch > self.cursor:
            return "ahead"
        return "joined"

    def join(self, sub: "Subscriber") -> None:
        sub.follow(self)
        self.attached.append(sub)
        self.listeners.add(sub)
        self.most = max(self.most, len(self.attached))
        stats = self.owner.stats
        stats.subscribers += 1
        stats.max_subscribers = max(stats.max_subscribers, len(self.attached))
        self.moved.set()

    def detach(self, sub: "Subscriber") -> None:
        """`sub` takes the batches of its horizon the window holds and leaves the window."""
        self.attached.remove(sub)
        self.owner.stats.subscribers -= 1
        self.owner.stats.detaches += 1
        hi = min(sub.oldest + sub.prefetch, self.cursor - 1, sub.end - 1)
        # Batches it took wholly may have left the window already: they are in its chunks.
        sub.pinned = {b: self.batches[b] for b in range(sub.oldest, hi + 1) if b in self.batches}
        sub.resume_at = max(hi + 1, sub.oldest)
        sub.unfollow()
        log.info("shared epoch %s: a stream fell behind a full window (%d bytes, at batch %d while the leader "
                 "is at %d) and goes on with its own reads from batch %d; %d stream(s) still share it",
                 self.label, self.window_used, sub.oldest, max((s.oldest for s in self.attached), default=-1),
                 sub.resume_at, len(self.attached))
        if not self.attached:
            self._stop()
        self._evict()
        sub.wake.set()

    def leave(self, sub: "Subscriber") -> None:
        if sub in self.attached:
            self.attached.remove(sub)
            self.owner.stats.subscribers -= 1
            if not self.attached:
                self._stop()
        self.listeners.discard(sub)
        if not self.listeners:
            self._close()
        else:
            self._evict()
            self.moved.set()

    def _stop(self) -> None:
        """No subscriber is attached: no new batch is read; the batch being issued is
        finished for detached subscribers draining it."""
        self.stopping = True
        self.owner.forget(self)
        self.moved.set()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.owner.forget(self)
        self.issuer.cancel()
        if self.owner.server_buffer is not None:
            self.owner.server_buffer.forget(self.moved)
        self.timers.cancel_all()
        if self.tuner is not None:
            self.tuner.close()
        for task in list(self.tasks):
            task.cancel()
        # Reads that never completed give their slots back.
        if self.in_flight:
            self.owner.observer.reads_abandoned(self.in_flight)
            if self.owner.server_reads is not None:
                self.owner.server_reads.give(self.in_flight)
            self.in_flight = 0
        for rec in self.batches.values():
            self._uncount(rec)
        self.batches.clear()
        self.owner.stats.epochs -= 1
        log.info("shared epoch %s ended: %d sample reads for %d samples delivered (%.2f reads per sample), "
                 "at most %d streams at once", self.label, self.reads, self.delivered,
                 self.reads / max(self.delivered, 1), self.most)

    # ---- the window ----

    def _uncount(self, rec: _Batch) -> None:
        if rec.counted:
            rec.counted = False
            self.window_used -= rec.nbytes
            self.owner.stats.window_bytes -= rec.nbytes
            if self.owner.server_buffer is not None:
                self.owner.server_buffer.release(rec.nbytes)

    def _evict(self) -> None:
        """Drop the oldest batches no attached subscriber will take again."""
        while self.base < self.cursor:
            rec = self.batches[self.base]
            if len(rec.arrivals) < rec.size and not self.stopping:
                break  # reads still land in it
            if any(s.needs(self.base, rec) for s in self.attached):
                break
            del self.batches[self.base]
            self._uncount(rec)
            self.base += 1
        self.moved.set()

    def advanced(self) -> None:
        """A subscriber sent chunks: batches may leave the window, reads may go on."""
        self._evict()

    def _wanted(self, batch: int) -> bool:
        return any(s.start <= batch < s.end and batch <= s.oldest + s.prefetch for s in self.attached)

    def _over_window(self) -> bool:
        """Over the byte budget, holding more than one batch (one batch always fits: reads move)."""
        if self.window_used <= self.owner.window_bytes or self.cursor - self.base <= 1:
            return False
        # Furthest behind first, then look again: once they leave, the window may fit, and a
        # job a batch or two out of step with the leader stays in (its reads stay shared).
        while self.window_used > self.owner.window_bytes and self.cursor - self.base > 1 and self.attached:
            laggards = [s for s in self.attached if s.needs(self.base, self.batches[self.base])]
            lead = max(s.oldest for s in self.attached)
            last = min((s.oldest for s in laggards), default=lead)
            if last >= lead:
                break  # all equally far: the window is their read-ahead; reading waits
            for sub in [s for s in laggards if s.oldest == last]:
                self.detach(sub)
        return self.window_used > self.owner.window_bytes and self.cursor - self.base > 1

    def _no_room(self) -> bool:
        limits = self.limits
        untaken = self.completed_bytes - self.lead_bytes
        if (self.in_flight >= limits.max_reads_per_stream or untaken > limits.max_buffered_bytes
                or self._over_window()):
            return True
        # Past the server-wide total, read on only while no stream has a chunk to take,
        # as one stream alone does: window bytes wait on the slowest, so not them.
        budget = self.owner.server_buffer
        return (budget is not None and budget.used > budget.limit
                and (untaken >= limits.chunk_bytes or self.in_flight >= limits.chunk_samples))

    # ---- reads ----

    def _complete(self, rec: _Batch, ref: SampleRef, item: Any, err: BaseException | None, t0: float) -> None:
        self._complete_group(rec, [ref], t0, [(0, item, err)])

    def _complete_group(self, rec: _Batch, refs: list[SampleRef], t0: float, results: Results) -> None:
        """Reads of `refs` (all of batch `rec`) landed: (position in refs, item, error) each."""
        if self.closed:
            return
        total = settle(refs, results, time.perf_counter() - t0, self.sizer, self.owner.observer, self.tuner,
                       self.owner.server_reads, rec.arrivals)
        self.in_flight -= len(results)
        self.completed_bytes += total
        if rec.counted:
            rec.nbytes += total
            self.window_used += total
            self.owner.stats.window_bytes += total
            if self.owner.server_buffer is not None:
                self.owner.server_buffer.used += total
        for sub in self.listeners:
            sub.wake.set()
        self.moved.set()

    def _fetch_after_wait(self, rec: _Batch, ref: SampleRef, fetch: Any, t0: float) -> None:
        try:
            item, err = fetch(ref.index), None
        except Exception as exc:  # handed to the subscribers, which raise it
            item, err = None, exc
        self._complete(rec, ref, item, err, t0)

    def _complete_read(self, rec: _Batch, ref: SampleRef, t0: float, item: Any, err: BaseException | None) -> None:
        self._complete(rec, ref, item, err, t0)

    async def _read_one(self, rec: _Batch, ref: SampleRef, t0: float) -> None:
        try:
            item, err = await self.reader.read(ref.index, self.columns), None
        except Exception as exc:
            item, err = None, exc
        self._complete(rec, ref, item, err, t0)

    def _batches(self) -> AsyncIterator[tuple[int, list[int], list[bool]]]:
        return plan_batches(self.plan, self.rank, self.cursor, self.plan.num_batches, self.owner.executor)

    async def _issue(self) -> None:
        """Read the rank's batches in order while subscribers want them, in groups where
        the reader reads groups (server/stream/read_groups.py), else one by one."""
        server_reads, observer = self.owner.server_reads, self.owner.observer
        budget = self.owner.server_buffer
        async for batch, indices, padding in self._batches():
            while not self.stopping and not self._wanted(batch):
                self.moved.clear()
                await self.moved.wait()
            if self.stopping:
                return
            rec = self.batches[batch] = _Batch(len(indices))
            self.cursor = batch + 1
            for sub in self.listeners:
                sub.wake.set()
            await self._issue_batch(batch, indices, padding, (rec,), self.tasks, observer, server_reads, budget)

    def _issued(self, ctx: tuple[Any, ...], k: int) -> None:
        ctx[0].issued += k
        self.reads += k
        self.owner.stats.reads += k

    async def _wait_for_room(self) -> None:
        """Until something moves; past the server's buffer total, also until it is back under."""
        self.moved.clear()
        budget = self.owner.server_buffer
        if budget is not None and budget.used > budget.limit:
            budget.wait_for_room(self.moved)
        await self.moved.wait()

    def sent(self, samples: int, nbytes: int, starved_s: float) -> None:
        """A subscriber sent a chunk. The tuner sees the mean attached subscriber: the
        cursor reads for all of them at the pace of one (they keep pace, or detach)."""
        tuner = self.tuner
        if tuner is None:
            return
        share = 1 / max(1, len(self.attached))
        tuner.sent += samples * share
        tuner.sent_bytes += nbytes * share
        tuner.starved_s += starved_s * share
        settings = tuner.maybe_decide()
        if settings is not None:
            self.limits = settings.apply(self.owner.limits)
            for sub in self.attached:
                sub.retune(settings.prefetch)
            self.moved.set()  # a higher bound or a longer read-ahead lets the issuer go on

    def _issuer_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.error = task.exception()  # the plan failed: every listener raises it
        for sub in self.listeners:
            sub.wake.set()


class SharedEpochs:
    """The shared epochs of one server, by key; hands each stream its chunk iterator."""

    def __init__(
        self,
        *,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        limits: FetchLimits = FetchLimits(),
        server_reads: ReadBudget | None = None,
        server_buffer: BufferBudget | None = None,
        executor: concurrent.futures.Executor | None = None,
        observer: FetchObserver | None = None,
        autotuner: Autotuner | None = None,
    ):
        if window_bytes < 1:
            raise ValueError(f"a shared window needs at least 1 byte, got {window_bytes} (--shared-window-mb)")
        self.window_bytes = window_bytes
        self.limits = limits
        self.server_reads = server_reads
        self.server_buffer = server_buffer
        self.executor = executor
        self.observer = observer or NoObserver()
        self.autotuner = autotuner
        self.stats = SharedStats()
        self.open: dict[Hashable, SharedEpoch] = {}

    def forget(self, epoch: SharedEpoch) -> None:
        if self.open.get(epoch.key) is epoch:
            del self.open[epoch.key]

    def stream(self, dealer: Dealer) -> AsyncIterator:
        """The chunks of `dealer`'s stream: from a shared epoch when it can share one,
        else from `dealer` itself (ordered streams, readers without I/O)."""
        if dealer.ordered or not dealer.reader.read_does_io or dealer.span.start_batch >= dealer.span.end_batch:
            return aiter(dealer)
        return Subscriber(self, dealer).chunks()

    def _subscribe(self, sub: "Subscriber") -> SharedEpoch | None:
        d = sub.dealer
        key = share_key(d.reader, d.plan, d.span.rank, d.columns)
        epoch = self.open.get(key)
        if epoch is None:
            epoch = self.open[key] = SharedEpoch(self, key, d.reader, d.plan, d.span.rank, d.columns,
                                                  d.span.start_batch)
            self.stats.epochs += 1
            self.stats.joins["started"] += 1
            log.info("shared epoch %s started at batch %d", epoch.label, d.span.start_batch)
            epoch.join(sub)
            return epoch
        outcome = epoch.can_join(d.span)
        self.stats.joins[outcome] += 1
        if outcome != "joined":
            log.info("shared epoch %s: a stream from batch %d reads alone (%s: the window holds batches %d..%d)",
                     epoch.label, d.span.start_batch, outcome, epoch.base, epoch.cursor - 1)
            return None
        epoch.join(sub)
        log.info("shared epoch %s: a stream from batch %d joined; %d stream(s) share it", epoch.label,
                 d.span.start_batch, len(epoch.attached))
        return epoch


class Subscriber:
    """One stream's view of a shared epoch: takes samples at its own pace, chunks them
    as its own `Dealer` would, and detaches to that dealer when it falls behind."""

    def __init__(self, owner: SharedEpochs, dealer: Dealer):
        self.owner = owner
        self.dealer = dealer
        self.start = dealer.span.start_batch
        self.end = dealer.span.end_batch
        self.prefetch = dealer.prefetch
        self.oldest = self.start  # the oldest batch not yet wholly sent
        self.taken: dict[int, int] = {}  # batch -> samples taken into chunks (window batches only)
        self.unsent: dict[int, int] = {}  # batch -> samples not yet handed to the consumer
        self.wake = asyncio.Event()
        #: After a detach: the batches it had of the window, and where its own reads start.
        self.pinned: dict[int, _Batch] | None = None
        self.resume_at = self.end

    def follow(self, epoch: SharedEpoch) -> None:
        """Attached: the epoch's tuner sets the read-ahead (unless the client asked for
        one), and this stream's own tuner idles until a detach (off the gauges, and not
        counted against --max-reads while the cursor reads for it)."""
        if epoch.tuner is not None:
            self.retune(epoch.tuner.settings.prefetch)
        if self.dealer.tuner is not None:
            self.dealer.tuner.server.idle(self.dealer.tuner)

    def unfollow(self) -> None:
        tuner = self.dealer.tuner
        if tuner is not None:
            tuner.server.resume(tuner)

    def retune(self, prefetch: int) -> None:
        tuner = self.dealer.tuner
        if tuner is not None and "default_prefetch" not in tuner.pinned:
            self.prefetch = prefetch

    def needs(self, batch: int, rec: _Batch) -> bool:
        """Will this subscriber still take samples of `batch`?"""
        return self.start <= batch < self.end and batch >= self.oldest and self.taken.get(batch, 0) < rec.size

    async def chunks(self) -> AsyncIterator:
        epoch = self.owner._subscribe(self)
        if epoch is None:
            async for chunk in self.dealer:
                yield chunk
            return
        try:
            async for chunk in self._shared(epoch):
                yield chunk
        finally:
            epoch.leave(self)
        if self.resume_at < self.end:
            own = copy.copy(self.dealer)
            own.span = StreamRange(self.dealer.span.rank, self.resume_at, self.end)
            async for chunk in own:
                yield chunk

    def _take(self, epoch: SharedEpoch, pending: PendingChunk, limit: int) -> None:
        """Move what the window holds of this subscriber's horizon into `pending`, oldest
        batch first, until the chunk is full."""
        limits = epoch.limits
        source = epoch.batches if self.pinned is None else self.pinned
        whole_so_far = True  # every batch before this one is wholly taken
        for b in range(self.oldest, min(self.oldest + self.prefetch + 1, limit)):
            rec = source.get(b)
            if rec is None:
                if b in self.taken:
                    continue  # wholly taken (not yet sent): it left the window
                return  # not read yet (batches are read in order)
            t = self.taken.get(b, 0)
            arrivals = rec.arrivals
            if pending.urgent and (t or len(arrivals) < rec.size
                                   or len(pending.refs) + rec.size > limits.chunk_samples):
                return  # due now: only whole batches that fit ride along (see PendingChunk.at_limits)
            if t < len(arrivals):
                if t == 0:
                    self.unsent[b] = rec.size
                t = pending.take(arrivals, t, limits)
                self.taken[b] = t
                if t > rec.lead:  # the furthest stream took these: they no longer count as unread-ahead
                    epoch.lead_bytes += sum(map(_size_of, arrivals[rec.lead:t]))
                    rec.lead = t
                if t == rec.size:
                    pending.completed.append(b)
                    pending.urgent |= whole_so_far
                if pending.at_limits(limits):
                    return
            whole_so_far &= t == rec.size

    async def _shared(self, epoch: SharedEpoch) -> AsyncIterator:
        loop = asyncio.get_running_loop()
        dealer = self.dealer
        pending = PendingChunk()
        starved = 0.0
        while True:
            limits = epoch.limits
            limit = self.end if self.pinned is None else self.resume_at
            if self.oldest >= limit and not pending.refs:
                return
            if epoch.error is not None:
                raise epoch.error
            self._take(epoch, pending, limit)
            due = pending.refs and (pending.full(limits) or time.monotonic() + TICK_S >= pending.deadline
                                    or self._all_taken(limit))
            if not due:
                self.wake.clear()
                timer = (loop.call_at(loop.time() + max(pending.deadline - time.monotonic(), 0), self.wake.set)
                         if pending.refs else None)
                w0 = time.perf_counter()
                await self.wake.wait()
                starved += time.perf_counter() - w0
                if timer is not None:
                    timer.cancel()
                continue
            chunks = await dealer.encode_chunks(pending.refs, pending.items, pending.completed, pending.nbytes)
            nbytes = pending.nbytes
            pending = PendingChunk()
            for chunk in chunks:
                yield chunk
                for ref in chunk.refs:
                    self.unsent[ref.batch] -= 1
                epoch.delivered += len(chunk.refs)
                self.owner.stats.delivered += len(chunk.refs)
            while self.oldest < limit and self.unsent.get(self.oldest) == 0:
                del self.unsent[self.oldest]
                self.taken.pop(self.oldest, None)
                self.oldest += 1
            if self.pinned is None:
                epoch.sent(sum(len(c.refs) for c in chunks), nbytes, starved)
                epoch.advanced()
            starved = 0.0

    def _all_taken(self, limit: int) -> bool:
        """Every sample up to `limit` is in a chunk: flush the last one now."""
        last = limit - 1
        source = self.dealer.plan
        return self.taken.get(last, 0) == source.batch_length(last) and all(
            self.taken.get(b, 0) == source.batch_length(b) for b in range(self.oldest, limit)
        )
