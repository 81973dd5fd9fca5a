"""Files a dataset reads whole and does not pin (ImageFolder images), cached whole.

A file is keyed as a pinned one is (blocks.FileKey: real path, size, mtime), checked on
every read, hits included: the name resolved (realpath), which must lie under the
dataset's roots (its confined store's), then stat'ed, on the store's threads. No read and
no open: on a FUSE mount the kernel answers from its attribute cache. A name swapped for a
link out of the roots is therefore refused by the dataset's own read as before, and a
file rewritten or replaced is another key (the log says so). Its bytes are admitted only
from the dataset's own read of it (the confined store's checked open), whole, and only
when their length is the size the stat saw: the cache serves a file only to a dataset
whose roots hold its real path, and only bytes a confined read returned. Admission is the
pinned subset's: whole files into memory while the budget has room, then to the disk
tier, then none.

On a local file system none of this happens (`plan`: the page cache is the cache there,
and the per-read check would cost more than the read), unless `--cache-fill always`.

The fill (`start_fill`): the dataset's files read whole in listing order, FILL_FILES at once
on the store's own read path, from the dataset's first read on, on any mount that is not
local (FUSE, NFS): a whole-file read is the very read an epoch makes, made once and early.
`--cache-fill` always / never overrides.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..storage.readpath import LOCAL_FILE_SYSTEMS, mount_of
from .block_cache import BlockCache
from .blocks import BLOCK_BYTES, FileKey

log = logging.getLogger("croupier.server.cache")

#: Whole-file reads a fill keeps in flight: a FUSE mount takes 12 background requests by
#: default and an image is one or a few; 32 keep a raised mount busy too.
FILL_FILES = 32


def _under(real: str, roots: Sequence[str]) -> bool:
    return any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots)


class WholeFiles:
    """One dataset's files read whole: their keys, hits, admissions, and the fill."""

    def __init__(self, inner: Any, cache: BlockCache, name: str):
        self.inner, self.cache, self.name = inner, cache, name
        self.roots: tuple[str, ...] | None = getattr(inner, "roots", None)  # a ConfinedStore's; None: unconfined
        self._keys: dict[str, FileKey] = {}
        self._planned: list[str] = []
        self.fill_started = False
        self.fill_task: asyncio.Task | None = None
        self.fill_done = threading.Event()
        self.filled = 0
        self.closed = False
        #: A local file system's files go straight to the store (`plan` decides, at open).
        self.bypass = False

    # ---- keys ----------------------------------------------------------------------------
    def _key_of(self, path: str) -> FileKey | None:
        """The version the name points at now, if it lies under the roots (blocking)."""
        real = os.path.realpath(path)
        if self.roots is not None and not _under(real, self.roots):
            return None  # the dataset's own read refuses it, with its error
        try:
            st = os.stat(real)
        except OSError:
            return None
        return FileKey(real, st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None

    async def key(self, path: str) -> FileKey | None:
        """The version `path` names now, checked on every read (a stat on the store's
        threads: no read, no open); None when it is outside the roots or no file."""
        key = await self.inner.pool.submit(self._key_of, path)
        old = self._keys.get(path)
        if key is not None and key != old:
            self._keys[path] = key
            self.cache.register(key, self.inner.url(path), scan_disk=False)
            if old is not None:
                self.cache.release(old)
        return key

    # ---- reads ---------------------------------------------------------------------------
    async def read(self, path: str, counted: bool = True) -> bytes:
        """The whole file: from a tier when cached, else read by the dataset's store and kept."""
        key = await self.key(path)
        if key is not None:
            data = self.cache.from_memory(key, 0, key.size) if key.size else None
            if data is None and key.size and self.cache.on_disk(key, 0, key.size):
                got = await self.cache.run_io(self.cache.read_disk, key, [(0, key.size)])
                data = got[0] if got is not None else None
            if data is not None:
                if counted:
                    self.cache.stats.hits += 1
                    self.cache.stats.hit_bytes += len(data)
                return data
        data = await self.inner.read(path, 0, -1)
        if counted:
            self.cache.stats.misses += 1
            self.cache.stats.miss_bytes += len(data)
        if key is not None and len(data) == key.size and key.size:
            await self._admit(key, data, wait=not counted)
        return data

    async def _admit(self, key: FileKey, data: bytes, wait: bool) -> bool:
        """Keep a whole file: in memory while the budget has room (all of it or none), else
        on disk. A direct read does not wait for the disk write; a fill does (its pace)."""
        memory = self.cache.memory
        if memory.reserve(key.size):
            for b in range(key.blocks()):
                start, length = b * BLOCK_BYTES, key.block_length(b)
                memory.admit(key.version_id, b, data[start:start + length] if key.blocks() > 1 else data, length)
            return True
        disk = self.cache.disk
        if disk is None or not disk.writing:
            return False
        job = asyncio.get_running_loop().run_in_executor(self.cache.io, self._to_disk, key, data)
        return await job if wait else True

    def _to_disk(self, key: FileKey, data: bytes) -> bool:
        return all(self.cache.store_block(key, b, data[b * BLOCK_BYTES:b * BLOCK_BYTES + key.block_length(b)])
                   for b in range(key.blocks()))

    # ---- the fill ------------------------------------------------------------------------
    def plan(self, paths: Sequence[str]) -> None:
        """The dataset's files in listing order: what its fill reads. Called at open (blocking,
        off the loop): on a local file system, unless `--cache-fill always`, the files are not
        cached at all. The kernel's page cache already serves them, and the key check every
        read needs (a realpath and a stat on the store's threads) cost more than the read:
        measured on ext4, 6,000 images of 64x64, 2.0-2.5x fewer samples/s and 1.9x the
        server's CPU with it, even with every image in memory."""
        self._planned = list(paths)
        if not self._planned or self.cache.sizes.fill == "always":
            return
        try:
            mount = mount_of(os.stat(self._planned[0]).st_dev)
        except OSError:  # gone since the listing: the read will say so; cache as elsewhere
            return
        if mount.fs_type in LOCAL_FILE_SYSTEMS:
            self.bypass = True
            log.info("cache: files of dataset %s not cached: %s (%s) is a local file system, the kernel's page "
                     "cache serves its reads", self.name, mount.point, mount.fs_type)

    def start_fill(self) -> None:
        """At the dataset's first whole-file read: its fill, if it planned one."""
        if self.fill_started:
            return
        self.fill_started = True
        if not self._planned or self.cache.sizes.fill == "never":
            self.fill_done.set()
            return
        self.fill_task = asyncio.get_running_loop().create_task(self._fill(), name=f"croupier-fill-{self.name}")

    async def _pays(self) -> bool:
        if self.cache.sizes.fill == "always":
            return True
        dev = (await self.inner.pool.submit(os.stat, self._planned[0])).st_dev
        if dev not in self.cache.fill_pays:
            mount = mount_of(dev)
            local = mount.fs_type in LOCAL_FILE_SYSTEMS
            self.cache.fill_pays[dev] = not local
            log.info("cache: %s whole-file fill on %s (%s)%s", "no" if local else "a", mount.point, mount.fs_type,
                     ": a local file system, the kernel's page cache serves its reads" if local else "")
        return self.cache.fill_pays[dev]

    async def _fill(self) -> None:
        t = time.perf_counter()
        try:
            if not await self._pays():
                return
            log.info("cache: whole-file fill of dataset %s started (%d files)", self.name, len(self._planned))
            todo = iter(self._planned)
            full = asyncio.Event()

            async def worker() -> None:
                for path in todo:
                    if full.is_set() or self.closed or self.cache.closed:
                        return
                    key = await self.key(path)
                    if key is None or self.cache.cached(key, 0):
                        continue
                    data = await self.inner.read(path, 0, -1)
                    if len(data) == key.size and key.size:
                        if await self._admit(key, data, wait=True):
                            self.filled += len(data)
                        else:
                            full.set()

            await asyncio.gather(*(worker() for _ in range(FILL_FILES)))
            secs = time.perf_counter() - t
            log.info("cache: whole-file fill of dataset %s ended: %d bytes in %.2f s (%.1f MB/s)%s", self.name,
                     self.filled, secs, self.filled / max(secs, 1e-9) / 1e6, "; the cache is full" if full.is_set() else "")
        except Exception as exc:  # a fill is an optimisation: reads go on without it
            log.warning("cache: whole-file fill of dataset %s stopped: %s", self.name, exc)
        finally:
            self.fill_done.set()

    def close(self) -> None:
        """The dataset closed: its files' memory blocks leave with their last reader."""
        self.closed = True
        for key in self._keys.values():
            self.cache.release(key)
        self._keys.clear()
