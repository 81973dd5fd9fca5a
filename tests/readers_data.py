"""Writers of small real datasets in every format croupier reads (tests and benchmarks).

Every writer is deterministic and returns what it wrote. Table rows are a function of
their id (`expected_row(i)` is row i of `table_rows`); image i is an 8x8 RGB image
filled with `expected_pixel(i)`, so a reader's output can be checked exactly.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

COLUMNS = ("id", "text", "score", "tokens")


def table_rows(n: int, start: int = 0) -> pa.Table:
    """Rows start..start+n-1: id, text, score = id / 4, tokens = [id % 7] * 3."""
    ids = np.arange(start, start + n)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "text": pa.array([f"row {k} " + "ab" * (k % 5) for k in ids]),
            "score": pa.array(ids / 4.0),
            "tokens": pa.array([[k % 7] * 3 for k in ids], pa.list_(pa.int32())),
        }
    )


def expected_row(i: int) -> dict[str, Any]:
    return table_rows(1, start=i).to_pylist()[0]


def write_arrow_file(
    path: Path, n: int, *, stream: bool = False, start: int = 0, batch_rows: int | None = None
) -> pa.Table:
    """An Arrow IPC file (file format, or stream format) of rows start..start+n-1, in
    record batches of `batch_rows` rows (default: 3 batches)."""
    table = table_rows(n, start)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = pa.ipc.new_stream if stream else pa.ipc.new_file
    with opener(str(path), table.schema) as w:
        w.write_table(table, max_chunksize=batch_rows or max(1, -(-n // 3)))
    return table


def write_arrow_folder(folder: Path, sizes: Sequence[int]) -> pa.Table:
    """folder/part-XXXX.arrow with `sizes` rows each, ids continuing across files."""
    tables, start = [], 0
    for k, n in enumerate(sizes):
        tables.append(write_arrow_file(folder / f"part-{k:04d}.arrow", n, stream=k % 2 == 1, start=start))
        start += n
    return pa.concat_tables(tables)


def write_hf_dataset(path: Path, n: int, max_shard_size: str = "16KB") -> Any:
    """`datasets.Dataset.save_to_disk` of `table_rows(n)`, in several shards; returns the Dataset."""
    import datasets

    ds = datasets.Dataset.from_dict(table_rows(n).to_pydict())
    ds.save_to_disk(str(path), max_shard_size=max_shard_size)
    return ds


def write_parquet(path: Path, n: int, row_group_size: int = 16, *, start: int = 0) -> pa.Table:
    table = table_rows(n, start)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return table


def expected_pixel(i: int) -> int:
    return (37 * i) % 256


def image_bytes(i: int, size: int = 8, format: str = "PNG") -> bytes:
    """An encoded size x size RGB image filled with expected_pixel(i)."""
    buf = io.BytesIO()
    Image.fromarray(np.full((size, size, 3), expected_pixel(i), np.uint8)).save(buf, format=format)
    return buf.getvalue()


def png_bytes(i: int, size: int = 8) -> bytes:
    return image_bytes(i, size)


def write_imagefolder(
    root: Path, n_per_class: int, classes: Sequence[str] = ("cat", "dog", "eel")
) -> list[tuple[str, int]]:
    """root/<class>/<k>.png; returns (path relative to root, label) in ImageFolder order.

    Image i (position i in that order) is filled with expected_pixel(i).
    """
    out = []
    for label, cls in enumerate(sorted(classes)):
        (root / cls).mkdir(parents=True, exist_ok=True)
        for k in range(n_per_class):
            rel = f"{cls}/{k:05d}.png"
            (root / rel).write_bytes(png_bytes(len(out)))
            out.append((rel, label))
    return out


def write_webdataset(
    folder: Path, n: int, shard_size: int = 10, num_classes: int = 3
) -> list[tuple[str, int]]:
    """folder/shard-XXXX.tar of samples key.png + key.cls; returns (key, label) in order.

    Sample i has key sample{i:06d}, label i % num_classes and image expected_pixel(i).
    """
    out = []
    for s in range(0, n, shard_size):
        members = {}
        for i in range(s, min(s + shard_size, n)):
            key = f"sample{i:06d}"
            members[f"{key}.png"] = png_bytes(i)
            members[f"{key}.cls"] = str(i % num_classes).encode()
            out.append((key, i % num_classes))
        write_tar(folder / f"shard-{s // shard_size:04d}.tar", members)
    return out


def write_tar(path: Path, members: dict[str, bytes]) -> Path:
    """A tar file of `members` (name -> bytes) in that order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return path
