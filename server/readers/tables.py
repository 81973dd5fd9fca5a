"""What table readers share: the dataset info of a schema, column selection, IPC payloads."""

from __future__ import annotations

from collections.abc import Sequence

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


def select_columns(table: pa.Table, columns: Sequence[str], what: str) -> pa.Table:
    """`table` restricted to `columns` in that order (all of them when empty)."""
    if not columns:
        return table
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise UnknownColumnError(f"{what} has no column {missing[0]!r}; columns: {table.column_names}")
    return table.select(list(columns))


def to_ipc_payload(table: pa.Table) -> TablePayload:
    """One Arrow IPC stream: the schema and a single record batch."""
    batches = table.combine_chunks().to_batches()
    batch = batches[0] if batches else pa.RecordBatch.from_pylist([], schema=table.schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_batch(batch)
    buf = sink.getvalue()
    return TablePayload(arrow_ipc=buf.to_pybytes(), nbytes=buf.size)
