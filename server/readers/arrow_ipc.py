"""Arrow IPC files (file or stream format) and folders of them, memory-mapped.

Rows are never copied until a chunk is encoded: `read` does no I/O (it returns the
index) and `encode` takes the chunk's rows in one call, so the pages fault in there,
in the executor, off the event loop.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from .base import ColumnInfo, DatasetError, DatasetInfo, Reader, TablePayload

ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")


def open_ipc_table(path: Path) -> pa.Table:
    """Memory-map one IPC file, file format or stream format; errors name the file."""
    try:
        source = pa.memory_map(str(path), "r")
    except OSError as exc:
        raise DatasetError(f"cannot open Arrow file {path}: {exc}") from exc
    errors = []
    for opener in (pa.ipc.open_file, pa.ipc.open_stream):
        try:
            source.seek(0)
            return opener(source).read_all()
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError, ValueError) as exc:
            errors.append(str(exc))
    raise DatasetError(f"{path} is not a readable Arrow IPC file (corrupt or truncated?): {errors[-1]}")


def select_columns(table: pa.Table, columns: Sequence[str], what: str) -> pa.Table:
    if not columns:
        return table
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise DatasetError(f"{what} has no column {missing[0]!r}; columns: {table.column_names}")
    return table.select(list(columns))


def to_ipc_payload(table: pa.Table) -> TablePayload:
    """One IPC stream: the schema and a single record batch."""
    batch = table.combine_chunks().to_batches()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        for b in batch or [pa.RecordBatch.from_pylist([], schema=table.schema)]:
            writer.write_batch(b)
    buf = sink.getvalue()
    return TablePayload(arrow_ipc=buf.to_pybytes(), nbytes=buf.size)


class TableReader(Reader):
    """Random access into one Arrow table made of one or more memory-mapped files."""

    read_does_io = False

    def __init__(self, name: str, path: str, files: Sequence[Path]):
        super().__init__(name, path)
        if not files:
            raise DatasetError(f"{self.format} dataset {path}: no data files found")
        tables = [open_ipc_table(f) for f in files]
        schemas = {t.schema.remove_metadata() for t in tables}
        if len(schemas) > 1:
            raise DatasetError(f"{path}: its files have different schemas: {[str(f) for f in files]}")
        self.files = list(files)
        self.table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]

    def __len__(self) -> int:
        return self.table.num_rows

    def info(self) -> DatasetInfo:
        schema = self.table.schema
        return DatasetInfo(
            name=self.name,
            num_rows=len(self),
            kind="table",
            format=self.format,
            path=self.path,
            columns=tuple(ColumnInfo(f.name, str(f.type)) for f in schema),
            arrow_schema=schema.serialize().to_pybytes(),
        )

    async def read(self, index: int) -> int:
        self.check_index(index)
        return index

    def encode(self, items: Sequence[int], columns: Sequence[str] = (), decode_images: bool = False) -> TablePayload:
        table = select_columns(self.table, columns, f"{self.format} dataset {self.name!r} ({self.path})")
        try:
            rows = table.take(pa.array(np.asarray(items, dtype=np.int64)))
        except (pa.ArrowInvalid, OSError) as exc:
            raise DatasetError(f"{self.path}: cannot read rows {list(items)[:8]}...: {exc}") from exc
        return to_ipc_payload(rows)


class ArrowIPCReader(TableReader):
    format = "arrow"

    def __init__(self, name: str, path: str):
        p = Path(path)
        if p.is_dir():
            files = sorted(f for f in p.iterdir() if f.suffix in ARROW_SUFFIXES and f.is_file())
        elif p.exists():
            files = [p]
        else:
            raise DatasetError(f"Arrow dataset {path} does not exist")
        super().__init__(name, path, files)


def default_name(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    return base.split(".")[0] or base
