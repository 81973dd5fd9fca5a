"""Parquet files (or a folder of them, in sorted order), read by row group.

A random row costs decoding its whole row group, so decoded row groups stay in an LRU
cache bounded in bytes (the newest one is kept even when it alone exceeds the bound),
and concurrent reads of one row group share a single decode. `read` returns a one-row
slice of the decoded group; `encode` concatenates a chunk's slices into one batch.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .base import DatasetError, DatasetInfo, Reader, SampleError, TablePayload, data_files
from .tables import checked_columns, table_info, to_ipc_payload

DEFAULT_CACHE_BYTES = 256 << 20


class ParquetReader(Reader):
    format = "parquet"

    def __init__(self, name: str, path: str, cache_bytes: int = DEFAULT_CACHE_BYTES):
        super().__init__(name, path)
        self.paths = data_files(Path(path), (".parquet",), "Parquet dataset")
        # Footers are parsed once; each decode reopens its file with them (cheap, and no
        # file object is shared between executor threads).
        self.metadata: list[pq.FileMetaData] = []
        self.groups: list[tuple[int, int]] = []  # (file number, row group) in global order
        self.starts: list[int] = []  # first global row of each group
        total = 0
        schema: pa.Schema | None = None
        for fno, f in enumerate(self.paths):
            try:
                pf = pq.ParquetFile(str(f))
                file_schema = pf.schema_arrow
            except (pa.ArrowInvalid, OSError) as exc:
                raise DatasetError(f"{f} is not a readable Parquet file (corrupt or truncated?): {exc}") from exc
            if schema is None:
                schema = file_schema
            elif not file_schema.equals(schema):
                raise DatasetError(f"Parquet dataset {path}: {f} has schema {file_schema}, unlike {self.paths[0]}: {schema}")
            self.metadata.append(pf.metadata)
            for g in range(pf.metadata.num_row_groups):
                self.groups.append((fno, g))
                self.starts.append(total)
                total += pf.metadata.row_group(g).num_rows
            pf.close()
        assert schema is not None
        self.schema = schema
        self.num_rows = total
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[int, pa.RecordBatch] = OrderedDict()
        self._cached_bytes = 0
        self._decoding: dict[int, asyncio.Future[pa.RecordBatch]] = {}
        #: Row groups decoded so far (a cache hit or a shared decode does not count).
        self.decodes = 0

    def __len__(self) -> int:
        return self.num_rows

    def info(self) -> DatasetInfo:
        return table_info(self, self.schema)

    def _decode(self, group: int) -> pa.RecordBatch:
        fno, g = self.groups[group]
        path = self.paths[fno]
        try:
            with pq.ParquetFile(str(path), metadata=self.metadata[fno]) as pf:
                table = pf.read_row_group(g)
        except (pa.ArrowInvalid, OSError) as exc:
            raise SampleError(f"{path}: row group {g} is unreadable: {exc}", path=str(path)) from exc
        # One batch with the dataset's schema (files may differ in metadata only), so
        # that encode joins a chunk's rows with one concat_batches.
        batches = table.replace_schema_metadata(self.schema.metadata).combine_chunks().to_batches()
        return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=self.schema)

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
            fut = asyncio.ensure_future(self.run_blocking(self._decode, group))
            fut.add_done_callback(functools.partial(self._decoded, group))
            self._decoding[group] = fut
        # shield: a reader cancelled while waiting must not cancel the others' decode.
        return await asyncio.shield(fut)

    async def read(self, index: int) -> pa.RecordBatch:
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
        self._cache.clear()
        self._cached_bytes = 0
