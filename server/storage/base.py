"""The one interface every storage backend implements: range reads, many in flight.

Formats (server/readers) say *what* to read, as (path, offset, size) ranges; a store
says *how*: it issues the reads concurrently, counts them, and hands back bytes. A
store never knows what a row or an image is. Two halves, as in Arrow's RandomAccessFile
and object_store's `get_range`:

* open-time calls (`size`, `read_range`, `list_files`, `list_dir`, `list_names`) are blocking: the
  catalog opens datasets in an executor, and reads metadata once there;
* the hot path, `read` / `read_ranges`, is async: each call is a real read on the
  storage (a pread, a range GET), awaited on the event loop while hundreds to
  thousands of others are in flight. Nothing waits on storage on the loop itself.

Paths are the store's own: absolute file-system paths for `LocalStore`, object keys
for object stores. `url(path)` turns one back into what a user wrote, for messages.
Missing files raise FileNotFoundError; other failures OSError (or a subclass).
"""

from __future__ import annotations

import abc
import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class FileEntry:
    """A file (object) of a store: its path in the store and its size in bytes."""

    path: str
    size: int


class FileVersion(NamedTuple):
    """Which file a name led to, as the read that opened it saw it: its resolved path,
    device, inode, size and mtime (size -1: it changed while it was read, so the bytes
    read are no one version of it). The cache's key for a file read whole."""

    real: str
    dev: int
    ino: int
    size: int
    mtime_ns: int

    def same_file(self, other: "FileVersion") -> bool:
        """The same file, unchanged (a name swapped for another file, or the file
        rewritten, differs in one of these)."""
        return (self.dev, self.ino, self.size, self.mtime_ns) == (other.dev, other.ino, other.size, other.mtime_ns)


class StoreStats:
    """What a store has done: reads issued and bytes returned, and reads in flight.

    Async reads are counted on the event loop's thread only, so their counters are
    plain ints (a lock per read cost more than the rest of the bookkeeping); blocking
    reads (open time, executor threads) are counted apart, under a lock. The public
    figures add both.
    """

    __slots__ = ("_reads", "_bytes", "_in_flight", "_max", "_errors", "_blocking", "_lock")

    def __init__(self) -> None:
        self._reads = self._bytes = self._in_flight = self._max = self._errors = 0
        self._blocking = [0, 0, 0, 0, 0]  # reads, bytes, in flight, max in flight, errors
        self._lock = threading.Lock()

    def started(self, count: int = 1) -> None:
        """An async read began (event loop thread)."""
        self._reads += count
        self._in_flight += count
        if self._in_flight > self._max:
            self._max = self._in_flight

    def finished(self, nbytes: int, count: int = 1, ok: bool = True) -> None:
        self._in_flight -= count
        self._bytes += nbytes
        if not ok:
            self._errors += count

    def blocking_started(self) -> None:
        with self._lock:
            b = self._blocking
            b[0] += 1
            b[2] += 1
            b[3] = max(b[3], b[2])

    def blocking_finished(self, nbytes: int, ok: bool) -> None:
        with self._lock:
            b = self._blocking
            b[1] += nbytes
            b[2] -= 1
            if not ok:
                b[4] += 1

    @property
    def reads(self) -> int:
        return self._reads + self._blocking[0]

    @property
    def bytes(self) -> int:
        return self._bytes + self._blocking[1]

    @property
    def in_flight(self) -> int:
        return self._in_flight + self._blocking[2]

    @property
    def max_in_flight(self) -> int:
        return max(self._max, self._blocking[3])

    @property
    def errors(self) -> int:
        return self._errors + self._blocking[4]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "reads": self.reads,
                "bytes": self.bytes,
                "in_flight": self.in_flight,
                "max_in_flight": self.max_in_flight,
                "errors": self.errors,
            }


Range = tuple[int, int]  # (offset, size)


class Store(abc.ABC):
    """Range reads on one file system or bucket. Subclasses implement the `_` methods;
    the public ones count every read in `stats`."""

    #: URL scheme, e.g. "file" or "s3".
    scheme: str = ""

    def __init__(self) -> None:
        self.stats = StoreStats()

    # ---- naming -------------------------------------------------------------------
    @abc.abstractmethod
    def url(self, path: str) -> str:
        """`path` as a user would write it (/data/x.arrow, s3://bucket/x.arrow)."""

    @abc.abstractmethod
    def join(self, base: str, *parts: str) -> str:
        """A path under `base` (parts use '/' separators)."""

    # ---- open time (blocking) -----------------------------------------------------
    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Bytes in the file at `path`; FileNotFoundError when there is none."""

    @abc.abstractmethod
    def is_file(self, path: str) -> bool: ...

    @abc.abstractmethod
    def is_dir(self, path: str) -> bool:
        """A folder (for object stores: some object has the prefix `path/`)."""

    @abc.abstractmethod
    def list_dir(self, path: str) -> tuple[list[str], list[FileEntry]]:
        """One level of folder `path`: (names of subfolders, files), each sorted by name."""

    def list_names(self, path: str) -> tuple[list[str], list[str]]:
        """One level of folder `path` by name only: (subfolder names, file names), each
        sorted. A file system answers it from the directory listing alone (names and
        types), where `list_dir`'s sizes cost a stat per file: on a FUSE mount of a
        bucket, one request per file (rclone: a HEAD each)."""
        dirs, files = self.list_dir(path)
        return dirs, [f.path.rsplit("/", 1)[-1] for f in files]

    def list_files(self, path: str) -> list[FileEntry]:
        """Every file under folder `path`, at any depth, sorted by path."""
        dirs, files = self.list_dir(path)
        out = list(files)
        for d in dirs:
            out.extend(self.list_files(self.join(path, d)))
        return sorted(out, key=lambda f: f.path)

    def read_range(self, path: str, offset: int, size: int) -> bytes:
        """`size` bytes at `offset` (fewer at the end of the file), blocking."""
        self.stats.blocking_started()
        ok, data = False, b""
        try:
            data = self._read_range(path, offset, size)
            ok = True
            return data
        finally:
            self.stats.blocking_finished(len(data), ok)

    def read_file(self, path: str) -> bytes:
        """The whole file, blocking (metadata files: state.json, indexes)."""
        return self.read_range(path, 0, self.size(path))

    @abc.abstractmethod
    def _read_range(self, path: str, offset: int, size: int) -> bytes: ...

    # ---- the hot path (async) -----------------------------------------------------
    async def read(self, path: str, offset: int, size: int) -> bytes:
        """`size` bytes at `offset` of `path` (fewer at the end of the file); a real read
        on the storage, concurrent with every other read in flight. size -1: to the end."""
        self.stats.started()
        ok, data = False, b""
        try:
            data = await self._read(path, offset, size)
            ok = True
            return data
        finally:
            self.stats.finished(len(data), ok=ok)

    async def read_whole_versioned(self, path: str) -> tuple[bytes, FileVersion | None]:
        """The whole file and which version of it these bytes are, from the very read
        that returned them (None: this store cannot say); counted as one read."""
        self.stats.started()
        ok, data = False, b""
        try:
            data, version = await self._read_whole_versioned(path)
            ok = True
            return data, version
        finally:
            self.stats.finished(len(data), ok=ok)

    async def version(self, path: str) -> FileVersion | None:
        """Which file `path` names now, without reading it (None: this store cannot
        say); not a read."""
        return None

    async def _read_whole_versioned(self, path: str) -> tuple[bytes, FileVersion | None]:
        return await self._read(path, 0, -1), None

    async def read_ranges(self, path: str, ranges: Sequence[Range]) -> list[bytes]:
        """Several ranges of one file at once (a store may coalesce neighbours)."""
        n = len(ranges)
        self.stats.started(n)
        ok, got = False, 0
        try:
            parts = await self._read_ranges(path, ranges)
            got = sum(len(p) for p in parts)
            ok = True
            return parts
        finally:
            self.stats.finished(got, count=n, ok=ok)

    def pin(self, path: str) -> None:
        """A hint that `path` will be read often (a table's file): keep it open if that
        helps. Blocking; a no-op by default."""

    def unpin(self, path: str) -> None:
        """Undo one `pin` of `path` (the dataset is closed)."""

    def submit_ranges(
        self, path: str, ranges: Sequence[Range], callback: "Callable[[list[bytes] | None, BaseException | None], None]"
    ) -> bool:
        """`read_ranges` without a coroutine or a future, for the hot path: start the reads
        and call `callback(parts, None)` on the loop when all have landed, or
        `callback(None, error)`; counted like `read_ranges`. False when this store has no
        such path (then await `read_ranges`)."""
        return False

    def submit_rows(
        self, path: str, rows: "Sequence[Sequence[Range]]",
        callback: "Callable[[list[tuple[int, list[bytes] | None, BaseException | None]]], None]",
    ) -> bool:
        """The ranges of several rows (each a list of ranges of `path`) started at once, each
        row handed over as soon as its own ranges have landed: `callback([(row, parts,
        None) | (row, None, error), ...])` on the loop, once per wake-up with the rows done
        since the last call, so every row is named exactly once over the calls; counted
        like `read_ranges`. Where reads land at different times (slow storage), a group's
        rows go on at their own read's pace, at the Python cost of a group. False when this
        store has no such path (then `submit_ranges` or `read_ranges`)."""
        return False

    def submit_whole(self, path: str, callback: "Callable[[bytes | None, BaseException | None], None]") -> bool:
        """`read(path, 0, -1)` without a coroutine or a future (a file read whole: an image):
        `callback(data, None)` or `callback(None, error)` on the loop; counted like `read`.
        False when this store has no such path (then await `read`)."""
        return False

    def submit_whole_versioned(
        self, path: str, callback: "Callable[[tuple[bytes, FileVersion | None] | None, BaseException | None], None]"
    ) -> bool:
        """`read_whole_versioned` the same way: `callback((data, version), None)` or
        `callback(None, error)`. False: await `read_whole_versioned`."""
        return False

    @property
    def reads_files_in_groups(self) -> bool:
        """Whether `submit_files` takes groups here (a reader starts groups only where it does):
        a file system's native pool, an object store's direct GETs."""
        return self.scheme == "file"

    def submit_files(
        self, paths: Sequence[str], versioned: bool,
        callback: Callable[[list[tuple[int, Any, BaseException | None]]], None],
    ) -> bool:
        """Several files read whole, started by one call (a group of images): `callback(done)`
        on the loop once per wake-up with the files landed since the last call, each
        (position, bytes, None) (versioned: (position, (bytes, FileVersion | None), None)) or
        (position, None, error), so that every file is named exactly once over the calls;
        counted like `read`. False when this store has no such path (then `submit_whole`)."""
        return False

    def submit_versions(self, paths: Sequence[str], callback: Callable[[list[tuple[int, FileVersion | None]]], None]) -> bool:
        """`submit_version` for several names by one call: `callback([(position, version or
        None), ...])` on the loop once per wake-up with those answered since the last call.
        False: `submit_version` each."""
        return False

    def held_in_memory(self, path: str) -> bool:
        """Every byte of `path` is in this store's memory (the server's cache tier): its
        reads land at once, as a local file's do (readers then read in groups)."""
        return False

    def held_ranges(self, path: str, ranges: Sequence[Range]) -> list[bytes] | None:
        """The bytes of `ranges` of `path` right now, without a callback, when this store's
        memory holds every one of them (counted as `read_ranges` would count them); else
        None, and nothing counted. Why: once a table is held in memory, a group's reads
        need no completion at all (readers/arrow_ipc.py)."""
        return None

    def submit_version(self, path: str, callback: "Callable[[FileVersion | None], None]") -> bool:
        """`version` the same way: `callback(version or None)` on the loop. False: await `version`."""
        return False

    @abc.abstractmethod
    async def _read(self, path: str, offset: int, size: int) -> bytes: ...

    async def _read_ranges(self, path: str, ranges: Sequence[Range]) -> list[bytes]:
        return list(await asyncio.gather(*(self._read(path, o, s) for o, s in ranges)))

    def close(self) -> None:
        """Release files, threads and connections."""


class ForwardingStore(Store):
    """A store seen through another (`inner`): naming and open-time calls are the inner
    store's, as are its reads until a subclass says otherwise (the server's cache; tests'
    wrappers that hold reads)."""

    def __init__(self, inner: Store):
        super().__init__()
        self.inner = inner
        self.scheme = inner.scheme

    def url(self, path: str) -> str:
        return self.inner.url(path)

    @property
    def reads_files_in_groups(self) -> bool:
        return self.inner.reads_files_in_groups

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

    def list_names(self, path: str) -> tuple[list[str], list[str]]:
        return self.inner.list_names(path)

    def _read_range(self, path: str, offset: int, size: int) -> bytes:
        return self.inner._read_range(path, offset, size)

    def held_in_memory(self, path: str) -> bool:
        return self.inner.held_in_memory(path)

    async def _read(self, path: str, offset: int, size: int) -> bytes:
        return await self.inner._read(path, offset, size)
