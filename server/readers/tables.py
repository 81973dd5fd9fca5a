"""What table readers share: the dataset info of a schema, column selection, IPC payloads."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from .base import ColumnInfo, DatasetError, DatasetInfo, Reader, TablePayload, UnknownColumnError


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

    Opening only checks the structure (`Table.validate()`); corrupt offsets would make
    a take read outside the mapped file and kill the process (SIGBUS). So each column of
    a record batch is fully validated the first time a row of it is taken, and a corrupt
    one raises DatasetError naming its file (`files`: (path, rows) of each file, in
    order), rows and column. `take` runs in the executor: that one-time scan stays off
    the event loop.
    """

    #: Fewer rows than this per touched batch, on average, and slicing is cheaper.
    ROWS_PER_TAKE = 16

    def __init__(self, table: pa.Table, files: Sequence[tuple[str, int]] = ()):
        self.schema = table.schema
        batches = [b for b in table.to_batches() if b.num_rows]
        self._by_columns: dict[tuple[str, ...], list[pa.RecordBatch]] = {(): batches}
        self.starts = np.cumsum([0] + [b.num_rows for b in batches[:-1]], dtype=np.int64)
        self._files = [str(f) for f, _ in files]
        self._file_starts = np.cumsum([0] + [n for _, n in files][:-1], dtype=np.int64)
        # [batch, column] already fully validated (validate(full=True) is O(data)), per
        # column so that a stream of some columns never scans (faults in) the others.
        self._validated = np.zeros((len(batches), len(self.schema)), dtype=bool)
        #: Column selections whose every batch is validated: their takes skip the check.
        self._checked: set[tuple[str, ...]] = set()

    def _batches(self, columns: tuple[str, ...]) -> list[pa.RecordBatch]:
        selected = self._by_columns.get(columns)
        if selected is None:
            selected = self._by_columns[columns] = [b.select(list(columns)) for b in self._by_columns[()]]
        return selected

    def _validate(self, which: np.ndarray, columns: tuple[str, ...]) -> None:
        """Fully validate `columns` (all when empty) of the batches numbered `which`."""
        cols = [self.schema.get_field_index(c) for c in columns] if columns else list(range(len(self.schema)))
        todo = np.unique(which)
        todo = todo[~self._validated[np.ix_(todo, cols)].all(axis=1)]
        for w in todo.tolist():
            batch = self._by_columns[()][w]
            for c in cols:
                if self._validated[w, c]:
                    continue
                try:
                    batch.column(c).validate(full=True)
                except (pa.ArrowInvalid, ValueError) as exc:
                    raise DatasetError(f"{self._where(w)}, column {self.schema.names[c]!r}, is corrupt: {exc}") from exc
                self._validated[w, c] = True  # a race only validates a column twice: harmless
        if self._validated[:, cols].all():
            self._checked.add(columns)

    def _where(self, w: int) -> str:
        """Batch `w` as the file and rows it covers, for error messages."""
        first = int(self.starts[w])
        last = first + self._by_columns[()][w].num_rows - 1
        if not self._files:
            return f"the record batch of rows {first}..{last}"
        f = int(np.searchsorted(self._file_starts, first, side="right")) - 1
        offset = int(self._file_starts[f])
        return f"{self._files[f]}: the record batch of rows {first - offset}..{last - offset} of that file"

    def take(self, indices: np.ndarray, columns: Sequence[str] = ()) -> pa.RecordBatch:
        """Rows `indices` (valid global row numbers, repeats allowed) of `columns`, in order.

        Raises DatasetError when a batch holding one of the rows is corrupt.
        """
        columns = tuple(columns)
        batches = self._batches(columns)
        if not batches or not len(indices):
            schema = self.schema if not columns else pa.schema([self.schema.field(c) for c in columns], self.schema.metadata)
            return pa.RecordBatch.from_pylist([], schema=schema)
        which = np.searchsorted(self.starts, indices, side="right") - 1
        if columns not in self._checked:
            self._validate(which, columns)
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
