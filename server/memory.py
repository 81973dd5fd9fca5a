"""Hand freed memory back to the OS after streams end.

glibc's malloc keeps what a stream's buffers freed in its arenas (one per thread that
allocated, and the I/O pool has many): 16 never-read streams left the server at
783 MB RSS after they ended, 129 MB after `malloc_trim(0)`. A trim runs in the
executor at most once per `interval_s`, and one is always due `interval_s` after the
last stream ended, so an idle server ends up trimmed. Elsewhere than glibc: a no-op.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import time
from collections.abc import Callable


def _malloc_trim() -> Callable[[], object] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class MemoryTrimmer:
    def __init__(self, executor: concurrent.futures.Executor | None, interval_s: float = 10.0):
        self.executor = executor
        self.interval_s = interval_s
        self.trim = _malloc_trim()
        self.last = float("-inf")
        self.pending: asyncio.TimerHandle | None = None
        self.trims = 0

    def stream_ended(self) -> None:
        """Call on the event loop when a stream ends."""
        if self.trim is None or self.pending is not None:
            return
        loop = asyncio.get_running_loop()
        wait = self.last + self.interval_s - time.monotonic()
        self.pending = loop.call_later(max(wait, 0.0), self._run, loop)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        self.pending = None
        self.last = time.monotonic()
        self.trims += 1
        loop.run_in_executor(self.executor, self.trim)
