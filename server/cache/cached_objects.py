"""An object-store dataset's store (s3://) seen through the server's cache.

As `CachedStore` for files, with two differences: an object is keyed by its URL, size and
ETag (one HEAD when the dataset pins it, at open), and the fill is large range GETs on
the event loop (object_fill.py). A rewritten object has another ETag: a dataset opened on
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

log = logging.getLogger("croupier.server.cache")


class CachedObjectStore(CachedStore):
    """`inner` is an ObjectStore (shared by every dataset of its bucket: never closed here)."""

    def __init__(self, inner: Any, cache: Any, name: str = ""):
        super().__init__(inner, cache, name, owns_inner=False)

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
