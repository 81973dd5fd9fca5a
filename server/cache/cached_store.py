"""A dataset's store seen through the server's cache.

`CachedStore` wraps the dataset's own store (its ConfinedStore: the confinement checks run
before anything is cached, and the cache keys on the real path that store opened). Files
the dataset pins (tables, Parquet files, tar shards: read by range for its whole life)
are cached by block; files read whole (images) are cached whole (whole_files.py); any
other read (metadata) goes to the inner store as it is.
A read whose blocks are all cached never touches storage; a read that needs a missing
block goes to storage at once, never waiting for a fill. Storage reads are counted in the
inner store's stats (what the storage served); lookups in the cache's.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from typing import Any

from ..storage.base import ForwardingStore, Range, Store
from .block_cache import BlockCache
from .blocks import FileKey
from .fill import DatasetFill, FillFile, FillSource
from .whole_files import WholeFiles


class CachedStore(ForwardingStore):
    def __init__(self, inner: Store, cache: BlockCache, name: str = "", owns_inner: bool = True):
        super().__init__(inner)
        self.cache = cache
        self.name = name
        self.stats = inner.stats  # storage reads, counted once
        self._owns_inner = owns_inner
        self._keys: dict[str, FileKey] = {}  # pinned path -> the version opened
        self._order: list[str] = []
        self._fill: Any = None  # a DatasetFill, or an ObjectFill
        #: Files read whole and not pinned (images): a file system's only (whole_files.py).
        self.whole = WholeFiles(inner, cache, name) if inner.scheme == "file" else None
        self._closed = False

    def __getattr__(self, name: str) -> Any:  # pool, native, read_paths...: the inner store's
        return getattr(self.inner, name)

    # ---- naming and open time: the inner store's (ForwardingStore) -----------------------
    def read_range(self, path: str, offset: int, size: int) -> bytes:
        return self.inner.read_range(path, offset, size)

    def pin(self, path: str) -> None:
        """Pin in the inner store (its checks), then key the file it opened."""
        self.inner.pin(path)
        fd = getattr(self.inner, "pinned_fd", lambda p: None)(path)
        if fd is None or path in self._keys:
            return
        key = FileKey.of_fd(fd)
        self.cache.register(key, self.inner.url(path))
        self._keys[path] = key
        self._order.append(path)

    def unpin(self, path: str) -> None:
        key = self._keys.pop(path, None)
        if key is not None:
            self._order.remove(path)
            self.cache.release(key)
        self.inner.unpin(path)

    def held_in_memory(self, path: str) -> bool:
        """A pinned file whose every block the memory tier holds (filled, or read whole)."""
        key = self._keys.get(path)
        return key is not None and self.cache.whole_in_memory(key)

    def held_ranges(self, path: str, ranges: Sequence[Range]) -> list[bytes] | None:
        key = self._keys.get(path)
        if key is None or not self.cache.memory.resident:
            return None
        parts = self._lookup(key, ranges)
        if None in parts:
            return None
        self._count(parts)
        return parts  # type: ignore[return-value]

    def key_of(self, path: str) -> FileKey | None:
        """The cached version of a pinned file (None: not pinned, read straight through)."""
        return self._keys.get(path)

    # ---- the hot path --------------------------------------------------------------------
    def _lookup(self, key: FileKey, ranges: Sequence[Range]) -> list[bytes | None]:
        if not self.cache.memory.resident:
            return [None] * len(ranges)
        return [self.cache.from_memory(key, o, s) for o, s in ranges]

    def _count(self, parts: Sequence[bytes | None], missing_bytes: int = 0) -> None:
        st = self.cache.stats
        for p in parts:
            if p is None:
                st.misses += 1
            else:
                st.hits += 1
                st.hit_bytes += len(p)
        st.miss_bytes += missing_bytes

    async def read(self, path: str, offset: int, size: int) -> bytes:
        if self.whole is not None and not self.whole.bypass and offset == 0 and size < 0 and path not in self._keys:
            self.whole.start_fill()
            return await self.whole.read(path)
        return (await self.read_ranges(path, [(offset, size)]))[0]

    def submit_whole(self, path: str, callback: Callable[..., None]) -> bool:
        """`read(path, 0, -1)` without a task: through the whole-file cache (whole_files.py),
        or straight to the inner store where files are not cached (a local disk). False
        where `read` must be awaited (a pinned file, an object store's cache)."""
        if self.whole is None or path in self._keys:
            return False
        if self.whole.bypass:
            return self.inner.submit_whole(path, callback)
        self.whole.start_fill()
        return self.whole.submit(path, callback)

    def submit_files(self, paths: Sequence[str], versioned: bool, callback: Callable[..., None]) -> bool:
        """Files read whole by one call (a group of images), through the whole-file cache as
        `submit_whole` reads one (unversioned only: the cache keeps the versions)."""
        if self.whole is None or versioned or any(p in self._keys for p in paths):
            return False
        if self.whole.bypass:
            return self.inner.submit_files(paths, False, callback)
        self.whole.start_fill()
        return self.whole.submit_files(paths, callback)

    def plan_whole_files(self, paths: Sequence[str]) -> None:
        """The files the dataset reads whole, in listing order (its fill reads them)."""
        if self.whole is not None:
            self.whole.plan(paths)

    def forget_whole_files(self) -> None:
        """The dataset closed: its whole files' memory blocks leave with their last reader."""
        if self.whole is not None:
            self.whole.close()

    async def read_ranges(self, path: str, ranges: Sequence[Range]) -> list[bytes]:
        key = self._keys.get(path)
        if key is None:
            return await self.inner.read_ranges(path, ranges) if len(ranges) != 1 else [await self.inner.read(path, *ranges[0])]
        self._start_fill()
        parts = self._lookup(key, ranges)
        missing = [i for i, p in enumerate(parts) if p is None]
        on_disk = [i for i in missing if self.cache.on_disk(key, *ranges[i])]
        if on_disk:
            got = await self.cache.run_io(self.cache.read_disk, key, [ranges[i] for i in on_disk])
            if got is not None:  # else a block failed its check: those ranges go to storage
                for i, data in zip(on_disk, got):
                    parts[i] = data
                self.cache.stats.disk_hits += len(on_disk)
                missing = [i for i in missing if parts[i] is None]
        self._count(parts)
        if missing:
            want = [ranges[i] for i in missing]
            got = await self.inner.read_ranges(path, want)
            self.cache.stats.miss_bytes += sum(len(g) for g in got)
            for i, (o, _), data in zip(missing, want, got):
                parts[i] = data
                self.cache.admit_read(key, o, data)
        return parts  # type: ignore[return-value]

    def submit_ranges(self, path: str, ranges: Sequence[Range], callback: Callable[..., None]) -> bool:
        key = self._keys.get(path)
        if key is None:
            return self.inner.submit_ranges(path, ranges, callback)
        self._start_fill()
        if not self.cache.memory.resident and self.cache.disk is None:  # nothing cached: no lists, no closure
            if not self.inner.submit_ranges(path, ranges, callback):
                return False
            self.cache.stats.misses += len(ranges)
            return True
        parts = self._lookup(key, ranges)
        missing = [i for i, p in enumerate(parts) if p is None]
        if not missing:
            self._count(parts)
            asyncio.get_running_loop().call_soon(callback, parts, None)
            return True
        if self.cache.disk is not None and any(self.cache.on_disk(key, *ranges[i]) for i in missing):
            return False  # read_ranges reads the disk tier on the cache's threads

        def landed(got: list[bytes] | None, err: BaseException | None) -> None:
            if err is not None:
                callback(None, err)
                return
            self.cache.stats.miss_bytes += sum(len(g) for g in got)  # type: ignore[union-attr]
            for i, data in zip(missing, got):  # type: ignore[arg-type]
                parts[i] = data
            callback(parts, None)

        if not self.inner.submit_ranges(path, [ranges[i] for i in missing], landed):
            return False  # the caller awaits read_ranges, which counts
        self._count(parts)
        return True

    def submit_rows(self, path: str, rows: Sequence[Sequence[Range]], callback: Callable[..., None]) -> bool:
        """Rows whose every range the memory tier holds are handed over at once (on the
        next turn of the loop, together); the others are read from storage as rows
        (`Store.submit_rows`). False where the disk tier holds some of what is missing."""
        key = self._keys.get(path)
        if key is None:
            return self.inner.submit_rows(path, rows, callback)
        self._start_fill()
        if not self.cache.memory.resident and self.cache.disk is None:  # nothing cached: no lookups
            if not self.inner.submit_rows(path, rows, callback):
                return False
            self.cache.stats.misses += sum(map(len, rows))
            return True
        hits: list[tuple[int, list[bytes] | None, BaseException | None]] = []
        misses: list[int] = []
        found: list[bytes] = []
        for r, ranges in enumerate(rows):
            parts = self._lookup(key, ranges)
            if None in parts:
                misses.append(r)
            else:
                found += parts  # type: ignore[arg-type]
                hits.append((r, parts, None))  # type: ignore[arg-type]
        if misses:
            if self.cache.disk is not None and any(self.cache.on_disk(key, *rng) for r in misses for rng in rows[r]):
                return False  # read_ranges reads the disk tier on the cache's threads
            stats = self.cache.stats

            def landed(done: list[tuple[int, list[bytes] | None, BaseException | None]]) -> None:
                # Back to the caller's row numbers; a missed row's ranges are all read again.
                stats.miss_bytes += sum(sum(map(len, parts)) for _, parts, err in done if err is None)  # type: ignore[arg-type]
                callback([(misses[r], parts, err) for r, parts, err in done])

            if not self.inner.submit_rows(path, [rows[r] for r in misses], landed):
                return False  # the caller reads another way, which counts
        self._count(found)  # a missed row's ranges are all read from storage: misses
        self.cache.stats.misses += sum(len(rows[r]) for r in misses)
        if hits:
            asyncio.get_running_loop().call_soon(callback, hits)
        return True

    async def _read(self, path: str, offset: int, size: int) -> bytes:  # pragma: no cover - read is overridden
        return await self.read(path, offset, size)

    # ---- fill ------------------------------------------------------------------------------
    def _start_fill(self) -> None:
        """The dataset's first read starts its fill (all its files are pinned by then)."""
        if self._fill is not None or self._closed or self.cache.sizes.fill == "never":
            return
        self._fill = self._make_fill([FillFile(p, self._keys[p]) for p in self._order])
        self._fill.start()

    def _make_fill(self, files: list[FillFile]) -> Any:
        """The fill of a file-system dataset: large preads on threads (fill.py)."""
        source = FillSource(self.name, files, self._open_for_fill, self.inner.stats, self._latency_of,
                            lambda: self._closed or not self._keys)
        return DatasetFill(self.cache, source)

    def _open_for_fill(self, path: str) -> int:
        """A descriptor of its own onto the very file the dataset pinned (and its store
        checked), through /proc: its own readahead, no second lookup by name."""
        fd = getattr(self.inner, "pinned_fd", lambda p: None)(path)
        if fd is None:
            raise OSError(f"{self.inner.url(path)} is no longer open")
        proc = f"/proc/self/fd/{fd}"
        return os.open(proc if os.path.exists(proc) else self._keys[path].real_path, os.O_RDONLY | os.O_CLOEXEC)

    def _latency_of(self, dev: int) -> float:
        for choice in getattr(self.inner, "read_paths", lambda: [])():
            if choice.mount.device == dev:
                return float(choice.latency_s)
        return 0.0

    def fill_done(self, timeout: float | None = None) -> bool:
        """Wait for this dataset's fill to end (tests, benchmarks); True when it has."""
        whole = self.whole is None or not self.whole.fill_started or self.whole.fill_done.wait(timeout)
        return whole and (self._fill is None or self._fill.wait(timeout))

    def close(self) -> None:
        self._closed = True
        if self.whole is not None:
            self.whole.close()
        for path in list(self._keys):
            self.unpin(path)
        if self._owns_inner:
            self.inner.close()
