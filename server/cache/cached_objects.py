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

import logging
from typing import Any

from .blocks import FileKey
from .cached_store import CachedStore
from .fill import FillFile
from .object_fill import ObjectFill
from .whole_files import admit, from_tiers

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
        key = self._whole.get(path)
        if key is None:
            listed = (getattr(self.inner, "listed", None) or {}).get(path)
            if listed is not None:
                key = self._whole[path] = FileKey.of_object(self.inner.url(path), *listed)
                self.cache.register(key, key.real_path, scan_disk=False)
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
        if key is not None and key.size and len(data) == key.size and not self.cache.cached(key, 0):
            await admit(self.cache, key, data, wait=False)
        return data

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
