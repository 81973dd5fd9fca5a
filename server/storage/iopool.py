"""A pool of threads that only wait on storage, completing asyncio futures in batches.

Python has no portable async file read, and a pread on a network or FUSE file system
blocks its thread for the storage's latency. So each read in flight holds one thread of
this pool, which is sized by the server's read limit (hundreds to thousands), never by
the CPU count, and runs nothing but blocking reads: CPU work (encode, decode) has its
own small executor and never queues behind a slow read.

Completions go back to the event loop through one queue: a worker appends its result
and wakes the loop only when no wake-up is already pending, so under load one wake-up
delivers many reads (run_in_executor costs a wake-up and two futures per read).
Threads start on demand, so an idle server holds few.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
from collections.abc import Callable
from typing import Any

#: Each thread only runs a pread: a small stack keeps a thousand of them cheap.
_STACK_BYTES = 256 << 10


class IOPool:
    def __init__(self, max_threads: int, name: str = "croupier-read"):
        if max_threads < 1:
            raise ValueError(f"an I/O pool needs at least 1 thread, got {max_threads}")
        self.max_threads = max_threads
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Callable[..., Any], tuple] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        #: Jobs submitted and not yet drained: counted on the loop's thread only, so
        #: starting a thread when they outnumber the threads needs no lock.
        self._busy = 0
        # Per loop: completed (future, result, error) and whether a drain is scheduled.
        self._done: collections.deque[tuple[asyncio.Future[Any], Any, BaseException | None]] = collections.deque()
        self._wake_pending = False
        self._closed = False

    @property
    def threads(self) -> int:
        return len(self._threads)

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Run blocking `fn(*args)` on a pool thread; the returned future is the loop's."""
        if self._closed:
            raise RuntimeError(f"I/O pool {self.name} is closed")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._jobs.put((loop, fut, fn, args))
        self._busy += 1
        if self._busy > len(self._threads) and len(self._threads) < self.max_threads:
            self._threads.append(self._start_thread())
        return fut

    def _start_thread(self) -> threading.Thread:
        old = threading.stack_size()
        try:
            threading.stack_size(_STACK_BYTES)
            t = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
            t.start()
        finally:
            threading.stack_size(old)
        return t

    def _work(self) -> None:
        jobs = self._jobs
        while True:
            job = jobs.get()
            if job is None:
                return
            loop, fut, fn, args = job
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # handed to the awaiting coroutine
                result, error = None, exc
            self._done.append((fut, result, error))
            if not self._wake_pending:
                self._wake_pending = True
                try:
                    loop.call_soon_threadsafe(self._drain)
                except RuntimeError:  # the loop closed: nobody waits for this read any more
                    pass

    def _drain(self) -> None:
        # Clear the flag before taking: a worker that appends after this point
        # schedules another drain, so no completion is left behind.
        self._wake_pending = False
        done = self._done
        loop = asyncio.get_running_loop()
        while done:
            fut, result, error = done.popleft()
            self._busy -= 1
            if fut.get_loop() is not loop:  # a pool shared by two loops (tests): hand it over
                fut.get_loop().call_soon_threadsafe(_settle, fut, result, error)
            else:
                _settle(fut, result, error)

    def close(self) -> None:
        """Stop the threads once the reads queued now are done (does not wait)."""
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.cancelled():
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)
