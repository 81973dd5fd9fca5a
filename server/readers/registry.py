"""Open a dataset by path, detecting its format, and keep paths inside the data roots."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .arrow_ipc import ARROW_SUFFIXES, ArrowIPCReader
from ..storage import Store, default_local_store
from ..storage.mounts import object_store_mount
from .base import DatasetError, OutsideRootsError, Reader
from .hf_disk import HFDiskReader, is_hf_folder
from .imagefolder import ImageFolderReader, image_class_folders
from .images import is_image_name
from .parquet import ParquetReader
from .webdataset import WebDatasetReader

log = logging.getLogger("croupier.server.open")

_Opener = Callable[[str, str, "str | None", Store], Reader]

#: Format name -> opener(name, path in the store, cache_dir, store).
OPENERS: dict[str, _Opener] = {
    "arrow": lambda name, path, cache_dir, store: ArrowIPCReader(name, path, store=store, cache_dir=cache_dir),
    "hf": lambda name, path, cache_dir, store: HFDiskReader(name, path, store=store, cache_dir=cache_dir),
    "parquet": lambda name, path, cache_dir, store: ParquetReader(name, path, store=store),
    "imagefolder": lambda name, path, cache_dir, store: ImageFolderReader(name, path, store=store, cache_dir=cache_dir),
    "webdataset": lambda name, path, cache_dir, store: WebDatasetReader(name, path, cache_dir=cache_dir, store=store),
}
FORMATS = tuple(OPENERS)

#: File suffix -> format, for a file or a folder of such files.
SUFFIX_FORMATS = {**{s: "arrow" for s in ARROW_SUFFIXES}, ".parquet": "parquet", ".tar": "webdataset"}

_LAYOUTS = (
    "an .arrow/.feather/.ipc file or folder of them (arrow), a Dataset.save_to_disk folder (hf), "
    "a .parquet file or folder (parquet), class folders of images (imagefolder), "
    "a .tar shard or folder of shards (webdataset)"
)


def detect_format(path: str | os.PathLike, store: Store | None = None) -> str:
    """The format of the dataset at `path` (of `store`), from its suffix or the files it holds."""
    store = store if store is not None else default_local_store()
    path = os.fspath(path)
    suffix = os.path.splitext(path.rstrip("/"))[1].lower()
    if store.is_file(path):
        fmt = SUFFIX_FORMATS.get(suffix)
        if fmt is not None:
            return fmt
    elif store.is_dir(path):
        if is_hf_folder(store, path):
            return "hf"
        found = folder_formats(store, path)
        if len(found) > 1:
            kinds = "; ".join(f"{fmt}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}" for fmt, names in found.items())
            raise DatasetError(
                f"dataset folder {store.url(path)} mixes formats ({kinds}); a dataset folder holds one format, "
                "served as a whole: move the others out, or serve each file or folder as its own dataset"
            )
        if found:
            return next(iter(found))
    else:
        raise DatasetError(f"dataset {store.url(path)} does not exist")
    raise DatasetError(
        f"cannot tell the format of {store.url(path)}; expected one of: {_LAYOUTS}; formats: {', '.join(FORMATS)}"
    )


def folder_formats(store: Store, path: str) -> dict[str, list[str]]:
    """The formats whose data folder `path` holds -> the names showing each (sorted):
    its files by suffix, loose images, and class folders of images (imagefolder, the
    first three found). Listings by name only: no request per file."""
    found: dict[str, list[str]] = {}
    dirs, files = store.list_names(path)
    for name in files:
        suffix = os.path.splitext(name)[1].lower()
        fmt = SUFFIX_FORMATS.get(suffix) or ("images" if is_image_name(name) else None)
        if fmt is not None:
            found.setdefault(fmt, []).append(name)
    classes = image_class_folders(store, path, dirs, limit=3)
    if classes:
        found["imagefolder"] = [f"{d}/" for d in classes]
    if set(found) == {"images"}:
        return {}  # loose images with no class folders: not a dataset (the caller says which layouts are)
    return found


def default_name(path: str | os.PathLike) -> str:
    """The basename of `path` without its data suffix: /data/c4-train.parquet -> c4-train."""
    base = os.path.basename(os.path.normpath(os.fspath(path).split("://", 1)[-1]))
    stem, suffix = os.path.splitext(base)
    return stem if suffix.lower() in SUFFIX_FORMATS and stem else base


def open_dataset(
    path: str | os.PathLike,
    *,
    name: str | None = None,
    format: str | None = None,
    cache_dir: str | None = None,
    store: Store | None = None,
    storage_options: Mapping[str, Any] | None = None,
    wrap_object_store: Callable[[Store], Store] | None = None,
) -> Reader:
    """A reader for the dataset at `path`; `format` (one of FORMATS) is detected when not given.

    `path` is a file-system path (read through `store`, by default the process's
    LocalStore) or an object-store URL such as s3://bucket/prefix, whose store is
    configured from the environment as the cloud SDKs are (AWS_ENDPOINT_URL,
    AWS_ACCESS_KEY_ID, AWS_REGION...) and `storage_options` over it, read through
    `wrap_object_store(store)` when given (the server's cache). Blocking (reads
    metadata, may scan tar shards): the server calls it in an executor.
    """
    location = os.fspath(path)
    if "://" in location and not location.startswith("file://"):
        from ..storage.urls import open_store

        store, key = open_store(location, options=storage_options)
        if wrap_object_store is not None:
            store = wrap_object_store(store)
    else:
        store = store if store is not None else default_local_store()
        key = os.path.abspath(location.removeprefix("file://"))
        if not os.path.exists(key):
            raise DatasetError(f"dataset {key} does not exist")
    name = name or default_name(location)
    # A FUSE client of a bucket under a local path: say so, with the URL to serve instead.
    mount = object_store_mount(key) if store.scheme == "file" else None
    if mount is not None:
        log.warning("%s", mount.message(name, key))
    fmt = format or detect_format(key, store)
    opener = OPENERS.get(fmt)
    if opener is None:
        raise DatasetError(f"dataset {store.url(key)}: unknown format {fmt!r}; formats: {', '.join(FORMATS)}")
    reader = opener(name, key, cache_dir, store)
    reader.path = store.url(key)  # what the user named: messages and DatasetInfo show it
    reader.object_store_mount = mount
    return reader


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
