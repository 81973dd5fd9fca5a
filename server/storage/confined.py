"""A dataset's view of the local file system that never reads outside its roots.

Every file a dataset touches goes through its store: listings, metadata files
(state.json, classes.txt), tar shards, Arrow and Parquet files, images. A
`ConfinedStore` wraps the server's LocalStore for one dataset and checks each of them
against the dataset's roots:

* At open (listings, `is_file`, `size`): a path, and every symlink a folder listing
  shows, is resolved (realpath) and must lie under a root, else ConfinementError.
* On read: the check is made on the file actually opened, not on its name. The file
  is opened, and the kernel's own name for the open file (/proc/self/fd/N) must lie
  under a root; only then is it read, through that same descriptor. A symlink or a
  folder swapped after the check therefore cannot redirect the read. Files read row
  by row (Arrow, Parquet, tar shards) are opened and checked once, when the dataset is
  pinned, and read through that descriptor for the dataset's life; other files
  (images, metadata) are opened and checked on each read.

What is not guaranteed: a hard link inside a root to a file elsewhere on the same file
system is the same file, and is served (hard links cannot be told from the original;
do not give writers of the data folders links to files they cannot read). Without
/proc (not Linux), the read-time check resolves the name before opening, which a
swap in between can race. Messages say which member is outside, never where it
points, and never echo file bytes.
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from collections.abc import Callable, Sequence
from typing import Any

from .base import FileEntry, FileVersion, Range, Store
from . import native
from .local import LocalStore, _pread_all, path_version, read_whole_versioned_fd, scandir_names
from .inline_files import InlineFiles
from .native import roots_blob

#: Linux: the kernel's path of an open descriptor, authoritative after symlinks.
_PROC_FD = "/proc/self/fd"
_HAVE_PROC = os.path.isdir(_PROC_FD)
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)


class ConfinementError(Exception):
    """A file resolves outside the store's roots. Not an OSError: readers must never
    take it for an unreadable file (the server raises readers.MemberOutsideRootsError)."""


def under(real: str, roots: Sequence[str]) -> bool:
    """`real` (a resolved path) is one of `roots` or inside one."""
    for root in roots:
        if real == root or real.startswith(root if root.endswith("/") else root + "/"):
            return True
    return False


def dataset_roots(path: str, data_roots: Sequence[str]) -> tuple[str, ...]:
    """The roots a dataset at `path` is confined to: the server's data roots when there
    are any; else the dataset's own folder (a file's: the folder holding it)."""
    if data_roots:
        return tuple(os.path.realpath(r) for r in data_roots)
    real = os.path.realpath(path)
    return (real if os.path.isdir(real) else os.path.dirname(real),)


class ConfinedStore(Store):
    """`inner` (the server's LocalStore), restricted to files under `roots`."""

    def __init__(self, inner: LocalStore, roots: Sequence[str], raise_error: Callable[[str], Exception] | None = None,
                 folders: Sequence[str] = ()):
        super().__init__()
        self.inner = inner
        self.scheme = inner.scheme
        self.stats = inner.stats  # the reads are the inner store's: counted once
        self.roots = tuple(os.path.realpath(r) for r in roots)
        self._error = raise_error or ConfinementError
        self._pins: set[str] = set()  # paths this dataset pinned, their descriptor checked
        # The native pool checks the file it opened itself (where /proc tells it): reads of
        # unpinned files (images) stay on GIL-free threads.
        self._native = inner.native if _HAVE_PROC else None
        self._roots_blob = roots_blob(self.roots)
        # Small cached files under the roots read on the loop (images on a local disk), also
        # by the names the dataset gives them (`folders`: its path as given, a link maybe).
        self._inline = InlineFiles(tuple(dict.fromkeys((*self.roots, *folders))),
                                   enabled=bool(getattr(inner, "inline", False)) and self._native is not None)

    def __getattr__(self, name: str) -> Any:  # pool, native, threads...: the inner store's
        return getattr(self.inner, name)

    # ---- checks -------------------------------------------------------------------------
    def _outside(self, path: str) -> Exception:
        return self._error(f"{path} is outside the dataset's roots (a link to a file elsewhere?)")

    def check(self, path: str) -> str:
        """`path`, if it resolves under a root (it may not exist yet); else the error."""
        if not under(os.path.realpath(path), self.roots):
            raise self._outside(path)
        return path

    def _check_fd(self, fd: int, path: str) -> None:
        """The open file `fd` (opened by `path`) lies under a root and is a regular file."""
        real = os.readlink(f"{_PROC_FD}/{fd}") if _HAVE_PROC else os.path.realpath(path)
        if not under(real, self.roots):
            raise self._outside(path)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError(f"{path} is not a regular file")

    def _open(self, path: str) -> int:
        fd = os.open(path, _OPEN_FLAGS)
        try:
            self._check_fd(fd, path)
            if _OPEN_FLAGS & getattr(os, "O_NONBLOCK", 0):  # O_NONBLOCK only kept a FIFO from blocking the open
                os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _pread_checked(self, path: str, offset: int, size: int) -> bytes:
        fd = self._open(path)
        try:
            return _pread_all(fd, offset, size)
        finally:
            os.close(fd)

    def _preads_checked(self, path: str, ranges: Sequence[Range]) -> list[bytes]:
        fd = self._open(path)
        try:
            return [_pread_all(fd, o, s) for o, s in ranges]
        finally:
            os.close(fd)

    # ---- naming and open time -----------------------------------------------------------
    def url(self, path: str) -> str:
        return self.inner.url(path)

    def join(self, base: str, *parts: str) -> str:
        return self.inner.join(base, *parts)

    def size(self, path: str) -> int:
        return self.inner.size(self.check(path))

    def is_file(self, path: str) -> bool:
        return self.inner.is_file(self.check(path))

    def is_dir(self, path: str) -> bool:
        return self.inner.is_dir(self.check(path))

    def list_dir(self, path: str) -> tuple[list[str], list[FileEntry]]:
        """As LocalStore's, refusing a listing that shows a link to outside the roots (a
        plain entry of a folder under a root is under it: only links are resolved)."""
        self.check(path)
        dirs, files = [], []
        with os.scandir(path) as it:
            for e in it:
                if e.is_symlink():
                    self.check(e.path)
                if e.is_dir():
                    dirs.append(e.name)
                elif e.is_file():
                    files.append(FileEntry(e.path, e.stat().st_size))
        return sorted(dirs), sorted(files, key=lambda f: f.path)

    def list_names(self, path: str) -> tuple[list[str], list[str]]:
        """As `list_dir` (links checked against the roots), by name only: no stat per file."""
        return scandir_names(self.check(path), on_link=self.check)

    def _read_range(self, path: str, offset: int, size: int) -> bytes:
        if path in self._pins:
            return self.inner._read_range(path, offset, size)
        return self._pread_checked(path, offset, size)

    def pin(self, path: str) -> None:
        """Open `path` once for the dataset's life, and check the file opened."""
        self.check(path)
        self.inner.pin(path)
        try:
            fd = self.inner.pinned_fd(path)
            assert fd is not None
            self._check_fd(fd, path)
        except BaseException:
            self.inner.unpin(path)
            raise
        self._pins.add(path)

    def unpin(self, path: str) -> None:
        if path in self._pins:
            self._pins.discard(path)
            self.inner.unpin(path)

    # ---- the hot path ---------------------------------------------------------------------
    async def read(self, path: str, offset: int, size: int) -> bytes:
        if path in self._pins:
            return await self.inner.read(path, offset, size)
        return await super().read(path, offset, size)

    async def read_ranges(self, path: str, ranges: Sequence[Range]) -> list[bytes]:
        if path in self._pins:
            return await self.inner.read_ranges(path, ranges)
        return await super().read_ranges(path, ranges)

    def submit_ranges(self, path: str, ranges: Sequence[Range], callback) -> bool:
        if path in self._pins:
            return self.inner.submit_ranges(path, ranges, callback)
        return False  # the caller awaits read_ranges, which checks the file it opens

    def submit_rows(self, path: str, rows: Sequence[Sequence[Range]], callback) -> bool:
        if path in self._pins:
            return self.inner.submit_rows(path, rows, callback)
        return False

    def submit_whole(self, path: str, callback: Callable[..., None]) -> bool:
        """The file read whole without a task: opened, checked under the roots and read by
        a native thread, as `read` does; False where that is not how it is read."""
        return self._start_whole(path, callback, versioned=False)

    def submit_whole_versioned(self, path: str, callback: Callable[..., None]) -> bool:
        return self._start_whole(path, callback, versioned=True)

    def _start_whole(self, path: str, callback: Callable[..., None], versioned: bool) -> bool:
        if path in self._pins or self._native is None:
            return False
        native.start_whole(self._native, self.stats, path, self._roots_blob, callback, versioned, self._native_error)
        return True

    def submit_files(self, paths: Sequence[str], versioned: bool, callback: Callable[..., None]) -> bool:
        """Files read whole by one call, each opened, checked under the roots and read by a
        native thread, as `submit_whole` reads one; those a local disk's page cache holds read
        on the loop instead (inline_files.py), checked the same way."""
        if self._native is None or not paths or any(p in self._pins for p in paths):
            return False
        now = native.start_files(self._native, self.stats, paths, self._roots_blob, versioned, callback,
                                 self._native_error, self._inline)
        if now:
            self.inner.inline_reads += now
        return True

    def submit_versions(self, paths: Sequence[str], callback: Callable[..., None]) -> bool:
        if self._native is None or not paths:
            return False
        native.start_identities(self._native, paths, self._roots_blob, callback)
        return True

    def submit_version(self, path: str, callback: Callable[[FileVersion | None], None]) -> bool:
        if self._native is None:
            return False
        native.start_identify(self._native, path, self._roots_blob, callback)
        return True

    async def _read(self, path: str, offset: int, size: int) -> bytes:
        if self._native is not None:
            return await self._native_read(path, offset, size)
        return await self.inner.pool.submit(self._pread_checked, path, offset, size)

    async def _native_read(self, path: str, offset: int, size: int) -> bytes:
        assert self._native is not None
        try:
            return await self._native.pread_path(path, offset, size, self._roots_blob)
        except OSError as exc:
            raise self._native_error(exc, path) from None

    def _native_error(self, exc: OSError, path: str) -> Exception:
        if exc.errno == errno.EXDEV:  # the native check: the file opened is outside
            return self._outside(path)
        if exc.errno == errno.EISDIR:
            return IsADirectoryError(f"{path} is not a regular file")
        return exc

    async def _read_whole_versioned(self, path: str) -> tuple[bytes, FileVersion | None]:
        if path in self._pins:
            return await self.inner._read_whole_versioned(path)
        if self._native is None:
            return await self.inner.pool.submit(self._whole_checked, path)
        try:
            return native.whole_result(await self._native.read_whole(path, self._roots_blob))
        except OSError as exc:
            raise self._native_error(exc, path) from None

    def _whole_checked(self, path: str) -> tuple[bytes, FileVersion]:
        fd = self._open(path)
        try:
            return read_whole_versioned_fd(fd, path)
        finally:
            os.close(fd)

    async def version(self, path: str) -> FileVersion | None:
        """Which file `path` names now, if it lies under the roots; None otherwise (outside,
        gone, no file: the dataset's own read then says which)."""
        try:
            if self._native is not None:
                return native.identify_result(await self._native.identify(path, self._roots_blob))
            return await self.inner.pool.submit(path_version, path, lambda real: under(real, self.roots))
        except OSError:
            return None

    async def _read_ranges(self, path: str, ranges: Sequence[Range]) -> list[bytes]:
        if self._native is not None:
            return list(await asyncio.gather(*(self._native_read(path, o, s) for o, s in ranges)))
        return await self.inner.pool.submit(self._preads_checked, path, ranges)

    def close(self) -> None:
        self._inline.close()
        for path in list(self._pins):
            self.unpin(path)
