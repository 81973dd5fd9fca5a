"""Writers of small real datasets in every format croupier reads (tests and benchmarks).

Every writer is deterministic: row i / image i is a function of i, so a reader's output
can be checked against `expected_row(i)` / `expected_pixel(i)`.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image


def table_rows(n: int, start: int = 0) -> pa.Table:
    i = np.arange(start, start + n)
    return pa.table(
        {
            "id": pa.array(i, pa.int64()),
            "text": pa.array([f"row {k} " + "ab" * (k % 5) for k in i]),
            "score": pa.array(i / 4.0),
            "tokens": pa.array([[k % 7] * 3 for k in i], pa.list_(pa.int32())),
        }
    )


def write_arrow_file(path: Path, n: int, stream: bool = False) -> pa.Table:
    table = table_rows(n)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = pa.ipc.new_stream if stream else pa.ipc.new_file
    with opener(str(path), table.schema) as w:
        w.write_table(table, max_chunksize=max(1, n // 3))
    return table


def write_hf_dataset(path: Path, n: int, max_shard_size: str = "16KB"):
    import datasets

    ds = datasets.Dataset.from_dict(table_rows(n).to_pydict())
    ds.save_to_disk(str(path), max_shard_size=max_shard_size)
    return ds


def write_parquet(path: Path, n: int, row_group_size: int = 16) -> pa.Table:
    table = table_rows(n)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return table


def expected_pixel(i: int) -> int:
    return (37 * i) % 256


def png_bytes(i: int, size: int = 8) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((size, size, 3), expected_pixel(i), np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_imagefolder(root: Path, n_per_class: int, classes: tuple[str, ...] = ("cat", "dog", "eel")) -> list[tuple[str, int]]:
    """Writes root/<class>/<k>.png; returns (relative path, label) in ImageFolder order."""
    out = []
    i = 0
    for label, cls in enumerate(sorted(classes)):
        (root / cls).mkdir(parents=True, exist_ok=True)
        for k in range(n_per_class):
            (root / cls / f"{k:05d}.png").write_bytes(png_bytes(i))
            out.append((f"{cls}/{k:05d}.png", label))
            i += 1
    return out


def write_webdataset(folder: Path, n: int, shard_size: int = 10, num_classes: int = 3) -> list[tuple[str, int]]:
    """Writes folder/shard-XXXX.tar with key.png + key.cls members; returns (key, label)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for s in range(0, n, shard_size):
        with tarfile.open(folder / f"shard-{s // shard_size:04d}.tar", "w") as tar:
            for i in range(s, min(s + shard_size, n)):
                key = f"sample{i:06d}"
                for ext, payload in (("png", png_bytes(i)), ("cls", str(i % num_classes).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
                out.append((key, i % num_classes))
    return out
