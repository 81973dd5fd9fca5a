"""What table readers share: the dataset info of a schema, column selection, IPC payloads."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from .base import ColumnInfo, DatasetInfo, Reader, TablePayload, UnknownColumnError


def table_info(reader: Reader, schema: pa.Schema) -> DatasetInfo:
    """The info of a table dataset; `arrow_schema` keeps the schema metadata (HF features)."""
    return DatasetInfo(
        name=reader.name,
        num_rows=len(reader),
        kind="table",
        format=reader.format,
        path=reader.path,
        columns=tuple(ColumnInfo(f.name, str(f.type)) for f in schema),
        arrow_schema=schema.serialize().to_pybytes(),
    )


def checked_columns(names: Sequence[str], columns: Sequence[str], what: str) -> list[str]:
    """`columns` (all of `names` when empty), or UnknownColumnError listing `names`."""
    if not columns:
        return list(names)
    missing = [c for c in columns if c not in names]
    if missing:
        raise UnknownColumnError(f"{what} has no column {missing[0]!r}; columns: {list(names)}")
    return list(columns)


def select_columns(table: pa.Table, columns: Sequence[str], what: str) -> pa.Table:
    """`table` restricted to `columns` in that order (all of them when empty)."""
    if not columns:
        return table
    return table.select(checked_columns(table.column_names, columns, what))


class RowTaker:
    """Rows by global index from a table's record batches, without concatenating them.

    `Table.take` on a table of many chunks concatenates every chunk of every column
    first: it costs the whole dataset per call (~25 ms for 256 rows of 2M in 1,000-row
    batches). Here indices are located with numpy. Rows spread over many batches are
    taken as one-row slices joined by one `concat_batches` (~2.5 µs a row); rows that
    crowd into few batches as one `take` per batch (~25 µs a call), reordered by one
    more `take`. Until then every view is zero-copy over the mapped files.
    """

    #: Fewer rows than this per touched batch, on average, and slicing is cheaper.
    ROWS_PER_TAKE = 16

    def __init__(self, table: pa.Table):
        self.schema = table.schema
        batches = [b for b in table.to_batches() if b.num_rows]
        self._by_columns: dict[tuple[str, ...], list[pa.RecordBatch]] = {(): batches}
        self.starts = np.cumsum([0] + [b.num_rows for b in batches[:-1]], dtype=np.int64)

    def _batches(self, columns: tuple[str, ...]) -> list[pa.RecordBatch]:
        selected = self._by_columns.get(columns)
        if selected is None:
            selected = self._by_columns[columns] = [b.select(list(columns)) for b in self._by_columns[()]]
        return selected

    def take(self, indices: np.ndarray, columns: Sequence[str] = ()) -> pa.RecordBatch:
        """Rows `indices` (valid global row numbers, repeats allowed) of `columns`, in order."""
        columns = tuple(columns)
        batches = self._batches(columns)
        if not batches or not len(indices):
            schema = self.schema if not columns else pa.schema([self.schema.field(c) for c in columns], self.schema.metadata)
            return pa.RecordBatch.from_pylist([], schema=schema)
        which = np.searchsorted(self.starts, indices, side="right") - 1
        local = indices - self.starts[which]
        if (which == which[0]).all():
            return batches[which[0]].take(local)
        order = np.argsort(which, kind="stable")
        grouped = which[order]
        cuts = np.flatnonzero(np.diff(grouped)) + 1
        if len(indices) < self.ROWS_PER_TAKE * (len(cuts) + 1):
            return pa.concat_batches([batches[w].slice(i, 1) for w, i in zip(which.tolist(), local.tolist())])
        local = local[order]
        pieces = [batches[grouped[a]].take(local[a:b]) for a, b in zip([0, *cuts], [*cuts, len(order)])]
        restore = np.empty_like(order)
        restore[order] = np.arange(len(order))
        return pa.concat_batches(pieces).take(restore)


def to_ipc_payload(rows: pa.Table | pa.RecordBatch) -> TablePayload:
    """One Arrow IPC stream: the schema and a single record batch."""
    if isinstance(rows, pa.Table):
        batches = rows.combine_chunks().to_batches()
        rows = batches[0] if batches else pa.RecordBatch.from_pylist([], schema=rows.schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rows.schema) as writer:
        writer.write_batch(rows)
    buf = sink.getvalue()
    return TablePayload(arrow_ipc=buf.to_pybytes(), nbytes=buf.size)
