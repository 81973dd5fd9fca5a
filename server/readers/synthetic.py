"""A virtual table dataset generated from the index: no files, any number of rows.

Used to plan and stream datasets far larger than the disk (10^9 rows) and as a
load-test target. Row i is (index=i, value=i*0.5, payload=`row_bytes` bytes derived
from i), so a client can check every row it receives.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from .arrow_ipc import select_columns, to_ipc_payload
from .base import ColumnInfo, DatasetError, DatasetInfo, IndexReader, TablePayload

SCHEMA = pa.schema([("index", pa.int64()), ("value", pa.float64()), ("payload", pa.binary())])


def synthetic_payload(indices: np.ndarray, row_bytes: int) -> list[bytes]:
    """The payload bytes of each row: its index, little-endian, repeated to `row_bytes`."""
    reps = -(-row_bytes // 8)
    return [(int(i).to_bytes(8, "little") * reps)[:row_bytes] for i in indices]


class SyntheticReader(IndexReader):
    format = "synthetic"

    def __init__(self, name: str, num_rows: int, row_bytes: int = 64):
        super().__init__(name, f"synthetic://{num_rows}x{row_bytes}")
        if num_rows < 1:
            raise DatasetError(f"synthetic dataset {name!r}: num_rows must be at least 1, got {num_rows}")
        self.num_rows = num_rows
        self.row_bytes = row_bytes

    def __len__(self) -> int:
        return self.num_rows

    def info(self) -> DatasetInfo:
        return DatasetInfo(
            name=self.name,
            num_rows=self.num_rows,
            kind="table",
            format=self.format,
            path=self.path,
            columns=tuple(ColumnInfo(f.name, str(f.type)) for f in SCHEMA),
            arrow_schema=SCHEMA.serialize().to_pybytes(),
        )

    def row_nbytes(self, columns: Sequence[str] = ()) -> int:
        sizes = {"index": 8, "value": 8, "payload": self.row_bytes + 4}  # + the int32 offset
        return sum(sizes[c] for c in (columns or sizes) if c in sizes)

    def encode(self, items: Sequence[int], columns: Sequence[str] = (), decode_images: bool = False) -> TablePayload:
        idx = np.asarray(items, dtype=np.int64)
        table = pa.table(
            {
                "index": pa.array(idx),
                "value": pa.array(idx * 0.5),
                "payload": pa.array(synthetic_payload(idx, self.row_bytes), type=pa.binary()),
            },
            schema=SCHEMA,
        )
        return to_ipc_payload(select_columns(table, columns, f"synthetic dataset {self.name!r}"))
