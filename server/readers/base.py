"""The one interface every dataset reader implements.

A read has two halves so that the scheduler can overlap I/O and batch CPU work:

* `read(index)` is the per-sample I/O, awaited concurrently with many others (one call
  on the bounded executor per file read). It returns an opaque *item*: bytes of an image file, a
  one-row Arrow slice, or just the index where the I/O happens later (memory-mapped
  Arrow, whose pages fault in during `encode`).
* `encode(items)` turns the items of samples whose reads have completed into one
  payload for the wire. It is CPU work, runs in the executor, and is called once per
  chunk, never per sample on the event loop.

Readers never import grpc; payloads are plain dataclasses that the service converts.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from ..storage import Store, default_local_store
from ..storage.mounts import ObjectStoreMount

DatasetKind = Literal["table", "image"]


class DatasetError(Exception):
    """A dataset cannot be opened or a sample cannot be read.

    The message names the file and, where known, the row or sample index.
    """


class SampleError(DatasetError):
    """One sample is unreadable (corrupt record, bytes that are not an image)."""

    def __init__(self, message: str, index: int | None = None, path: str | None = None):
        super().__init__(message)
        self.index = index
        self.path = path


class OutsideRootsError(DatasetError, PermissionError):
    """A dataset path resolves outside every configured data root (a PermissionError too)."""


class MemberOutsideRootsError(DatasetError):
    """A file a dataset touches (a member, a link, a listed data file) resolves outside
    the dataset's roots. Not an OSError, so that no reader takes it for a corrupt file;
    the message names the member, never where it points."""


class UnknownColumnError(DatasetError):
    """A requested column is not in the dataset; the message lists the columns it has."""


@dataclass(frozen=True)
class ColumnInfo:
    name: str
    type: str


@dataclass(frozen=True)
class DatasetInfo:
    """What a client may learn about a dataset before streaming it."""

    name: str
    num_rows: int
    kind: DatasetKind
    format: str
    path: str
    columns: tuple[ColumnInfo, ...] = ()
    classes: tuple[str, ...] = ()
    arrow_schema: bytes = b""


@dataclass
class TablePayload:
    """Rows of a table dataset, in the order of the items given to `encode`."""

    arrow_ipc: bytes
    nbytes: int


@dataclass
class ImageRecord:
    data: bytes
    label: int
    format: str
    key: str = ""
    height: int = 0
    width: int = 0
    channels: int = 0


@dataclass
class ImagePayload:
    images: list[ImageRecord] = field(default_factory=list)

    @functools.cached_property
    def nbytes(self) -> int:  # asked by the size check and the metrics: summed once
        return sum(len(r.data) for r in self.images)


Payload = TablePayload | ImagePayload


def item_nbytes(item: Any) -> int:
    """Payload bytes of a read item that holds its data (bytes, a record, a row slice)."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        return len(item)
    if isinstance(item, dict):
        return sum(item_nbytes(v) for v in item.values())
    if isinstance(item, tuple):
        return sum(len(v) for v in item if isinstance(v, bytes))
    nbytes = getattr(item, "nbytes", None)
    return nbytes if isinstance(nbytes, int) else 0


class Reader(abc.ABC):
    """Random access by global index to one dataset, with async reads."""

    #: Short format name, e.g. "arrow", "parquet", "imagefolder".
    format: ClassVar[str]
    #: False when `read` does no I/O at all (the scheduler may then skip the await).
    read_does_io: ClassVar[bool] = True
    #: True when the scheduler should issue reads in groups (`start_reads`): where reads
    #: land at once (a local disk), not where a group's slowest read would hold the rest.
    reads_in_groups: bool = False

    def __init__(
        self, name: str, path: str, executor: concurrent.futures.Executor | None = None, store: Store | None = None
    ):
        self.name = name
        #: Where the dataset is, as the user wrote it (a path or a URL); messages use it.
        self.path = path
        self._executor = executor
        #: The storage every read goes through (the process's LocalStore when not given).
        self.store: Store = store if store is not None else default_local_store()
        #: The FUSE mount of a bucket the dataset lies on, with the URL to serve instead
        #: (storage/mounts.py); set by open_dataset, None elsewhere.
        self.object_store_mount: ObjectStoreMount | None = None

    @property
    def executor(self) -> concurrent.futures.Executor | None:
        return self._executor

    def bind_executor(self, executor: concurrent.futures.Executor) -> None:
        """Use the server's bounded pool for blocking calls (pyarrow, file opens)."""
        self._executor = executor

    async def run_blocking(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def info(self) -> DatasetInfo: ...

    @abc.abstractmethod
    async def read(self, index: int, columns: Sequence[str] = ()) -> Any:
        """Do the I/O of one sample; return an item for `encode`. Raises SampleError.

        `columns` are those the stream will encode (all when empty): a table reader
        reads only their bytes; other readers ignore it."""

    @abc.abstractmethod
    def encode(self, items: Sequence[Any], columns: Sequence[str] = (), decode_images: bool = False) -> Payload:
        """Build one payload from completed items (blocking: runs in the executor, or on the
        loop where `encodes_on_loop` says it is less work than the hop)."""

    def encodes_on_loop(self, decode_images: bool, nbytes: int) -> bool:
        """True where encoding a chunk of about `nbytes` is too little work to be worth a
        hop to the executor and back (images sent as read: one record each; a small chunk
        of table rows); the stream then calls `encode` on the loop. A hop costs the loop
        and a pool thread two wake-ups each (about 170 us of CPU on a 2-core KVM guest)."""
        return False

    def item_sizer(self, columns: Sequence[str] = ()) -> Callable[[Any], int]:
        """item -> the bytes it adds to a chunk of `columns` (an estimate is fine).

        The scheduler flushes chunks and bounds a stream's buffered bytes with it, so
        it must not say 0 for an item that is just an index (see IndexReader).
        """
        return item_nbytes

    def start_read(self, index: int, columns: Sequence[str], done: Callable[[Any, BaseException | None], None]) -> bool:
        """Optional fast path: begin the read of `index` without a coroutine and call
        `done(item, error)` when it completes (possibly at once). False (the default)
        means it was not started: await `read` instead. The scheduler uses it to avoid
        a task per sample."""
        return False

    def start_reads(
        self, indices: Sequence[int], columns: Sequence[str],
        done: Callable[[list[tuple[int, Any, BaseException | None]]], None],
    ) -> Sequence[int]:
        """Optional fast path for a group of reads: begin those of `indices` it can with
        one storage call per file and call `done(results)` once per such call (and once
        for rows known without a read, possibly at once), each result (position in
        `indices`, item, error). Returns the positions it did not start (the default:
        all), which the scheduler reads one by one. What a group costs in Python is then
        paid once per group, not once per sample; its samples complete together."""
        return range(len(indices))

    #: True when `warm` can make rows `start_reads` left cold startable as a group.
    warms: bool = False

    async def warm(self, indices: Sequence[int], columns: Sequence[str]) -> None:
        """Optional: load at once what `start_reads` lacked to start the rows `indices` it
        left cold (a table's structural pages), so that the scheduler starts them again as
        a group instead of one read each. Errors are left to each row's own `read`, which
        names them (only where `warms`)."""

    def read_now(self, index: int) -> Any:
        """The item of `index` without awaiting: only for readers whose read does no I/O."""
        raise NotImplementedError(f"{type(self).__name__} reads do I/O: await read()")

    def read_later(self, index: int) -> tuple[float, Callable[[int], Any]] | None:
        """Optional fast path: (seconds to wait, fetch) for a read that is a pure wait
        followed by a cheap synchronous fetch(index). The scheduler then uses a timer
        callback instead of a task per sample. None (the default) means: await `read`.
        """
        return None

    def check_index(self, index: int) -> None:
        if not 0 <= index < len(self):
            raise SampleError(
                f"{self.format} dataset {self.name!r} ({self.path}): index {index} is outside 0..{len(self) - 1}",
                index=index,
                path=self.path,
            )

    def close(self) -> None:
        """Release files and caches."""


class IndexReader(Reader):
    """A reader whose reads do no I/O: the item is the index, and `encode` does the work
    (memory-mapped Arrow pages fault in there, in the executor)."""

    read_does_io: ClassVar[bool] = False

    def read_now(self, index: int) -> int:
        self.check_index(index)
        return index

    @abc.abstractmethod
    def row_nbytes(self, columns: Sequence[str] = ()) -> int:
        """The payload bytes of an average row of `columns` (all when empty): the
        items carry no data to measure, so chunks are sized by this estimate."""

    def item_sizer(self, columns: Sequence[str] = ()) -> Callable[[Any], int]:
        estimate = self.row_nbytes(columns)
        return lambda _index: estimate

    async def read(self, index: int, columns: Sequence[str] = ()) -> int:
        return self.read_now(index)


def dataset_files(store: Store, path: str, suffixes: Sequence[str], what: str) -> list[str]:
    """The files of a dataset through `store`: `path` itself, or the files of folder
    `path` whose suffix is one of `suffixes` (any case), sorted by name."""
    if store.is_dir(path):
        names = store.list_names(path)[1]  # names only: a stat per file is a request on some mounts
        files = [store.join(path, n) for n in names if n.lower().endswith(tuple(suffixes))]
        if not files:
            raise DatasetError(f"{what} {store.url(path)}: the folder holds no {'/'.join(suffixes)} files")
        return files
    if not store.is_file(path):
        raise DatasetError(f"{what} {store.url(path)} does not exist")
    return [path]
