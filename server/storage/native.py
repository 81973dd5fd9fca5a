"""The native read pool (_preadpool.c) seen from asyncio: preads that return futures.

Each read is one C call to submit and, per wake-up of the loop, one C call drains every
completion; the native threads never take the GIL. Without the compiled extension (an
install without a C compiler) `available()` is False and the store uses the Python
pool (iopool.py) instead, or when CROUPIER_READ_POOL=python asks for it.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

try:
    from ._preadpool import Pool as _NativePool
except ImportError:  # built without a compiler: the Python pool serves instead
    _NativePool = None


def available() -> bool:
    """The native pool is built, and not turned off by CROUPIER_READ_POOL=python."""
    return _NativePool is not None and os.environ.get("CROUPIER_READ_POOL", "native") != "python"


class NativeReadPool:
    def __init__(self, max_threads: int):
        if _NativePool is None:
            raise RuntimeError("croupier's native read pool is not built (no C compiler at install time)")
        self.max_threads = max_threads
        self._pool = _NativePool(max_threads)
        self._futures: dict[int, asyncio.Future[bytes]] = {}
        self._token = 0
        self._loops: list[asyncio.AbstractEventLoop] = []
        self._closed = False

    @property
    def threads(self) -> int:
        return self._pool.threads

    def _future(self) -> tuple[int, asyncio.Future[bytes]]:
        if self._closed:
            raise RuntimeError("the read pool is closed")
        loop = asyncio.get_running_loop()
        if loop not in self._loops:  # each loop that reads watches the eventfd
            self._loops = [lp for lp in self._loops if not lp.is_closed()]
            loop.add_reader(self._pool.fileno(), self._drain)
            self._loops.append(loop)
        self._token += 1
        fut = loop.create_future()
        self._futures[self._token] = fut
        return self._token, fut

    def pread(self, fd: int, offset: int, size: int) -> asyncio.Future[bytes]:
        """`size` bytes at `offset` of open file `fd` (-1: to the end); fewer at the end."""
        token, fut = self._future()
        self._pool.submit(token, fd, offset, size)
        return fut

    def pread_path(self, path: str, offset: int, size: int) -> asyncio.Future[bytes]:
        """The same on `path`, opened and closed by the native thread (no fd kept)."""
        token, fut = self._future()
        self._pool.submit_path(token, path, offset, size)
        return fut

    def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        for token, value in self._pool.drain():
            fut = self._futures.pop(token, None)
            if fut is None:
                continue
            if fut.get_loop() is not loop:  # another loop's read (tests share a store)
                fut.get_loop().call_soon_threadsafe(_settle, fut, value)
            else:
                _settle(fut, value)

    def close(self) -> None:
        self._closed = True
        for loop in self._loops:
            if not loop.is_closed():
                try:
                    loop.remove_reader(self._pool.fileno())
                except (RuntimeError, ValueError):
                    pass
        self._pool.close()


def _settle(fut: asyncio.Future[Any], value: bytes | int) -> None:
    if fut.cancelled():
        return
    if isinstance(value, int):
        fut.set_exception(OSError(-value, os.strerror(-value)))
    else:
        fut.set_result(value)
