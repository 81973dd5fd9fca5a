"""Build a byte-level language-modelling dataset from the Python standard library's sources.

The text ships with every Python, so this works offline. Each .py file of the stdlib
folder is read in sorted order; every TEST_EVERY-th file goes to the validation split.
A split's files are joined with a separator, turned into bytes (token ids 0..255, so no
tokenizer needs downloading) and cut into fixed-length blocks of `block + 1` ids: a
model reads ids[:-1] and predicts ids[1:]. The splits are written with Hugging Face
`datasets.save_to_disk` as an `input_ids: list<int32>` column, which croupier serves.

    python examples/make_text_dataset.py /data/stdlib-text --block 256 --max-mb 8
    croupier serve text=/data/stdlib-text/train text-val=/data/stdlib-text/val
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import numpy as np

VAL_EVERY = 20
SEPARATOR = b"\n\n# ---- file boundary ----\n\n"


def stdlib_files() -> list[Path]:
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def blocks_of(files: list[Path], block: int, max_bytes: int) -> np.ndarray:
    """[rows, block + 1] int32 token ids from the concatenated bytes of `files`."""
    parts: list[bytes] = []
    size = 0
    for f in files:
        if size >= max_bytes:
            break
        data = f.read_bytes() + SEPARATOR
        parts.append(data)
        size += len(data)
    ids = np.frombuffer(b"".join(parts)[:max_bytes], dtype=np.uint8).astype(np.int32)
    rows = len(ids) // (block + 1)
    if rows == 0:
        raise SystemExit(f"{len(ids)} bytes of text make no block of {block + 1} tokens: raise --max-mb")
    return ids[: rows * (block + 1)].reshape(rows, block + 1)


def write_split(path: Path, ids: np.ndarray) -> None:
    import datasets
    import pyarrow as pa

    offsets = pa.array(np.arange(0, ids.size + 1, ids.shape[1], dtype=np.int32))
    column = pa.ListArray.from_arrays(offsets, pa.array(ids.ravel(), pa.int32()))
    datasets.disable_progress_bars()
    ds = datasets.Dataset(pa.table({"input_ids": column}))
    ds.save_to_disk(str(path), max_shard_size="8MB")


def build(out: Path, block: int = 256, max_mb: float = 8.0) -> dict[str, int]:
    """Writes out/train and out/val; returns their row counts."""
    files = stdlib_files()
    val = files[VAL_EVERY - 1 :: VAL_EVERY]
    train = [f for f in files if f not in set(val)]
    max_bytes = int(max_mb * (1 << 20))
    rows = {}
    for name, split_files, budget in (("train", train, max_bytes), ("val", val, max(max_bytes // VAL_EVERY, 4096))):
        ids = blocks_of(split_files, block, budget)
        write_split(out / name, ids)
        rows[name] = len(ids)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="folder to write train/ and val/ into")
    p.add_argument("--block", type=int, default=256, help="tokens a model sees per sample (default 256)")
    p.add_argument("--max-mb", type=float, default=8.0, help="bytes of source text for training (default 8 MiB)")
    args = p.parse_args()
    rows = build(args.out, args.block, args.max_mb)
    print(f"wrote {args.out}/train ({rows['train']:,} blocks) and {args.out}/val ({rows['val']:,} blocks) "
          f"of {args.block + 1} byte tokens")


if __name__ == "__main__":
    main()
