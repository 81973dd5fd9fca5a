"""Arrow IPC files (file or stream format) and folders of them, memory-mapped.

Rows are never copied until a chunk is encoded: `read` does no I/O (it returns the
index) and `encode` takes the chunk's rows batch-wise (tables.RowTaker), so the pages
fault in there, in the executor, off the event loop. The files of a folder, in sorted order,
form one table: global index i is row i of their concatenation.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from .base import DatasetError, DatasetInfo, IndexReader, TablePayload, data_files
from .tables import RowTaker, checked_columns, select_columns, table_info, to_ipc_payload

__all__ = ["ARROW_SUFFIXES", "ArrowIPCReader", "TableReader", "open_ipc_table", "select_columns", "to_ipc_payload"]

#: ".arrows" is the registered suffix of the stream format.
ARROW_SUFFIXES = (".arrow", ".arrows", ".feather", ".ipc")
_FILE_MAGIC = b"ARROW1"


def open_ipc_table(path: Path) -> pa.Table:
    """Memory-map one IPC file, file format or stream format; errors name the file."""
    try:
        source = pa.memory_map(str(path), "r")
    except (OSError, pa.ArrowInvalid) as exc:
        raise DatasetError(f"cannot open Arrow IPC file {path}: {exc}") from exc
    file_format = source.read(len(_FILE_MAGIC)) == _FILE_MAGIC
    source.seek(0)
    kind = "file" if file_format else "stream"
    try:
        reader = pa.ipc.open_file(source) if file_format else pa.ipc.open_stream(source)
        table = reader.read_all()
        # Structure only: O(columns x chunks), no scan of the data. Values (string
        # offsets) are checked per record batch on first use, by RowTaker.take.
        table.validate()
    except (pa.ArrowInvalid, OSError, ValueError) as exc:
        raise DatasetError(f"{path}: not a readable Arrow IPC {kind} (corrupt or truncated?): {exc}") from exc
    return table


class TableReader(IndexReader):
    """Random access into one Arrow table made of one or more memory-mapped IPC files.

    `columns`, when given, keeps only those columns (in the files' order).
    """

    def __init__(self, name: str, path: str, files: Sequence[Path], columns: Sequence[str] | None = None):
        super().__init__(name, path)
        if not files:
            raise DatasetError(f"{self.format} dataset {path}: no Arrow files found")
        tables = [open_ipc_table(f) for f in files]
        first = tables[0].schema
        for f, t in zip(files, tables):
            if not t.schema.equals(first, check_metadata=False):
                raise DatasetError(
                    f"{self.format} dataset {path}: {f} has schema {t.schema.remove_metadata()}, "
                    f"unlike {files[0]}: {first.remove_metadata()}"
                )
        self.files = list(files)
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        if columns:
            checked_columns(table.column_names, columns, f"{self.format} dataset {path}")
            table = table.select([c for c in table.column_names if c in columns])
        #: The whole dataset as one zero-copy table over the mapped files.
        self.table = table
        self._rows = RowTaker(self.table, [(str(f), t.num_rows) for f, t in zip(files, tables)])
        # Bytes per row of each column, from buffer sizes only: reading offsets could
        # trust a corrupt file, and scanning the data would fault it all in at start.
        rows = max(table.num_rows, 1)
        self._row_bytes = {c: -(-table.column(c).get_total_buffer_size() // rows) for c in table.column_names}

    def __len__(self) -> int:
        return self.table.num_rows

    def info(self) -> DatasetInfo:
        return table_info(self, self.table.schema)

    def row_nbytes(self, columns: Sequence[str] = ()) -> int:
        return sum(self._row_bytes.get(c, 0) for c in (columns or self._row_bytes))

    def encode(self, items: Sequence[int], columns: Sequence[str] = (), decode_images: bool = False) -> TablePayload:
        what = f"{self.format} dataset {self.name!r} ({self.path})"
        columns = checked_columns(self.table.column_names, columns, what) if columns else ()
        try:
            rows = self._rows.take(np.asarray(items, dtype=np.int64), columns)
        except DatasetError as exc:  # a corrupt record batch; the message names its file
            raise DatasetError(f"{what}: {exc}") from exc
        except (pa.ArrowInvalid, pa.ArrowIndexError, OSError) as exc:
            raise DatasetError(f"{what}: cannot take rows {list(items)[:8]}: {exc}") from exc
        return to_ipc_payload(rows)

    def close(self) -> None:
        self.table = self.table.schema.empty_table()  # lets go of the mapped files
        self._rows = RowTaker(self.table)


class ArrowIPCReader(TableReader):
    format = "arrow"

    def __init__(self, name: str, path: str):
        super().__init__(name, path, data_files(Path(path), ARROW_SUFFIXES, "Arrow dataset"))
