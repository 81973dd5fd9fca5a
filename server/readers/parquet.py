"""Parquet files (or a folder of them, in sorted order), read by row group through a Store.

Every byte comes from `self.store` as a range read, so the same code reads a local
file system and an object store (keys as paths):

* Opening a file costs its size and one range read of its last 64 KiB, which usually
  holds the whole footer (Thrift metadata, then its length and the magic `PAR1`); a
  longer footer costs one more read of the rest. The footer is parsed by pyarrow from
  those bytes alone. Nothing else of the file is read at open.
* A row costs its row group: Parquet compresses and encodes values page by page inside
  each column chunk, so one row cannot be decoded without its pages, and this reader
  fetches whole column chunks. Reading row `i` fetches the compressed column chunks of
  the row group holding `i`, each range taken from the footer (from the dictionary page,
  when there is one, to the end of its last data page: `total_compressed_size` bytes),
  all of them in ONE `store.read_ranges` call (concurrent reads), and decodes them in
  the CPU executor from those bytes only. For a file written with row groups of R rows
  that is about R x (compressed row bytes) per row group decoded: `pq.write_table`'s
  default of 1Mi rows per group means a random row costs megabytes to gigabytes.
  Never the whole file (unless the file is one row group), and nothing is read again
  while the group stays cached. Measured (tests/test_parquet_ranges.py): in a 10.3 MB
  file of 50 row groups of 200 rows of 1 KB text, a row read 204,169 bytes, exactly its
  row group's compressed column chunks, and a second row of that group read nothing.

  To make a row cheaper, write smaller row groups (`pq.write_table(...,
  row_group_size=R)`: a random row then costs ~R rows of I/O and decode, at the price
  of a larger footer and less compression), or convert the dataset once with
  `croupier rewrite` to Arrow IPC with small record batches, where a row costs its
  own small batch, with no decode.

Memory: decoded row groups stay in an LRU cache bounded by `cache_bytes` of decoded
Arrow data (the newest group is kept even when it alone exceeds the bound, so a read
always completes). On top of that, each row group being fetched or decoded holds its
compressed column chunks and its decoded batch until the decode finishes: at most one
per distinct row group in flight, a number the server's read limit bounds. Concurrent
reads of one row group share one fetch and one decode; `decodes` counts them.

`read` returns a one-row slice of the decoded group; `encode` concatenates a chunk's
slices into one batch.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import re
from collections import OrderedDict
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from ..storage import Range, Store
from .base import DatasetError, DatasetInfo, Reader, SampleError, TablePayload, dataset_files
from .listing import FilesProgress
from .tables import checked_columns, table_info, to_ipc_payload

DEFAULT_CACHE_BYTES = 256 << 20

#: Bytes read from the end of a file at open: usually the whole footer in one read.
TAIL_BYTES = 64 << 10

_MAGIC = b"PAR1"
_ENCRYPTED_MAGIC = b"PARE"
#: Magic, footer length and magic: the smallest possible Parquet file.
_MIN_FILE_BYTES = 12

#: parquet-mr up to 1.2.8 left the dictionary page header out of total_compressed_size
#: (PARQUET-816); like Arrow's reader, read up to this many bytes more for its files.
_PARQUET_816_PADDING = 100
_CREATED_BY = re.compile(r"\s*(\S+)\s+version\s+(\d+)\.(\d+)\.(\d+)")


def _needs_parquet_816_padding(created_by: str | None) -> bool:
    m = _CREATED_BY.match(created_by or "")
    return bool(m) and m.group(1) == "parquet-mr" and tuple(int(v) for v in m.groups()[1:]) < (1, 2, 9)


class ReadOutsideRangesError(RuntimeError):
    """pyarrow asked a sparse file for bytes that were not fetched: a bug in this reader
    (its ranges do not match what the decoder reads), never a property of the data."""


class _SparseFile:
    """A read-only file of `size` bytes of which only `ranges` ((offset, bytes), sorted,
    disjoint) are present. pyarrow reads it through `pa.PythonFile`; a read that is
    not inside one range raises ReadOutsideRangesError (nothing is ever read lazily)."""

    closed = False

    def __init__(self, url: str, size: int, ranges: Sequence[tuple[int, bytes]]):
        self.url = url
        self._size = size
        self._starts = [o for o, _ in ranges]
        self._data = [memoryview(b) for _, b in ranges]
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 1:
            pos += self._pos
        elif whence == 2:
            pos += self._size
        self._pos = pos
        return pos

    def tell(self) -> int:
        return self._pos

    def size(self) -> int:
        return self._size

    def _view(self, nbytes: int | None) -> memoryview:
        pos = self._pos
        if nbytes is None or nbytes < 0:
            nbytes = self._size - pos
        nbytes = max(min(nbytes, self._size - pos), 0)
        i = bisect.bisect_right(self._starts, pos) - 1
        if nbytes == 0:
            return memoryview(b"")
        if i < 0 or pos + nbytes > self._starts[i] + len(self._data[i]):
            raise ReadOutsideRangesError(
                f"{self.url}: the Parquet decoder asked for bytes {pos}..{pos + nbytes - 1}, outside the "
                f"ranges fetched for it {[(o, o + len(d) - 1) for o, d in zip(self._starts, self._data)]}"
            )
        self._pos = pos + nbytes
        start = pos - self._starts[i]
        return self._data[i][start : start + nbytes]

    def read(self, nbytes: int | None = -1) -> bytes:
        return self._view(nbytes).tobytes()

    def read_buffer(self, nbytes: int | None = -1) -> pa.Buffer:
        return pa.py_buffer(self._view(nbytes))  # zero-copy over the fetched bytes

    def close(self) -> None:
        pass


def parquet_files(store: Store, path: str) -> list[str]:
    """The files of a Parquet dataset: `path` itself, or the .parquet files (any case)
    of folder `path`, sorted by name: global indices run through them in order."""
    return dataset_files(store, path, (".parquet",), "Parquet dataset")


class ParquetReader(Reader):
    format = "parquet"

    def __init__(self, name: str, path: str, store: Store | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES):
        super().__init__(name, path, store=store)
        #: The dataset's files, as paths of `store`, in global row order.
        self.paths: list[str] = parquet_files(self.store, path)
        for f in self.paths:
            self.store.pin(f)  # row groups are read from it for the dataset's life: keep it open
        self.urls: list[str] = [self.store.url(p) for p in self.paths]
        #: Bytes in each file, and where its column data ends (its footer begins).
        self.sizes: list[int] = []
        self._data_ends: list[int] = []
        self._padding: list[bool] = []
        #: The parsed footer of each file; decodes use it and never read a footer again.
        self.metadata: list[pq.FileMetaData] = []
        self.groups: list[tuple[int, int]] = []  # (file number, row group) in global order
        self.starts: list[int] = []  # first global row of each group
        total = 0
        schema: pa.Schema | None = None
        progress = FilesProgress(f"dataset {name} ({self.store.url(path)})", len(self.paths), "footers")
        for fno, f in enumerate(self.paths):
            metadata, file_schema = self._open_file(f, self.urls[fno])
            progress.step()
            if schema is None:
                schema = file_schema
            elif not file_schema.equals(schema):
                raise DatasetError(
                    f"Parquet dataset {self.store.url(path)}: {self.urls[fno]} has schema {file_schema}, "
                    f"unlike {self.urls[0]}: {schema}"
                )
            self.metadata.append(metadata)
            self._padding.append(_needs_parquet_816_padding(metadata.created_by))
            for g in range(metadata.num_row_groups):
                self.groups.append((fno, g))
                self.starts.append(total)
                total += metadata.row_group(g).num_rows
        progress.finish()
        assert schema is not None
        self.schema = schema
        self.num_rows = total
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[int, pa.RecordBatch] = OrderedDict()
        self._cached_bytes = 0
        self._decoding: dict[int, asyncio.Future[pa.RecordBatch]] = {}
        #: Row groups fetched and decoded so far (a cache hit or a shared decode does not count).
        self.decodes = 0

    # ---- open: the footer, by range reads ---------------------------------------------
    def _open_file(self, path: str, url: str) -> tuple[pq.FileMetaData, pa.Schema]:
        """Read and parse the footer of one file (blocking); DatasetError naming it."""
        try:
            size = self.store.size(path)
            if size < _MIN_FILE_BYTES:
                raise DatasetError(
                    f"{url} is not a Parquet file: {size} bytes, fewer than the {_MIN_FILE_BYTES} of magic, "
                    "footer length and magic (empty or truncated?)"
                )
            tail_start = size - min(size, TAIL_BYTES)
            tail = self.store.read_range(path, tail_start, size - tail_start)
            if len(tail) != size - tail_start:
                raise DatasetError(
                    f"{url}: read {len(tail)} of the last {size - tail_start} bytes of a {size}-byte file "
                    "(truncated while opening?)"
                )
            magic = tail[-4:]
            if magic == _ENCRYPTED_MAGIC:
                raise DatasetError(f"{url} is a Parquet file with an encrypted footer, which croupier cannot read")
            if magic != _MAGIC:
                raise DatasetError(
                    # The bytes it ends with are not echoed: a message may reach a client.
                    f"{url} is not a readable Parquet file (corrupt or truncated?): its last 4 bytes are not the magic {_MAGIC!r}"
                )
            footer_len = int.from_bytes(tail[-8:-4], "little")
            if footer_len + _MIN_FILE_BYTES > size:
                raise DatasetError(
                    f"{url} is not a readable Parquet file (corrupt or truncated?): its footer length "
                    f"{footer_len} does not fit in its {size} bytes"
                )
            footer_start = size - 8 - footer_len
            if footer_start < tail_start:  # a footer longer than the tail: one more read
                head = self.store.read_range(path, footer_start, tail_start - footer_start)
                if len(head) != tail_start - footer_start:
                    raise DatasetError(
                        f"{url}: read {len(head)} of {tail_start - footer_start} footer bytes at {footer_start} "
                        "(truncated while opening?)"
                    )
                tail, tail_start = head + tail, footer_start
            if tail_start == 0 and tail[:4] != _MAGIC:
                raise DatasetError(
                    f"{url} is not a readable Parquet file (corrupt?): it does not start with the magic {_MAGIC!r}"
                )
            footer = tail[footer_start - tail_start :]
            pf = pq.ParquetFile(pa.BufferReader(footer))  # reads nothing but `footer`
            metadata, schema = pf.metadata, pf.schema_arrow
        except FileNotFoundError as exc:
            raise DatasetError(f"Parquet dataset file {url} does not exist") from exc
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise DatasetError(f"{url} is not a readable Parquet file (corrupt or truncated?): {exc}") from exc
        self.sizes.append(size)
        self._data_ends.append(footer_start)
        return metadata, schema

    # ---- rows --------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_rows

    def info(self) -> DatasetInfo:
        return table_info(self, self.schema)

    def chunk_ranges(self, group: int) -> list[Range]:
        """The (offset, size) of each column chunk of row group `group` (global number),
        checked against the file; SampleError naming file, row group and column."""
        fno, g = self.groups[group]
        url, size, data_end = self.urls[fno], self.sizes[fno], self._data_ends[fno]
        rg = self.metadata[fno].row_group(g)
        ranges: list[Range] = []
        for c in range(rg.num_columns):
            col = rg.column(c)
            start = col.data_page_offset
            dict_offset = col.dictionary_page_offset if col.has_dictionary_page else None
            if dict_offset is not None and 0 < dict_offset < start:
                start = dict_offset
            length = col.total_compressed_size
            if start is None or length is None or start < 0 or length < 0 or start + length > data_end:
                raise SampleError(
                    f"{url}: row group {g}, column {col.path_in_schema!r}: the metadata puts its data at "
                    f"{start}..{None if start is None or length is None else start + length - 1}, outside the "
                    f"column data of the file (bytes 0..{data_end - 1} of {size}; corrupt metadata?)",
                    path=url,
                )
            if self._padding[fno]:
                length += min(_PARQUET_816_PADDING, size - (start + length))
            ranges.append((start, length))
        return ranges

    def _check_parts(self, group: int, ranges: Sequence[Range], parts: Sequence[bytes]) -> None:
        fno, g = self.groups[group]
        for (offset, size), part in zip(ranges, parts, strict=True):
            if len(part) != size:
                raise SampleError(
                    f"{self.urls[fno]}: row group {g}: read {len(part)} of {size} bytes at offset {offset} "
                    f"(the file is shorter than its footer says: truncated or rewritten since it was opened?)",
                    path=self.urls[fno],
                )

    def _decode_parts(self, group: int, ranges: Sequence[Range], parts: Sequence[bytes]) -> pa.RecordBatch:
        """Decode row group `group` from its fetched column chunks alone (blocking)."""
        fno, g = self.groups[group]
        url = self.urls[fno]
        spans = sorted(zip((o for o, _ in ranges), parts), key=lambda r: r[0])
        source = _SparseFile(url, self.sizes[fno], spans)
        try:
            # pre_buffer=False: one read per column chunk, exactly its range (pre-buffering
            # would coalesce ranges across gaps that were never fetched). Page CRCs are
            # verified where the writer stored them (write_page_checksum=True).
            with pq.ParquetFile(source, metadata=self.metadata[fno], pre_buffer=False, page_checksum_verification=True) as pf:
                table = pf.read_row_group(g)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise SampleError(f"{url}: row group {g}{self._bad_column(source, fno, g)} is corrupt or unreadable: {exc}", path=url) from exc
        # One batch with the dataset's schema (files may differ in metadata only), so
        # that encode joins a chunk's rows with one concat_batches.
        batches = table.replace_schema_metadata(self.schema.metadata).combine_chunks().to_batches()
        return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=self.schema)

    def _bad_column(self, source: "_SparseFile", fno: int, g: int) -> str:
        """', column NAME' of the first column of row group `g` that does not decode (or
        fails its page checksums), for the message; the error path only."""
        with pq.ParquetFile(source, metadata=self.metadata[fno], pre_buffer=False, page_checksum_verification=True) as pf:
            for name in pf.schema_arrow.names:
                try:
                    pf.read_row_group(g, columns=[name])
                except (pa.ArrowException, OSError, ValueError):
                    return f", column {name!r}"
                except ReadOutsideRangesError:
                    return ""
        return ""

    def _decode(self, group: int) -> pa.RecordBatch:
        """Fetch (blocking range reads through the store) and decode row group `group`,
        outside the cache: for tools and tests; reads use `_load`."""
        fno, g = self.groups[group]
        ranges = self.chunk_ranges(group)
        try:
            parts = [self.store.read_range(self.paths[fno], o, s) for o, s in ranges]
        except OSError as exc:
            raise SampleError(f"{self.urls[fno]}: row group {g} cannot be read: {exc}", path=self.urls[fno]) from exc
        self._check_parts(group, ranges, parts)
        return self._decode_parts(group, ranges, parts)

    async def _load(self, group: int) -> pa.RecordBatch:
        """Fetch the column chunks of `group` with one read_ranges call, then decode them
        in the executor."""
        fno, g = self.groups[group]
        ranges = self.chunk_ranges(group)
        try:
            parts = await self.store.read_ranges(self.paths[fno], ranges)
        except OSError as exc:
            raise SampleError(f"{self.urls[fno]}: row group {g} cannot be read: {exc}", path=self.urls[fno]) from exc
        self._check_parts(group, ranges, parts)
        return await self.run_blocking(self._decode_parts, group, ranges, parts)

    def _decoded(self, group: int, fut: asyncio.Future[pa.RecordBatch]) -> None:
        del self._decoding[group]
        if fut.cancelled() or fut.exception() is not None:
            return
        batch = fut.result()
        self._cache[group] = batch
        self._cached_bytes += batch.nbytes
        while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.nbytes

    async def _row_group(self, group: int) -> pa.RecordBatch:
        batch = self._cache.get(group)
        if batch is not None:
            self._cache.move_to_end(group)
            return batch
        fut = self._decoding.get(group)
        if fut is None:
            self.decodes += 1
            fut = asyncio.ensure_future(self._load(group))
            fut.add_done_callback(functools.partial(self._decoded, group))
            self._decoding[group] = fut
        # shield: a reader cancelled while waiting must not cancel the others' fetch and decode.
        return await asyncio.shield(fut)

    async def read(self, index: int, columns: Sequence[str] = ()) -> pa.RecordBatch:
        self.check_index(index)
        group = bisect.bisect_right(self.starts, index) - 1
        try:
            batch = await self._row_group(group)
        except SampleError as exc:
            raise SampleError(f"parquet dataset {self.name!r}, row {index}: {exc}", index=index, path=exc.path) from None
        return batch.slice(index - self.starts[group], 1)

    def encode(
        self, items: Sequence[pa.RecordBatch], columns: Sequence[str] = (), decode_images: bool = False
    ) -> TablePayload:
        columns = checked_columns(self.schema.names, columns, f"parquet dataset {self.name!r} ({self.path})")
        rows = pa.concat_batches(items) if items else pa.RecordBatch.from_pylist([], schema=self.schema)
        return to_ipc_payload(rows.select(columns))

    def close(self) -> None:
        for f in self.paths:
            self.store.unpin(f)
        self._cache.clear()
        self._cached_bytes = 0
