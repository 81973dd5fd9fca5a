"""Fill for object-store datasets (s3://): large range GETs on the server's event loop.

An object store has no page cache: without the cache every sample of every epoch is a
GET. The fill reads a dataset's objects in ranges of FILL_GET_BYTES, OBJECT_FILL_IN_FLIGHT
of them at once, on the event loop the samples' GETs use (async: no thread per GET), in
the order the dataset opened its objects. Each GET goes through obstore, whose answer
carries the object's ETag: an object rewritten since its dataset opened (another ETag)
is never cached, and the dataset stops serving it from the cache.

The rule, once per store (endpoint and bucket): two small GETs (SMALL_GET_BYTES) and the
first large GET are timed, and the fill goes on when the large GET took fewer seconds than
the small reads it replaces (fill.pays: one per 64 KiB). Object stores charge a round
trip per GET and stream a large range at link speed, so it nearly always pays; the log
says what was measured either way.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .block_cache import BlockCache
from .blocks import BLOCK_BYTES
from .fill import REPLACED_READ_BYTES, FillFile, pays

log = logging.getLogger("croupier.server.cache")

#: Bytes per fill GET: 4 blocks. Large enough that the round trip is a small share of the
#: GET (at 20 ms and 100 MB/s a 4 MiB range is 80% transfer), small enough that a fill's
#: first blocks land soon and a cache that fills up wastes little.
FILL_GET_BYTES = 4 * BLOCK_BYTES
#: Fill GETs in flight per dataset: 64 MiB on the wire, beside the samples' GETs. The real
#: suite's S3 text case (1 GB, loopback server at 20 ms, alternating runs): 33,974-34,389
#: rows/s with 16 (the fill over before the steady window), 15,832-25,599 with 8,
#: 7,971-8,285 with 4.
OBJECT_FILL_IN_FLIGHT = 16
#: The small GETs timed for the rule: a sample's read.
SMALL_GET_BYTES = 4096


class ObjectChanged(Exception):
    """A fill GET was answered by another version of the object (its ETag differs)."""

    def __init__(self, path: str, etag: str):
        super().__init__(f"{path}: ETag now {etag}")
        self.path, self.etag = path, etag


class ObjectFill:
    """One object-store dataset's fill: a task on the event loop of its first read."""

    def __init__(self, cache: BlockCache, name: str, files: list[FillFile], store: Any,
                 closed: Callable[[], bool], on_changed: Callable[[str, str], None]):
        self.cache, self.name, self.files, self.store = cache, name, files, store  # store: an ObjectStore
        self.closed, self.on_changed = closed, on_changed
        self.filled = 0
        self.full = False
        self.started_at = 0.0
        self.done = threading.Event()
        self.task: asyncio.Task | None = None
        self.where = f"{store.url('')} ({store.endpoint})"

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.run(), name=f"croupier-fill-{self.name}")

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def _stopped(self) -> bool:
        return self.full or self.cache.closed or self.closed()

    async def run(self) -> None:
        try:
            for f in self.files:
                if self._stopped():
                    break
                try:
                    await self._fill_file(f)
                except ObjectChanged as changed:
                    self.on_changed(changed.path, changed.etag)
        except Exception as exc:  # a fill is an optimisation: reads go on without it
            log.warning("cache: fill of dataset %s stopped: %s", self.name, exc)
        finally:
            if self.started_at:
                secs = time.perf_counter() - self.started_at
                log.info("cache: fill of dataset %s ended: %d bytes in %.2f s (%.1f MB/s)%s", self.name, self.filled,
                         secs, self.filled / max(secs, 1e-9) / 1e6, "; the cache is full" if self.full else "")
            self.done.set()

    def _gets(self, f: FillFile) -> list[tuple[int, int]]:
        """(first block, blocks) of each fill GET: runs of blocks not cached yet, cut at
        FILL_GET_BYTES."""
        per_get = FILL_GET_BYTES // BLOCK_BYTES
        out: list[tuple[int, int]] = []
        for b in range(f.key.blocks()):
            if self.cache.cached(f.key, b):
                continue
            if out and out[-1][0] + out[-1][1] == b and out[-1][1] < per_get:
                out[-1] = (out[-1][0], out[-1][1] + 1)
            else:
                out.append((b, 1))
        return out

    async def _fill_file(self, f: FillFile) -> None:
        gets = self._gets(f)
        if not gets:
            return
        if not self.started_at:
            self.started_at = time.perf_counter()
            log.info("cache: fill of dataset %s started (%d object(s), %d bytes)", self.name, len(self.files),
                     sum(x.key.size for x in self.files))
        mode, where = self.cache.sizes.fill, self.where
        if mode == "auto" and where not in self.cache.fill_pays:
            self.cache.fill_pays[where] = await self._trial(f, gets.pop(0))
        if mode == "never" or (mode == "auto" and not self.cache.fill_pays[where]):
            return
        pending: set[asyncio.Task] = set()
        try:
            for first, count in gets:
                if self._stopped():
                    break
                if len(pending) >= OBJECT_FILL_IN_FLIGHT:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for t in done:
                        t.result()
                pending.add(asyncio.ensure_future(self._get(f, first, count)))
            for t in asyncio.as_completed(pending):
                await t
        finally:
            for t in pending:
                t.cancel()

    async def _trial(self, f: FillFile, get: tuple[int, int]) -> bool:
        """Time two small GETs and one large one on this store; decide by fill.pays."""
        t = time.perf_counter()
        for offset in (0, max(0, f.key.size // 2)):
            await self.store.read(f.path, offset, SMALL_GET_BYTES)
        l0 = (time.perf_counter() - t) / 2
        t = time.perf_counter()
        length = await self._get(f, *get)
        large_s = time.perf_counter() - t
        ok = pays(large_s, l0, length or BLOCK_BYTES)
        log.info("cache: %s fill from %s: a %d KiB GET took %.1f ms against %d small GETs of %.2f ms",
                 "a" if ok else "no", self.where, length >> 10, large_s * 1e3,
                 max(1, length // REPLACED_READ_BYTES), l0 * 1e3)
        return ok

    async def _get(self, f: FillFile, first: int, count: int) -> int:
        """One fill GET of blocks [first, first + count); keeps them; bytes read."""
        start = first * BLOCK_BYTES
        end = min(f.key.size, start + count * BLOCK_BYTES)
        data, etag = await self.store.get_with_etag(f.path, start, end)
        if (etag and f.key.etag and etag != f.key.etag) or len(data) != end - start:
            raise ObjectChanged(f.path, etag or f"size changed ({len(data)} of {end - start} bytes at {start})")
        for b in range(first, first + count):
            if self._stopped():
                break
            a = b * BLOCK_BYTES - start
            block = bytes(data[a:a + f.key.block_length(b)])
            if await self.cache.run_io(self.cache.store_block, f.key, b, block):
                self.filled += len(block)
            else:
                self.full = True
        return end - start
