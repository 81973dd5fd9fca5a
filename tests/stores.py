"""Test stores: a LocalStore seen through a wrapper whose async reads a test can hold."""

from __future__ import annotations

from croupier.server.storage import LocalStore, Store
from croupier.server.storage.base import FileEntry


class WrappedStore(Store):
    """Everything is `inner`'s (a LocalStore); subclasses override `_read`/`_read_ranges`."""

    scheme = "file"

    def __init__(self, inner: LocalStore):
        super().__init__()
        self.inner = inner

    def url(self, path: str) -> str:
        return self.inner.url(path)

    def join(self, base: str, *parts: str) -> str:
        return self.inner.join(base, *parts)

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def is_file(self, path: str) -> bool:
        return self.inner.is_file(path)

    def is_dir(self, path: str) -> bool:
        return self.inner.is_dir(path)

    def list_dir(self, path: str) -> tuple[list[str], list[FileEntry]]:
        return self.inner.list_dir(path)

    def _read_range(self, path: str, offset: int, size: int) -> bytes:
        return self.inner._read_range(path, offset, size)

    async def _read(self, path: str, offset: int, size: int) -> bytes:
        return await self.inner._read(path, offset, size)

    def close(self) -> None:
        self.inner.close()
