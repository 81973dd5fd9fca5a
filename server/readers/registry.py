"""Open a dataset by path, detecting its format, and keep paths inside the data roots."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from .arrow_ipc import ARROW_SUFFIXES, ArrowIPCReader
from .base import DatasetError, OutsideRootsError, Reader
from .hf_disk import HFDiskReader, is_hf_folder
from .imagefolder import ImageFolderReader, looks_like_imagefolder
from .parquet import ParquetReader
from .webdataset import WebDatasetReader

_Opener = Callable[[str, str, "str | None"], Reader]

#: Format name -> opener(name, path, cache_dir).
OPENERS: dict[str, _Opener] = {
    "arrow": lambda name, path, cache_dir: ArrowIPCReader(name, path),
    "hf": lambda name, path, cache_dir: HFDiskReader(name, path),
    "parquet": lambda name, path, cache_dir: ParquetReader(name, path),
    "imagefolder": lambda name, path, cache_dir: ImageFolderReader(name, path),
    "webdataset": lambda name, path, cache_dir: WebDatasetReader(name, path, cache_dir=cache_dir),
}
FORMATS = tuple(OPENERS)

#: File suffix -> format, for a file or a folder of such files.
SUFFIX_FORMATS = {**{s: "arrow" for s in ARROW_SUFFIXES}, ".parquet": "parquet", ".tar": "webdataset"}

_LAYOUTS = (
    "an .arrow/.feather/.ipc file or folder of them (arrow), a Dataset.save_to_disk folder (hf), "
    "a .parquet file or folder (parquet), class folders of images (imagefolder), "
    "a .tar shard or folder of shards (webdataset)"
)


def detect_format(path: Path) -> str:
    """The format of the dataset at `path`, from its suffix or the files it holds."""
    if path.is_file():
        fmt = SUFFIX_FORMATS.get(path.suffix.lower())
        if fmt is not None:
            return fmt
    elif path.is_dir():
        if is_hf_folder(path):
            return "hf"
        suffixes = {f.suffix.lower() for f in path.iterdir() if f.is_file()}
        for suffix, fmt in SUFFIX_FORMATS.items():
            if suffix in suffixes:
                return fmt
        if looks_like_imagefolder(path):
            return "imagefolder"
    else:
        raise DatasetError(f"dataset {path} does not exist")
    raise DatasetError(f"cannot tell the format of {path}; expected one of: {_LAYOUTS}; formats: {', '.join(FORMATS)}")


def default_name(path: str | os.PathLike) -> str:
    """The basename of `path` without its data suffix: /data/c4-train.parquet -> c4-train."""
    base = os.path.basename(os.path.normpath(path))
    stem, suffix = os.path.splitext(base)
    return stem if suffix.lower() in SUFFIX_FORMATS and stem else base


def open_dataset(
    path: str | os.PathLike, *, name: str | None = None, format: str | None = None, cache_dir: str | None = None
) -> Reader:
    """A reader for the dataset at `path`; `format` (one of FORMATS) is detected when not given.

    Blocking (opens files, may scan tar shards): the server calls it in an executor.
    """
    p = Path(path)
    if not p.exists():
        raise DatasetError(f"dataset {p} does not exist")
    fmt = format or detect_format(p)
    opener = OPENERS.get(fmt)
    if opener is None:
        raise DatasetError(f"dataset {p}: unknown format {fmt!r}; formats: {', '.join(FORMATS)}")
    return opener(name or default_name(p), str(p), cache_dir)


def resolve_under_roots(path: str | os.PathLike, roots: Sequence[str | os.PathLike]) -> Path:
    """`path` with symlinks and '..' resolved, if it lies under one of `roots` (else OutsideRootsError)."""
    real = Path(os.path.realpath(path))
    for root in roots:
        r = Path(os.path.realpath(root))
        if real == r or r in real.parents:
            return real
    raise OutsideRootsError(
        f"dataset path {os.fspath(path)} resolves to {real}, outside the data roots {[os.fspath(r) for r in roots]}"
    )
