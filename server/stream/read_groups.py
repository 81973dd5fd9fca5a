"""A batch's reads issued in groups: one reader call, one storage call per file and one
completion per group (or per wake-up of the loop), instead of each per sample.

The per-sample Python of the hot path (the storage layers' bookkeeping, a callback chain,
the stream's counters) cost more than the reads themselves (bench/results/cpu_per_sample.md):
a group pays it once. A group never spans batches, holds at most `READ_GROUP` samples
and only what the bounds allow at once, so the bounds hold as they do per sample; the
completions count each sample, whether a group's come in one call or several.

How a group lands depends on the storage (`ArrowIPCReader.start_reads`). Where reads
land at once (files on a local block or memory file system, or every byte of them held in
the server's memory cache: `Store.held_in_memory`, asked by the issuer at each batch, so a
fill that ends mid-epoch switches) the group is one `submit_ranges` per file and one
completion for all its files (held in memory: one `held_ranges`, complete before the reader
returns; a batch's rows span most of a dataset's files, and a completion per file cost
its settling once per two or three rows of the real suite's 16 files); there the server
is CPU-bound, and a group cut its CPU per text row about in half, with twice the rows/s
(bench/results/cpu_per_sample.md). Elsewhere (a FUSE mount, reads of
milliseconds) the group is one `submit_rows`: its reads start together, and each row is
handed over as soon as its own read lands, those that landed since the loop last woke in
one call. One completion per group (tried first) lost there: a group's slowest read held
its slots, and the tuner, seeing the group's latency, kept 2-10x more reads in flight
(8,778-11,943 rows/s against 15,524-17,930 one by one on latencyfs at 5 ms with the
kernel's defaults). Handed over row by row, each row's latency is its own and the Python
is paid per wake-up: on that mount, 22,537 against 20,136 rows/s with the cache off and
46.3 against 56.5 us of server CPU per row; 30,101 against 20,586 and 34.3 against 52.7 us
with it on (an exploratory A/B; the committed figures are in cpu_per_sample.md). A store
that cannot (`submit_rows` False: an object store) is read one sample at a time there.
An ImageFolder's images go the same way on a file system (`ImageFolderReader.start_reads`:
one `Store.submit_files` call, each image handed over as it lands). Other readers are read
one sample at a time (groups of one).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

from croupier.server.readers.base import Reader
from croupier.server.stream.budgets import BufferBudget, ReadBudget
from croupier.server.stream.fetch_limits import FetchLimits
from croupier.server.stream.read_observer import FetchObserver
from croupier.server.stream.sample_chunks import SampleRef
from croupier.server.stream.timer_wheel import TimerWheel

#: A group's landed reads: (position in the group, item, the error it raised).
Results = list[tuple[int, Any, BaseException | None]]

#: Samples per group at most: enough to pay the per-call Python once for many reads, few
#: enough that a group's slowest read holds back little (the max of 32 lognormal draws of
#: sigma 0.5 is about 2.4x their median).
READ_GROUP = 32


def group_size(reader: Reader) -> int:
    """READ_GROUP for a reader that asks for groups (`Reader.reads_in_groups`), else 1."""
    return READ_GROUP if getattr(reader, "reads_in_groups", False) else 1


def room(limits: FetchLimits, in_flight: int, server_buffer: BufferBudget | None) -> int:
    """Reads that may start now under the in-flight bounds (the caller checked there is room)."""
    n = limits.max_reads_per_stream - in_flight
    if server_buffer is not None and server_buffer.used > server_buffer.limit:
        n = min(n, limits.chunk_samples - in_flight)
    return max(n, 1)


async def take_slots(server_reads: ReadBudget | None, want: int) -> int:
    """Up to `want` of the server's read slots, at least one (waiting for it if need be)."""
    if server_reads is None:
        return want
    got = server_reads.try_take_many(want)
    if got:
        return got
    await server_reads.take()
    return 1


def settle(refs: Sequence[SampleRef], results: Results, seconds: float, sizer: Callable[[Any], int],
           observer: FetchObserver, tuner: Any, server_reads: ReadBudget | None, out: Any) -> int:
    """Landed reads of a group: each (ref, item, bytes, error) appended to `out`, each
    counted finished by the observer, the tuner and the server's read slots; their bytes."""
    total = failed = 0
    for pos, item, err in results:
        if err is None:
            nbytes = sizer(item)
            total += nbytes
        else:
            nbytes = 0
            failed += 1
        out.append((refs[pos], item, nbytes, err))
    k = len(results)
    if failed < k:
        observer.read_finished(seconds, True, k - failed)
    if failed:
        observer.read_finished(seconds, False, failed)
    if tuner is not None:
        tuner.lat_sum += seconds * k
        tuner.done += k
    if server_reads is not None:
        server_reads.give(k)
    return total


def start(reader: Reader, columns: tuple[str, ...], refs: list[SampleRef], grouped: bool, timers: TimerWheel,
          tasks: set[asyncio.Task[None]], ctx: tuple[Any, ...], *, group_done: Callable[..., None],
          fetch_after_wait: Callable[..., None], complete_read: Callable[..., None], read_one: Callable[..., Any],
          t0: float | None = None, warm: bool = True) -> None:
    """Begin the reads of `refs`: as one group (`group_done(*ctx, refs, t0, results)`);
    those the reader left cold, where it can warm them (`Reader.warms`: a table's missing
    structural pages) and there are several, warmed together by one task and started again
    as a group; the rest (or all, for a reader without groups) one by one, the cheapest
    way it offers: a timer then a fetch (injected latency), a callback from the store, or
    else a task awaiting `read_one(*ctx, ref, t0)`. `ctx` leads every callback's arguments
    (a shared epoch's batch), so nothing is bound per call."""
    if t0 is None:
        t0 = time.perf_counter()
    cold: Sequence[int] = (reader.start_reads([r.index for r in refs], columns,
                                              functools.partial(group_done, *ctx, refs, t0))
                           if grouped else range(len(refs)))
    if warm and grouped and len(cold) >= WARM_MIN and reader.warms:
        later = [refs[p] for p in cold]
        task = asyncio.get_running_loop().create_task(_warm_then_start(
            reader, columns, later, timers, tasks, ctx, t0, group_done, fetch_after_wait, complete_read, read_one))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return
    for p in cold:
        ref = refs[p]
        later = reader.read_later(ref.index)
        if later is not None:
            # A wait then a cheap fetch (injected latency over memory-mapped data): a
            # timer callback, no task, no coroutine per sample.
            delay, fetch = later
            timers.call_later(delay, fetch_after_wait, *ctx, ref, fetch, t0)
        elif not reader.start_read(ref.index, columns, functools.partial(complete_read, *ctx, ref, t0)):
            task = asyncio.get_running_loop().create_task(read_one(*ctx, ref, t0))
            tasks.add(task)
            task.add_done_callback(tasks.discard)


#: Cold rows of a group warmed together (one task, their pages loaded at once) from this
#: many on; one alone takes its own read's task, which loads the same pages.
WARM_MIN = 2


async def _warm_then_start(reader: Reader, columns: tuple[str, ...], refs: list[SampleRef], timers: TimerWheel,
                           tasks: set[asyncio.Task[None]], ctx: tuple[Any, ...], t0: float, group_done: Callable[..., None],
                           fetch_after_wait: Callable[..., None], complete_read: Callable[..., None],
                           read_one: Callable[..., Any]) -> None:
    """Cold rows of a group: what they lack loaded at once, then started as a group (those
    still cold, one by one: their reads name what failed). One task for the lot, not one
    per row; their latency counts from the group's start."""
    try:
        await reader.warm([r.index for r in refs], columns)
    except Exception:  # noqa: BLE001  # each row's own read says what is wrong
        pass
    start(reader, columns, refs, True, timers, tasks, ctx, group_done=group_done, fetch_after_wait=fetch_after_wait,
          complete_read=complete_read, read_one=read_one, t0=t0, warm=False)


class GroupIssuer:
    """The loop that issues one batch's reads, group by group as the bounds allow, shared
    by a stream alone (unordered.py) and a shared epoch (shared_epochs.py). The class that
    mixes it in holds the attributes below and answers `_no_room`, `_wait_for_room`, the
    completions `start` calls back, and `_issued` (its own counters)."""

    reader: Reader
    columns: tuple[str, ...]
    limits: FetchLimits
    tuner: Any
    timers: TimerWheel
    in_flight: int

    def _no_room(self) -> bool:
        raise NotImplementedError

    async def _wait_for_room(self) -> None:
        raise NotImplementedError

    def _issued(self, ctx: tuple[Any, ...], k: int) -> None:
        """`k` more reads issued for `ctx`'s batch."""

    async def _issue_batch(self, batch: int, indices: Sequence[int], padding: Sequence[bool], ctx: tuple[Any, ...],
                           tasks: set[asyncio.Task[None]], observer: FetchObserver, server_reads: ReadBudget | None,
                           server_buffer: BufferBudget | None) -> None:
        """Start every read of `batch`: each group once there is room under the stream's
        bounds and the server's read slots, at most READ_GROUP samples where the reader
        reads groups now (asked per batch: a cache fill that ends turns them on)."""
        most = group_size(self.reader)
        tuner, limits = self.tuner, self.limits
        n, pos = len(indices), 0
        while pos < n:
            while self._no_room():
                if tuner is not None and self.in_flight >= limits.max_reads_per_stream:
                    tuner.bound_hits += 1
                await self._wait_for_room()
            k = min(most, n - pos)
            if k > 1:
                k = min(k, room(limits, self.in_flight, server_buffer))
            k = await take_slots(server_reads, k)
            refs = [SampleRef(batch, p, indices[p], padding[p]) for p in range(pos, pos + k)]
            pos += k
            self.in_flight += k
            self._issued(ctx, k)
            observer.read_started(k)
            start(self.reader, self.columns, refs, most > 1, self.timers, tasks, ctx,
                  group_done=self._complete_group, fetch_after_wait=self._fetch_after_wait,  # type: ignore[attr-defined]
                  complete_read=self._complete_read, read_one=self._read_one)  # type: ignore[attr-defined]
