"""A store's file as a Python binary file object, for libraries that want one
(tarfile scanning a shard's headers, pyarrow reading a footer) at open time."""

from __future__ import annotations

import io

from .base import Store


class StoreRawFile(io.RawIOBase):
    """Seekable, read-only; every `readinto` is one blocking range read on the store."""

    def __init__(self, store: Store, path: str, size: int | None = None):
        self.store = store
        self.path = path
        self.size = store.size(path) if size is None else size
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(base + offset, 0)
        return self.pos

    def readinto(self, buffer) -> int:  # type: ignore[override]
        want = min(len(buffer), self.size - self.pos)
        if want <= 0:
            return 0
        data = self.store.read_range(self.path, self.pos, want)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def open_store_file(store: Store, path: str, buffer_size: int = 1 << 20) -> io.BufferedReader:
    """A buffered binary file over `path` of `store`: sequential reads take `buffer_size`
    bytes a range read."""
    return io.BufferedReader(StoreRawFile(store, path), buffer_size=buffer_size)
