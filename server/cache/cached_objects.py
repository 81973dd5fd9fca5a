"""An object-store dataset's store (s3://) seen through the server's cache.

As `CachedStore` for files, with two differences: an object is keyed by its URL, size and
ETag (one HEAD when the dataset pins it, at open; for objects read whole, an image folder's,
the size and ETag its listing at open showed: no request per object), and the fill is
large range GETs on the event loop (object_fill.py). A rewritten object has another ETag: a dataset opened on
it is another key (the earlier version's blocks are dropped, and the log names the object);
an object rewritten while its dataset is open is seen by the fill's GETs, whose answers
carry the ETag: its blocks are dropped, it is read from the store from then on, and the
log names it once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..storage.object_groups import Landed
from .blocks import FileKey
from .cached_store import CachedStore
from .fill import FillFile
from .object_fill import ObjectFill
from .whole_files import admit, from_tiers, to_memory

log = logging.getLogger("croupier.server.cache")


class CachedObjectStore(CachedStore):
    """`inner` is an ObjectStore (shared by every dataset of its bucket: never closed here)."""

    def __init__(self, inner: Any, cache: Any, name: str = ""):
        super().__init__(inner, cache, name, owns_inner=False)
        self._whole: dict[str, FileKey] = {}  # objects read whole -> the version their listing showed
        if getattr(inner, "listed", {}) is None:
            inner.listed = {}  # the bucket's listings keep each object's version from now on

    async def read(self, path: str, offset: int, size: int) -> bytes:
        if offset == 0 and size < 0 and path not in self._keys:
            return await self._read_whole(path)
        return await super().read(path, offset, size)

    async def _read_whole(self, path: str) -> bytes:
        """An object read whole (an image): from a tier when cached, else by one GET and
        kept, under the version the dataset's listing showed. An object listed by no
        listing is read and not kept. Not seen: an object rewritten after the open (as for
        pinned objects, the samples' GETs carry no ETag check)."""
        key = self._whole_key(path)
        stats = self.cache.stats
        if key is not None and key.size:
            data = await from_tiers(self.cache, key)
            if data is not None:
                stats.hits += 1
                stats.hit_bytes += len(data)
                return data
        data = await self.inner.read(path, 0, -1)
        stats.misses += 1
        stats.miss_bytes += len(data)
        if self._keeps(key, data):
            await admit(self.cache, key, data, wait=False)  # type: ignore[arg-type]
        return data

    def _keeps(self, key: FileKey | None, data: bytes) -> bool:
        """What a read of an object returned is kept: under its listing's version, all of it,
        not held already."""
        return key is not None and key.size > 0 and len(data) == key.size and not self.cache.cached(key, 0)

    def _whole_key(self, path: str) -> FileKey | None:
        """The version an object read whole is cached under: its listing's (None: listed by
        no listing, so read and not kept)."""
        key = self._whole.get(path)
        if key is None:
            listed = (getattr(self.inner, "listed", None) or {}).get(path)
            if listed is not None:
                key = self._whole[path] = FileKey.of_object(self.inner.url(path), *listed)
                self.cache.register(key, key.real_path, scan_disk=False)
        return key

    @property
    def reads_files_in_groups(self) -> bool:
        return self.cache.disk is None and self.inner.reads_files_in_groups

    def submit_files(self, paths: Sequence[str], versioned: bool, callback: Callable[[Landed], None]) -> bool:
        """Objects read whole by one call (a group of images), as `_read_whole` reads one:
        those the memory tier holds handed over on the loop's next turn, together; the rest
        read by the store's `submit_files` (a GET each on the loop) and kept. False where
        `_read_whole` must do it (a disk tier, whose reads and writes run on threads; a
        pinned object; a store without the call)."""
        if versioned or self.cache.disk is not None or any(p in self._keys for p in paths):
            return False
        keys = [self._whole_key(p) for p in paths]
        hits: Landed = []
        misses: list[int] = []
        memory = self.cache.from_memory
        for i, key in enumerate(keys):
            data = memory(key, 0, key.size) if key is not None and key.size else None
            if data is None:
                misses.append(i)
            else:
                hits.append((i, data, None))
        if misses and not self.inner.submit_files([paths[i] for i in misses], False,
                                                  functools.partial(self._objects_landed, keys, misses, callback)):
            return False
        if hits:
            stats = self.cache.stats
            stats.hits += len(hits)
            stats.hit_bytes += sum(len(d) for _, d, _ in hits)
            asyncio.get_running_loop().call_soon(callback, hits)
        return True

    def _objects_landed(self, keys: list[FileKey | None], misses: list[int], callback: Callable[[Landed], None],
                        done: Landed) -> None:
        """Objects of a group read from the store: kept in memory where the budget has room
        (as `_read_whole` keeps them), counted as misses, handed over by their positions."""
        stats = self.cache.stats
        out: Landed = []
        for j, data, err in done:
            i = misses[j]
            out.append((i, data, err))
            if err is not None:
                continue
            stats.misses += 1
            stats.miss_bytes += len(data)
            if self._keeps(keys[i], data):
                to_memory(self.cache, keys[i], data)  # type: ignore[arg-type]  # no disk tier on this path
        callback(out)

    def forget_whole_files(self) -> None:
        """The dataset closed: its objects' memory blocks leave with their last reader."""
        listed = getattr(self.inner, "listed", None) or {}
        for path, key in self._whole.items():
            self.cache.release(key)
            listed.pop(path, None)  # a dataset opened again lists again
        self._whole.clear()

    def close(self) -> None:
        self.forget_whole_files()
        super().close()

    def pin(self, path: str) -> None:
        """Key the object by the version a HEAD sees now (its size, its ETag)."""
        self.inner.pin(path)
        if path in self._keys:
            return
        size, etag = self.inner.version(path)
        key = FileKey.of_object(self.inner.url(path), size, etag)
        self.cache.register(key, key.real_path)
        self._keys[path] = key
        self._order.append(path)

    def _make_fill(self, files: list[FillFile]) -> ObjectFill:
        return ObjectFill(self.cache, self.name, files, self.inner, lambda: self._closed or not self._keys,
                          self._changed)

    def _changed(self, path: str, etag: str) -> None:
        """A fill GET saw another version of `path`: stop caching it, drop what is cached."""
        key = self._keys.pop(path, None)
        if key is None:
            return
        self._order.remove(path)
        dropped = self.cache.forget(key)
        log.warning("cache: %s changed while dataset %s was open (ETag %s when opened, %s now): dropped %d cached "
                    "block(s); it is read from the store from now on", key.real_path, self.name, key.etag or "none",
                    etag, dropped)
