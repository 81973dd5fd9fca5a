"""Parquet files (or a folder of them), read by row group.

A random row costs decoding its row group, so decoded row groups stay in an LRU cache
bounded in bytes, and concurrent reads of one row group share a single decode.
"""

from __future__ import annotations

import asyncio
import bisect
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .arrow_ipc import select_columns, to_ipc_payload
from .base import ColumnInfo, DatasetError, DatasetInfo, Reader, SampleError, TablePayload


class ParquetReader(Reader):
    format = "parquet"

    def __init__(self, name: str, path: str, cache_bytes: int = 256 << 20):
        super().__init__(name, path)
        p = Path(path)
        files = sorted(f for f in p.glob("*.parquet")) if p.is_dir() else [p]
        if not files or not all(f.is_file() for f in files):
            raise DatasetError(f"Parquet dataset {path}: no .parquet files found")
        self.files: list[pq.ParquetFile] = []
        self.groups: list[tuple[int, int]] = []  # (file number, row group) in global order
        self.starts: list[int] = []  # first global row of each group
        total = 0
        schema = None
        for fno, f in enumerate(files):
            try:
                pf = pq.ParquetFile(str(f))
            except (pa.ArrowInvalid, OSError) as exc:
                raise DatasetError(f"{f} is not a readable Parquet file (corrupt or truncated?): {exc}") from exc
            if schema is None:
                schema = pf.schema_arrow
            elif not pf.schema_arrow.equals(schema):
                raise DatasetError(f"{f}: schema differs from {files[0]}")
            self.files.append(pf)
            for g in range(pf.metadata.num_row_groups):
                self.groups.append((fno, g))
                self.starts.append(total)
                total += pf.metadata.row_group(g).num_rows
        self.num_rows = total
        self.schema = schema
        self.paths = files
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[int, pa.Table] = OrderedDict()
        self._cached_bytes = 0
        self._decoding: dict[int, asyncio.Future[pa.Table]] = {}

    def __len__(self) -> int:
        return self.num_rows

    def info(self) -> DatasetInfo:
        assert self.schema is not None
        return DatasetInfo(
            name=self.name,
            num_rows=self.num_rows,
            kind="table",
            format=self.format,
            path=self.path,
            columns=tuple(ColumnInfo(f.name, str(f.type)) for f in self.schema),
            arrow_schema=self.schema.serialize().to_pybytes(),
        )

    def _decode(self, group: int) -> pa.Table:
        fno, g = self.groups[group]
        try:
            return self.files[fno].read_row_group(g)
        except (pa.ArrowInvalid, OSError) as exc:
            raise SampleError(f"{self.paths[fno]}: row group {g} is unreadable: {exc}", path=str(self.paths[fno])) from exc

    def _remember(self, group: int, table: pa.Table) -> None:
        self._cache[group] = table
        self._cached_bytes += table.nbytes
        while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.nbytes

    async def _row_group(self, group: int) -> pa.Table:
        table = self._cache.get(group)
        if table is not None:
            self._cache.move_to_end(group)
            return table
        fut = self._decoding.get(group)
        if fut is None:
            fut = asyncio.ensure_future(self.run_blocking(self._decode, group))
            self._decoding[group] = fut
            try:
                table = await fut
            finally:
                del self._decoding[group]
            self._remember(group, table)
            return table
        return await asyncio.shield(fut)

    async def read(self, index: int) -> pa.Table:
        self.check_index(index)
        group = bisect.bisect_right(self.starts, index) - 1
        try:
            table = await self._row_group(group)
        except SampleError as exc:
            raise SampleError(f"{exc} (row {index})", index=index, path=exc.path) from None
        return table.slice(index - self.starts[group], 1)

    def encode(self, items: Sequence[pa.Table], columns: Sequence[str] = (), decode_images: bool = False) -> TablePayload:
        table = pa.concat_tables(items) if len(items) > 1 else items[0]
        return to_ipc_payload(select_columns(table, columns, f"parquet dataset {self.name!r} ({self.path})"))
