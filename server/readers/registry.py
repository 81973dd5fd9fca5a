"""Open a dataset by path, detecting its format, and keep paths inside the data roots."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .arrow_ipc import ARROW_SUFFIXES, ArrowIPCReader, default_name
from .base import DatasetError, OutsideRootsError, Reader
from .hf_disk import HFDiskReader, is_hf_folder
from .imagefolder import ImageFolderReader, looks_like_imagefolder
from .parquet import ParquetReader
from .webdataset import WebDatasetReader

FORMATS = ("arrow", "hf", "parquet", "imagefolder", "webdataset")


def detect_format(path: Path) -> str:
    if path.is_file():
        if path.suffix in ARROW_SUFFIXES:
            return "arrow"
        if path.suffix == ".parquet":
            return "parquet"
        if path.suffix == ".tar":
            return "webdataset"
    elif path.is_dir():
        if is_hf_folder(path) or (path / "dataset_dict.json").is_file():
            return "hf"
        names = os.listdir(path)
        for suffixes, fmt in ((ARROW_SUFFIXES, "arrow"), ((".parquet",), "parquet"), ((".tar",), "webdataset")):
            if any(n.endswith(suffixes) for n in names):
                return fmt
        if looks_like_imagefolder(path):
            return "imagefolder"
    elif not path.exists():
        raise DatasetError(f"dataset {path} does not exist")
    raise DatasetError(
        f"cannot tell the format of {path}: expected one of {', '.join(FORMATS)} "
        "(an .arrow/.feather/.parquet/.tar file or folder, a save_to_disk folder, or class folders of images)"
    )


def open_dataset(
    path: str | os.PathLike, *, name: str | None = None, format: str | None = None, cache_dir: str | None = None
) -> Reader:
    """A reader for the dataset at `path`; `format` is detected when not given."""
    p = Path(path)
    fmt = format or detect_format(p)
    name = name or default_name(str(p))
    if fmt == "arrow":
        return ArrowIPCReader(name, str(p))
    if fmt == "hf":
        return HFDiskReader(name, str(p))
    if fmt == "parquet":
        return ParquetReader(name, str(p))
    if fmt == "imagefolder":
        return ImageFolderReader(name, str(p))
    if fmt == "webdataset":
        return WebDatasetReader(name, str(p), cache_dir=cache_dir)
    raise DatasetError(f"unknown dataset format {fmt!r}; formats: {', '.join(FORMATS)}")


def resolve_under_roots(path: str | os.PathLike, roots: Sequence[str]) -> Path:
    """`path` with symlinks and '..' resolved, if it lies under one of `roots`."""
    real = Path(os.path.realpath(path))
    for root in roots:
        r = Path(os.path.realpath(root))
        if real == r or r in real.parents:
            return real
    raise OutsideRootsError(f"dataset path {path} resolves to {real}, outside the data roots {list(roots)}")
