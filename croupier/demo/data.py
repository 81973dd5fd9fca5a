"""The demo's embedded dataset: scikit-learn's handwritten digits, written once to a cache.

The 1,797 8x8 digit images ship inside scikit-learn, so the demo needs no network. They
are split 80/20 (deterministically, stratified by class) and written in three layouts
croupier serves: an ImageFolder tree of PNGs, WebDataset tar shards, and Arrow IPC
tables (`pixels`: 64 uint8, `label`). Preparation is atomic (a temporary folder renamed
into place), so concurrent demos and a crash halfway leave either nothing or everything.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Bumped whenever the files written change, so an old cache is rebuilt, not misread.
LAYOUT_VERSION = "digits-v2"
FORMATS = ("imagefolder", "webdataset", "arrow")
SPLITS = ("train", "test")
#: Every TEST_EVERY-th image of each class (by its order in scikit-learn) is held out.
TEST_EVERY = 5
SHARD_SIZE = 400
NUM_CLASSES = 10


def default_cache_dir() -> Path:
    """$CROUPIER_CACHE/demo, else $XDG_CACHE_HOME/croupier/demo, else ~/.cache/croupier/demo."""
    if os.environ.get("CROUPIER_CACHE"):
        return Path(os.environ["CROUPIER_CACHE"]) / "demo"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "croupier" / "demo"


@dataclass(frozen=True)
class DemoData:
    """Where the prepared digits live; `path(split, format)` is what the server serves."""

    root: Path

    def path(self, split: str, format: str = "imagefolder") -> Path:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if format == "arrow":
            return self.root / "arrow" / f"{split}.arrow"
        if format in FORMATS:
            return self.root / format / split
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")

    def dataset_specs(self, format: str = "imagefolder", names: tuple[str, str] = ("digits", "digits-test")) -> list[str]:
        """`croupier serve` arguments serving the train and test splits under `names`."""
        return [f"{name}={self.path(split, format)}" for name, split in zip(names, SPLITS)]


def split_indices(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices: within each class, every TEST_EVERY-th image is a test image."""
    test = np.zeros(len(labels), dtype=bool)
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        test[members[TEST_EVERY - 1 :: TEST_EVERY]] = True
    return np.flatnonzero(~test), np.flatnonzero(test)


def load_digits_uint8() -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [N, 8, 8] scaled from 0..16 to 0..255, labels int64 [N])."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.rint(digits.images * (255 / 16)).clip(0, 255).astype(np.uint8)
    return images, digits.target.astype(np.int64)


def _png(image: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image, mode="L").save(buf, format="PNG")
    return buf.getvalue()


def _write_imagefolder(folder: Path, pngs: dict[int, bytes], labels: np.ndarray, indices: np.ndarray) -> None:
    for i in indices.tolist():
        cls_dir = folder / str(labels[i])
        cls_dir.mkdir(parents=True, exist_ok=True)
        (cls_dir / f"{i:04d}.png").write_bytes(pngs[i])


def _write_webdataset(folder: Path, pngs: dict[int, bytes], labels: np.ndarray, indices: np.ndarray) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(0, len(indices), SHARD_SIZE):
        with tarfile.open(folder / f"digits-{s // SHARD_SIZE:04d}.tar", "w") as tar:
            for i in indices[s : s + SHARD_SIZE].tolist():
                for ext, payload in (("png", pngs[i]), ("cls", str(labels[i]).encode())):
                    member = tarfile.TarInfo(f"{i:04d}.{ext}")
                    member.size = len(payload)
                    tar.addfile(member, io.BytesIO(payload))


def _write_arrow(path: Path, images: np.ndarray, labels: np.ndarray, indices: np.ndarray) -> None:
    import pyarrow as pa

    flat = images[indices].reshape(len(indices), -1)
    offsets = pa.array(np.arange(0, flat.size + 1, flat.shape[1], dtype=np.int32))
    table = pa.table({"pixels": pa.ListArray.from_arrays(offsets, pa.array(flat.ravel(), pa.uint8())),
                      "label": pa.array(labels[indices], pa.int64())})
    path.parent.mkdir(parents=True, exist_ok=True)
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table, max_chunksize=256)


def _write_all(root: Path) -> None:
    images, labels = load_digits_uint8()
    pngs = {i: _png(images[i]) for i in range(len(images))}
    data = DemoData(root)
    for split, indices in zip(SPLITS, split_indices(labels)):
        _write_imagefolder(data.path(split, "imagefolder"), pngs, labels, indices)
        _write_webdataset(data.path(split, "webdataset"), pngs, labels, indices)
        _write_arrow(data.path(split, "arrow"), images, labels, indices)
    (root / "VERSION").write_text(LAYOUT_VERSION + "\n")


def is_prepared(root: Path) -> bool:
    try:
        return (root / "VERSION").read_text().strip() == LAYOUT_VERSION
    except OSError:
        return False


def prepare(cache_dir: Path | None = None) -> DemoData:
    """The digits written under `cache_dir` (default `default_cache_dir()`), writing them if needed."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if is_prepared(root):
        return DemoData(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        _write_all(tmp)
        if root.exists() and not is_prepared(root):
            shutil.rmtree(root)  # an old layout version: rebuilt, never misread
        try:
            tmp.rename(root)
        except OSError:
            if not is_prepared(root):  # not a concurrent writer that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return DemoData(root)
