"""A mount's gate: at most `limit` reads in flight at its storage, the rest wait here, in
the order they were asked, on the event loop.

Why: a FUSE daemon that serves only about one read at a time (rclone mount with its
defaults: readpath.daemon_bound) gains nothing from 200 reads in flight, and the reads it
has not started yet hold the kernel's background requests (max_background, 12) while they
wait for it. The cache's fill, whose large sequential reads that daemon serves at hundreds
of MB/s, then queued behind them: through a 20 ms rclone mount the fill of 1 GB of text
started 22 s late and the stream made 14-23 rows/s. Reads held here cost the storage
nothing; the tuner sees them as latency (queueing) and stops growing.

Everything runs on the loop's thread (the native pool delivers completions there): no lock.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any


class ReadGate:
    """At most `limit` reads in flight; each `submit` or `run` is `count` reads."""

    __slots__ = ("limit", "in_flight", "peak", "queued", "waiting", "loop", "_waiting")

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"a read gate needs a limit of at least 1, not {limit}")
        self.limit = limit
        self.in_flight = 0
        self.peak = 0  # the most reads in flight at once through the gate
        self.queued = 0  # reads that waited at the gate, in all
        self.waiting = 0  # reads waiting at the gate now (a plain count: metrics read it from their thread)
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop it runs on, from its first read
        self._waiting: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()

    def submit(self, count: int, start: Callable[[], None]) -> None:
        """Call `start()` (which issues `count` reads and calls `release(count)` once they
        land) now when there is room, else when earlier reads have landed. A call larger
        than the limit goes alone, once nothing else is in flight."""
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        if not self._waiting and self._room(count):
            self._start(count, start)
        else:
            self.queued += count
            self.waiting += count
            self._waiting.append((count, start))

    def run(self, start: Callable[[], "asyncio.Future[Any]"]) -> "asyncio.Future[Any]":
        """One read, started by `start()` (a future) when there is room: a future of its
        result. Cancelling it while it waits drops the read."""
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        if not self._waiting and self._room(1):
            self._admit(1)
            return self._released_when_done(start)
        outer: asyncio.Future[Any] = self.loop.create_future()

        def begin() -> None:  # admitted: one read counted in flight
            if outer.cancelled():
                self.release(1)
                return
            try:
                inner = self._released_when_done(start)
            except BaseException as e:  # noqa: BLE001  # the read could not start: its caller hears it
                outer.set_exception(e)
                return
            inner.add_done_callback(lambda f: _copy(f, outer))

        self.queued += 1
        self.waiting += 1
        self._waiting.append((1, begin))
        return outer

    def release(self, count: int) -> None:
        """`count` reads landed: start those waiting that now fit, in order."""
        self.in_flight -= count
        while self._waiting and self._room(self._waiting[0][0]):
            n, start = self._waiting.popleft()
            self.waiting -= n
            self._start(n, start)

    def set_limit(self, limit: int) -> None:
        """A new limit (the mount was measured again); waiting reads that fit start."""
        self.limit = max(1, limit)
        self.release(0)

    def set_limit_threadsafe(self, limit: int) -> None:
        """`set_limit` from any thread (a probe again runs on a thread of its own)."""
        loop = self.loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is None or loop is here or loop.is_closed():
            self.set_limit(limit)
        else:
            loop.call_soon_threadsafe(self.set_limit, limit)

    def _room(self, count: int) -> bool:
        return self.in_flight + count <= self.limit or self.in_flight == 0

    def _admit(self, count: int) -> None:
        self.in_flight += count
        self.peak = max(self.peak, self.in_flight)

    def _start(self, count: int, start: Callable[[], None]) -> None:
        self._admit(count)
        start()

    def _released_when_done(self, start: Callable[[], "asyncio.Future[Any]"]) -> "asyncio.Future[Any]":
        """start(), admitted already: released when its future is done, or now if it raises."""
        try:
            fut = start()
        except BaseException:
            self.release(1)
            raise
        fut.add_done_callback(lambda _f: self.release(1))
        return fut


def _copy(src: "asyncio.Future[Any]", dst: "asyncio.Future[Any]") -> None:
    if dst.done():
        return
    if src.cancelled():
        dst.cancel()
    elif src.exception() is not None:
        dst.set_exception(src.exception())  # type: ignore[arg-type]
    else:
        dst.set_result(src.result())
