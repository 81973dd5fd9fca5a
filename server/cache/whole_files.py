"""Files a dataset reads whole and does not pin (ImageFolder images), cached whole.

A file is keyed as a pinned one is (blocks.FileKey: real path, size, mtime), from the very
read that returned its bytes: the store's native thread opens the file (checked under the
dataset's roots, as any read of it is), fstat's it, reads it whole and fstat's it again, so
the key names the file those bytes came from (a file that changed while it was read is not
kept). A cold read therefore costs what it costs without the cache. A read of a name
already cached first asks which file the name leads to now: an O_PATH open on a native
thread (the name resolved and checked under the roots, the file stat'ed; no open or read
on the file system); the same file (device, inode, size, mtime) is served from its tier,
another is a miss, keyed anew (the log says so). A group of names (an ImageFolder's
`start_reads`: `submit_files`) is asked by one call and read by one more. A name swapped for a link out of the
roots is therefore refused by the dataset's own read as before. On a FUSE mount of an
object store (rclone, s3fs, ...: storage/mounts.py) that question is a request to the
bucket each (through s3fs, the second epoch of 6,000 JPEGs made 144 images/s asking it),
so there a cached name is served as its first read found it, as an `s3://` dataset trusts
its listing at open: a file rewritten in the bucket meanwhile is seen when the dataset is
opened again. Its bytes are still those of a file its confined read reached. Admission is the pinned
subset's: whole files into memory while the budget has room (all of a file or none), then
to the disk tier, then none. While a fill runs, the fill and an epoch wanting the same
file share one read.

On a local file system none of this happens (`plan`: the page cache is the cache there,
and holding its files twice would buy nothing), unless `--cache-fill always`.

No fill by default: each file is kept by the epoch's read that wants it, which is the very
read a fill would make (a whole file is as large a read as there is). `--cache-fill always`
adds the fill (`start_fill`): the dataset's files read whole in listing order, FILL_FILES
at once on the store's own read path, from the dataset's first read on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..storage.base import FileVersion
from ..storage.mounts import object_store_mount_client
from ..storage.readpath import LOCAL_FILE_SYSTEMS, mount_of
from .block_cache import BlockCache
from .blocks import BLOCK_BYTES, FileKey

log = logging.getLogger("croupier.server.cache")

#: Whole-file reads a fill keeps in flight: a FUSE mount takes 12 background requests by
#: default and an image is one or a few; 32 keep a raised mount busy too.
FILL_FILES = 32


def _under(real: str, roots: tuple[frozenset[str], tuple[str, ...]]) -> bool:
    """`real` is one of the roots or lies under one (`_roots`' form: one C call each)."""
    return real in roots[0] or real.startswith(roots[1])


def _roots(roots: Sequence[str]) -> tuple[frozenset[str], tuple[str, ...]]:
    return frozenset(roots), tuple(r.rstrip("/") + "/" for r in roots)


async def from_tiers(cache: BlockCache, key: FileKey) -> bytes | None:
    """A whole file (or object) cached under `key`: from memory, else from the disk tier."""
    data = cache.from_memory(key, 0, key.size) if key.size else None
    if data is None and key.size and cache.on_disk(key, 0, key.size):
        got = await cache.run_io(cache.read_disk, key, [(0, key.size)])
        data = got[0] if got is not None else None
    return data


async def admit(cache: BlockCache, key: FileKey, data: bytes, wait: bool) -> bool:
    """Keep a whole file (or object): in memory while the budget has room (all of it or
    none), else on disk. A direct read does not wait for the disk write; a fill does (its
    pace)."""
    if to_memory(cache, key, data):
        return True
    disk = cache.disk
    if disk is None or not disk.writing:
        return False
    job = asyncio.get_running_loop().run_in_executor(cache.io, _to_disk, cache, key, data)
    return await job if wait else True


def to_memory(cache: BlockCache, key: FileKey, data: bytes) -> bool:
    """Keep a whole file in memory if the budget has room for all of it (else nothing)."""
    memory = cache.memory
    if 0 < key.size <= BLOCK_BYTES:  # one block (an image): one admission, one lock
        return memory.try_admit(key.version_id, 0, data) or memory.has(key.version_id, 0)
    if not memory.reserve(key.size):
        return False
    for b in range(key.blocks()):
        start, length = b * BLOCK_BYTES, key.block_length(b)
        memory.admit(key.version_id, b, data[start:start + length] if key.blocks() > 1 else data, length)
    return True


def _to_disk(cache: BlockCache, key: FileKey, data: bytes) -> bool:
    return all(cache.store_block(key, b, data[b * BLOCK_BYTES:b * BLOCK_BYTES + key.block_length(b)])
               for b in range(key.blocks()))


class WholeFiles:
    """One dataset's files read whole: their keys, hits, admissions, and the fill."""

    def __init__(self, inner: Any, cache: BlockCache, name: str):
        self.inner, self.cache, self.name = inner, cache, name
        roots: tuple[str, ...] | None = getattr(inner, "roots", None)  # a ConfinedStore's; None: unconfined
        self._roots = _roots(roots) if roots is not None else None
        self._versions: dict[str, tuple[FileVersion, FileKey]] = {}  # name -> what it led to when read
        self._reading: dict[str, asyncio.Future[bytes]] = {}  # names being read from storage now
        self._planned: list[str] = []
        self.fill_started = False
        self.fill_task: asyncio.Task | None = None
        self.fill_done = threading.Event()
        self.filled = 0
        self.closed = False
        #: A local file system's files go straight to the store (`plan` decides, at open).
        self.bypass = False
        #: On a FUSE mount of an object store a cached name is served without asking which file
        #: it leads to now (`plan` decides): there that question is a request to the bucket.
        self.trust_first_read = False

    # ---- versions and keys ------------------------------------------------------------------
    def _keyed(self, path: str, version: FileVersion | None) -> FileKey | None:
        """Remember the version `path` led to; its cache key (None: no one version to keep,
        or outside the roots)."""
        if version is None or version.size < 0:
            return None
        if self._roots is not None and not _under(version.real, self._roots):
            return None  # the dataset's own read refuses it, with its error
        key = FileKey(version.real, version.size, version.mtime_ns)
        old = self._versions.get(path)
        if old is None or old[1] != key:
            self._versions[path] = (version, key)
            self.cache.register(key, functools.partial(self.inner.url, path), scan_disk=False)
            if old is not None:
                self.cache.release(old[1])
        return key

    async def _cached_key(self, path: str) -> FileKey | None:
        """The key of the file `path` names now, if a tier may hold it. Only a name read
        before (or any, with a disk tier kept from an earlier run) is looked up, with one
        O_PATH open on a native thread (no open or read on the file system): a cold read
        costs no more than without the cache."""
        known = self._versions.get(path)
        if known is None and self.cache.disk is None:
            return None
        if known is not None and not self.cache.cached(known[1], 0):
            return None
        if known is not None and self.trust_first_read:
            return known[1]
        version = await self.inner.version(path)
        if version is None:
            return None
        if known is not None and known[0].same_file(version):
            return known[1]
        key = self._keyed(path, version)  # another file now (the log says so), or first seen
        return key if key is not None and self.cache.cached(key, 0) else None

    # ---- reads ---------------------------------------------------------------------------
    async def read(self, path: str, counted: bool = True) -> bytes:
        """The whole file: from a tier when cached, else read by the dataset's store and kept."""
        data = None
        if path in self._versions or self.cache.disk is not None:  # else not cached: no lookup at all
            key = await self._cached_key(path)
            data = await from_tiers(self.cache, key) if key is not None else None
        if data is not None:
            if counted:
                self.cache.stats.hits += 1
                self.cache.stats.hit_bytes += len(data)
            return data
        data, _ = await self._read_once(path, wait=not counted)
        if counted:
            self.cache.stats.misses += 1
            self.cache.stats.miss_bytes += len(data)
        return data

    def submit(self, path: str, callback: Callable[[bytes | None, BaseException | None], None]) -> bool:
        """`read` without a task or a coroutine: a callback chain (which file the name leads
        to now, then a hit from memory or a read from storage, kept as `read` keeps it),
        counted as `read` counts. False where `read` must be awaited: a disk tier (its reads
        run on the cache's threads), a fill running (reads shared with it), or a store
        without callback reads."""
        if self.cache.disk is not None or (self.fill_task is not None and not self.fill_task.done()):
            return False
        known = self._versions.get(path)
        if known is None or not self.cache.cached(known[1], 0):  # not cached: no lookup at all
            return self._submit_miss(path, callback)
        if self.trust_first_read:  # its first read's version, on the loop's next turn as a lookup's would land
            asyncio.get_running_loop().call_soon(self._identified, path, known, callback, known[0])
            return True
        return self.inner.submit_version(path, functools.partial(self._identified, path, known, callback))

    def submit_files(self, paths: Sequence[str], callback: Callable[[list[tuple[int, Any, BaseException | None]]], None]) -> bool:
        """`submit` for a group of files with one storage call each way: cached names asked
        which file they lead to now by one `submit_versions` (on a mount of an object store,
        served as their first read found them, without asking), served from memory, on the
        loop's next turn, together; the rest, and those whose file changed, read by the
        store's `submit_files` and kept as `read` keeps them, handed over as they land. False
        where `submit` must do it file by file: a disk tier or a fill running (as `submit`),
        or a store without these calls."""
        if self.cache.disk is not None or (self.fill_task is not None and not self.fill_task.done()):
            return False
        hits: list[tuple[int, Any, BaseException | None]] = []
        misses: list[int] = []
        lookups: list[int] = []
        for i, path in enumerate(paths):
            known = self._versions.get(path)
            if known is None or not self.cache.cached(known[1], 0):
                misses.append(i)
            elif not self.trust_first_read:
                lookups.append(i)
            else:
                self._hit(i, known[1], hits, misses)
        # Nothing is started until the first storage call is taken (a store without these
        # calls, such as the Python pool's: False, and the group goes file by file).
        if misses and not self._read_group(paths, misses, callback):
            return False
        if lookups and not self.inner.submit_versions([paths[i] for i in lookups],
                                                      functools.partial(self._looked_up, paths, lookups, callback)):
            if not misses:
                return False
            for i in lookups:  # the misses are in flight: these go file by file
                self._submit_one(paths[i], i, callback)
        self._hand_hits(hits, callback)
        return True

    def _hit(self, i: int, key: FileKey, hits: list, misses: list[int]) -> None:
        data = self.cache.from_memory(key, 0, key.size) if key.size else None
        if data is None:
            misses.append(i)
        else:
            hits.append((i, data, None))

    def _count_hits(self, hits: list[tuple[int, Any, BaseException | None]]) -> None:
        stats = self.cache.stats
        stats.hits += len(hits)
        stats.hit_bytes += sum(len(h[1]) for h in hits)

    def _hand_hits(self, hits: list[tuple[int, Any, BaseException | None]], callback: Callable) -> None:
        """Hits counted, and handed over on the loop's next turn, as a lookup's would land."""
        if hits:
            self._count_hits(hits)
            asyncio.get_running_loop().call_soon(callback, hits)

    def _read_group(self, paths: Sequence[str], positions: list[int], callback: Callable) -> bool:
        return self.inner.submit_files([paths[i] for i in positions], True,
                                       functools.partial(self._files_landed, paths, positions, callback))

    def _submit_one(self, path: str, i: int, callback: Callable) -> None:
        """One file of a group by `submit` (else the awaited `read`), handed over by its position."""
        def one(data: bytes | None, err: BaseException | None) -> None:
            callback([(i, data, err)])

        if not self.submit(path, one):
            self._read_later(path, one)

    def _looked_up(self, paths: Sequence[str], lookups: list[int], callback: Callable,
                   done: list[tuple[int, FileVersion | None]]) -> None:
        """Which files a group's cached names lead to now, known: those still the same file
        served from memory; the rest (another file now: the log says so; or gone) read."""
        hits: list[tuple[int, Any, BaseException | None]] = []
        misses: list[int] = []
        for j, version in done:
            i = lookups[j]
            path = paths[i]
            known = self._versions.get(path)
            if version is not None and known is not None and known[0].same_file(version):
                self._hit(i, known[1], hits, misses)
                continue
            key = self._keyed(path, version) if version is not None else None  # another file now
            if key is not None and self.cache.cached(key, 0):
                self._hit(i, key, hits, misses)
            else:
                misses.append(i)
        if misses and not self._read_group(paths, misses, callback):
            for i in misses:
                self._submit_one(paths[i], i, callback)
        if hits:  # on the loop already: handed over now
            self._count_hits(hits)
            callback(hits)

    def _files_landed(self, paths: Sequence[str], misses: list[int], callback: Callable,
                      done: list[tuple[int, Any, BaseException | None]]) -> None:
        """Files of a `submit_files` group read from storage: each kept as `_read_landed`
        keeps one, then handed over by its position in the group."""
        callback([(misses[j], None, err) if got is None else (misses[j], self._kept(paths[misses[j]], *got), None)
                  for j, got, err in done])

    def _identified(self, path: str, known: tuple[FileVersion, FileKey], callback: Callable, version: FileVersion | None) -> None:
        """Which file a cached name leads to now, known: serve it from memory, or read it."""
        key = None
        if version is not None and known[0].same_file(version):
            key = known[1]
        elif version is not None:
            key = self._keyed(path, version)  # another file now (the log says so)
        data = self.cache.from_memory(key, 0, key.size) if key is not None and key.size else None
        if data is None:
            if not self._submit_miss(path, callback):
                self._read_later(path, callback)
            return
        self.cache.stats.hits += 1
        self.cache.stats.hit_bytes += len(data)
        callback(data, None)

    def _submit_miss(self, path: str, callback: Callable) -> bool:
        return self.inner.submit_whole_versioned(path, functools.partial(self._read_landed, path, callback))

    def _read_landed(self, path: str, callback: Callable, got: tuple[bytes, FileVersion | None] | None,
                     err: BaseException | None) -> None:
        if got is None:
            callback(None, err)
            return
        callback(self._kept(path, *got), None)

    def _kept(self, path: str, data: bytes, version: FileVersion | None) -> bytes:
        """What a callback read of `path` returned, kept and counted as a miss; its bytes."""
        key = self._to_keep(path, data, version)
        if key is not None:
            to_memory(self.cache, key, data)  # no disk tier on this path: memory or nothing
        stats = self.cache.stats
        stats.misses += 1
        stats.miss_bytes += len(data)
        return data

    def _read_later(self, path: str, callback: Callable) -> None:
        """The awaited `read`, for a store that looked a name up by callback but reads only
        by coroutine (none of the server's: kept for a store that would)."""
        def landed(task: asyncio.Task[bytes]) -> None:
            exc = asyncio.CancelledError() if task.cancelled() else task.exception()
            callback(None, exc) if exc is not None else callback(task.result(), None)

        asyncio.get_running_loop().create_task(self.read(path)).add_done_callback(landed)

    async def _read_once(self, path: str, wait: bool) -> tuple[bytes, bool | None]:
        """`path` read from storage and admitted (True), refused for want of room (False),
        or not admitted (None: no version to keep, or another read of it admits). While a fill
        runs, one read of a file at a time: a read that finds one in flight (the fill's, or
        the epoch's) takes its bytes."""
        shared = self._reading.get(path)
        if shared is not None:
            return (await asyncio.shield(shared)), None
        if self.fill_task is None or self.fill_task.done():  # nothing else reads files ahead: no one to share with
            data, version = await self.inner.read_whole_versioned(path)
            return data, await self._keep(path, data, version, wait)
        mine: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._reading[path] = mine
        try:
            data, version = await self.inner.read_whole_versioned(path)
            mine.set_result(data)
        except BaseException as exc:
            if isinstance(exc, Exception):
                mine.set_exception(exc)
                mine.exception()  # retrieved: no waiter is no error
            else:
                mine.cancel()
            raise
        finally:
            self._reading.pop(path, None)
        return data, await self._keep(path, data, version, wait)

    async def _keep(self, path: str, data: bytes, version: FileVersion | None, wait: bool) -> bool | None:
        """Admit what a read of `path` returned (see `_read_once`)."""
        key = self._to_keep(path, data, version)
        return None if key is None else await admit(self.cache, key, data, wait)

    def _to_keep(self, path: str, data: bytes, version: FileVersion | None) -> FileKey | None:
        """The key to admit what a read of `path` returned under (None: nothing to keep)."""
        key = self._keyed(path, version)
        if key is None or len(data) != key.size or not key.size or self.cache.cached(key, 0):
            return None
        return key

    # ---- the fill ------------------------------------------------------------------------
    def plan(self, paths: Sequence[str]) -> None:
        """The dataset's files in listing order: what its fill reads. Called at open (blocking,
        off the loop): on a local file system, unless `--cache-fill always`, the files are not
        cached at all: the kernel's page cache already serves them (bench/results/cache_local.md)."""
        self._planned = list(paths)
        if not self._planned or self.cache.sizes.fill == "always":
            return
        try:
            mount = mount_of(os.stat(self._planned[0]).st_dev, self._planned[0])
        except OSError:  # gone since the listing: the read will say so; cache as elsewhere
            return
        if mount.fs_type in LOCAL_FILE_SYSTEMS:
            self.bypass = True
            log.info("cache: files of dataset %s not cached: %s (%s) is a local file system, the kernel's page "
                     "cache serves its reads", self.name, mount.point, mount.fs_type)
            return
        client = object_store_mount_client(self._planned[0])
        if client is not None:
            self.trust_first_read = True
            log.info("cache: dataset %s lies on a %s mount of an object store: a cached file is served as its first "
                     "read found it, without asking the mount again (a request to the bucket each), as an s3:// "
                     "dataset trusts its listing; a file rewritten in the bucket is read anew when the dataset "
                     "is opened again", self.name, client)

    def start_fill(self) -> None:
        """At the dataset's first whole-file read: its fill, with `--cache-fill always` only.
        By default each file is kept by the epoch's read that wants it: a fill ahead reads
        the very same files one read each (a whole file is the largest read there is), and
        on a 2-core server over FUSE its reads beside the epoch's cost the cold epoch 10-20%
        of its samples/s and bought the next epoch nothing (server/cache/README.md)."""
        if self.fill_started:
            return
        self.fill_started = True
        if not self._planned or self.cache.sizes.fill != "always":
            if self._planned and self.cache.sizes.fill == "auto":
                log.info("cache: no whole-file fill of dataset %s: each of its %d files is kept by the first read "
                         "that wants it (--cache-fill always reads them all ahead)", self.name, len(self._planned))
            self.fill_done.set()
            return
        self.fill_task = asyncio.get_running_loop().create_task(self._fill(), name=f"croupier-fill-{self.name}")

    async def _fill(self) -> None:
        t = time.perf_counter()
        try:
            log.info("cache: whole-file fill of dataset %s started (%d files)", self.name, len(self._planned))
            todo = iter(self._planned)
            full = asyncio.Event()

            async def worker() -> None:
                for path in todo:
                    if full.is_set() or self.closed or self.cache.closed:
                        return
                    if path in self._reading or await self._cached_key(path) is not None:
                        continue  # being read (its read admits it), or cached
                    data, admitted = await self._read_once(path, wait=True)
                    if admitted:
                        self.filled += len(data)
                    elif admitted is False:
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
        for _, key in self._versions.values():
            self.cache.release(key)
        self._versions.clear()
