"""The benchmark's data, generated locally and deterministically, and reused when present.

* text: a Hugging Face `save_to_disk` folder of rows (id, label, ~470 characters of
  text, 128 int32 tokens: about 1 KB a row): what a language-model trainer reads;
  generated in chunks of 100,000 rows, so 10^6 rows take about half a minute.
* images: the same RGB JPEGs twice, as an ImageFolder tree (one file per image, the
  random-access layout) and as WebDataset tar shards (`key.jpg` + `key.cls`).
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

WORDS = np.array(
    "the of and to in is was for on as with by at from his her an that which model data train loss batch "
    "epoch shuffle server read write token layer weight gradient step rank world sample index".split()
)


@dataclass(frozen=True)
class DataSpec:
    text_rows: int = 100_000
    text_words: int = 90
    tokens: int = 128
    images: int = 20_000
    image_size: int = 64
    classes: int = 10
    shard_size: int = 1_000

    def stamp(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass(frozen=True)
class BenchData:
    root: Path

    @property
    def text(self) -> Path:
        return self.root / "text"

    @property
    def imagefolder(self) -> Path:
        return self.root / "imagefolder"

    @property
    def shards(self) -> Path:
        return self.root / "shards"

    def paths(self) -> dict[str, Path]:
        return {"text": self.text, "imagefolder": self.imagefolder, "shards": self.shards}


#: Text rows are generated and converted in chunks of this many (bounded memory for 10^6+ rows).
TEXT_CHUNK_ROWS = 100_000


def text_table(spec: DataSpec, seed: int = 0, start: int = 0, rows: int | None = None) -> pa.Table:
    """Rows [start, start + rows) of the text dataset. Chunk k (of TEXT_CHUNK_ROWS rows) draws
    from its own seeded generator (chunk 0 from `seed` itself, so datasets of up to one chunk
    are the same as before chunking), so any chunk can be made alone."""
    n = spec.text_rows - start if rows is None else rows
    k = start // TEXT_CHUNK_ROWS
    rng = np.random.default_rng(seed if k == 0 else [seed, k])
    words = WORDS[rng.integers(0, len(WORDS), size=(n, spec.text_words))]
    text = [" ".join(row) for row in words.tolist()]
    tokens = rng.integers(0, 50_000, size=n * spec.tokens, dtype=np.int32)
    offsets = np.arange(0, n * spec.tokens + 1, spec.tokens, dtype=np.int32)
    return pa.table(
        {
            "id": pa.array(np.arange(start, start + n), pa.int64()),
            "label": pa.array(rng.integers(0, 10, n), pa.int64()),
            "text": pa.array(text, pa.string()),
            "tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens)),
        }
    )


def write_text(path: Path, spec: DataSpec) -> None:
    """save_to_disk of the rows, generated chunk by chunk (about 1 KB a row, 64 MB shards)."""
    import datasets

    if spec.text_rows <= TEXT_CHUNK_ROWS:
        table = text_table(spec)
    else:
        table = pa.concat_tables(
            text_table(spec, start=a, rows=min(TEXT_CHUNK_ROWS, spec.text_rows - a))
            for a in range(0, spec.text_rows, TEXT_CHUNK_ROWS)
        )
    datasets.Dataset(table).save_to_disk(str(path), max_shard_size="64MB")


def jpeg(i: int, size: int, rng: np.random.Generator) -> bytes:
    """A smooth random image with some grain: compresses like a photo, not like noise."""
    from PIL import Image

    coarse = rng.integers(0, 256, size=(size // 8, size // 8, 3), dtype=np.uint8)
    img = Image.fromarray(coarse).resize((size, size), Image.BILINEAR)
    arr = np.asarray(img, dtype=np.int16) + rng.integers(-12, 13, size=(size, size, 3), dtype=np.int16)
    buf = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def write_images(folder: Path, shards: Path, spec: DataSpec, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    shards.mkdir(parents=True, exist_ok=True)
    tar: tarfile.TarFile | None = None
    for i in range(spec.images):
        label = i % spec.classes
        data = jpeg(i, spec.image_size, rng)
        cls_dir = folder / f"class{label:02d}"
        cls_dir.mkdir(exist_ok=True)
        (cls_dir / f"{i:07d}.jpg").write_bytes(data)
        if i % spec.shard_size == 0:
            if tar is not None:
                tar.close()
            tar = tarfile.open(shards / f"shard-{i // spec.shard_size:05d}.tar", "w")
        assert tar is not None
        for ext, payload in (("jpg", data), ("cls", str(label).encode())):
            info = tarfile.TarInfo(f"{i:07d}.{ext}")
            info.size, info.mtime = len(payload), 0
            tar.addfile(info, io.BytesIO(payload))
    if tar is not None:
        tar.close()


def ensure_data(root: Path, spec: DataSpec, log=print) -> BenchData:
    """Generate the data under `root` unless a previous run left the same spec there."""
    data = BenchData(root)
    stamp_file = root / "spec.json"
    if stamp_file.is_file() and stamp_file.read_text() == spec.stamp():
        return data
    import shutil

    for p in data.paths().values():
        shutil.rmtree(p, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    log(f"writing {spec.text_rows} text rows to {data.text}")
    write_text(data.text, spec)
    log(f"writing {spec.images} {spec.image_size}x{spec.image_size} JPEGs to {data.imagefolder} and {data.shards}")
    write_images(data.imagefolder, data.shards, spec)
    stamp_file.write_text(spec.stamp())
    log(f"data ready in {time.perf_counter() - t0:.1f}s")
    return data
