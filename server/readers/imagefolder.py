"""TorchVision ImageFolder trees: root/<class>/<...>/<file>, the same samples and labels.

As in `torchvision.datasets.ImageFolder`: the classes are the sorted names of the
subfolders of root, the label is the class's position, and each class folder is walked
(following links) in sorted order with sorted file names. Files count when their
extension is one of IMAGE_EXTENSIONS, in any case.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..storage import Store, default_local_store
from ..storage.mounts import object_store_mount_client
from .base import DatasetError, DatasetInfo, ImagePayload, Reader, SampleError
from .images import (IMAGE_EXTENSIONS, ImageItem, checked_format, image_nbytes, image_payload, is_image_name, read_bytes,
                     read_error, sound_jpegs)
from .listing import Progress, Tree
from .tree_cache import cached_tree


def _walk(tree: Tree, cls: str) -> Iterator[str]:
    """Image files under root/cls in torchvision's order: folders sorted by path (as
    `sorted(os.walk(...))` does), each folder's files sorted by name."""
    folders, todo = [], [cls]
    while todo:
        rel = todo.pop()
        folders.append(rel)
        todo.extend(f"{rel}/{d}" for d in tree[rel][0])
    for rel in sorted(folders):
        yield from (f"{rel}/{name}" for name in tree[rel][1] if is_image_name(name))


def image_class_folders(store: Store, path: str, dirs: Sequence[str], limit: int) -> list[str]:
    """The first `limit` of `dirs` (subfolders of `path`) that directly hold an image file."""
    found: list[str] = []
    for sub in dirs:
        if len(found) >= limit:
            break
        if any(is_image_name(f) for f in store.list_names(store.join(path, sub))[1]):
            found.append(sub)
    return found


def _concatenated(store: Store, path: str) -> tuple[str | None, str | None]:
    """(prefix, url base): `store.join(path, key)` is prefix + key and `store.url(p)` is url
    base + p, for every key, as two probes show; None for either where they are not."""
    probes = ("a/b.jpg", "c d/e.png")
    joined = store.join(path, probes[0])
    prefix = joined[:-len(probes[0])] if joined.endswith(probes[0]) else None
    if prefix is None or any(store.join(path, p) != prefix + p for p in probes):
        return None, None
    named = store.url(prefix + probes[0])
    base = named[:-len(prefix + probes[0])] if named.endswith(prefix + probes[0]) else None
    if base is None or any(store.url(prefix + p) != base + prefix + p for p in probes):
        base = None
    return prefix, base


class ImageFolderReader(Reader):
    format = "imagefolder"
    #: Decode every image in `encode` before sending it (--verify-images).
    verify_images = False

    def __init__(
        self, name: str, path: str, store: Store | None = None, cache_dir: str | os.PathLike[str] | None = None,
        progress: Progress | None = None,
    ):
        super().__init__(name, path, store=store if store is not None else default_local_store())
        store = self.store
        if not store.is_dir(path):
            raise DatasetError(f"ImageFolder {store.url(path)} is not a folder")
        self.root = path
        self.progress = progress or Progress(f"dataset {name} ({store.url(path)})")
        # One listing per folder, no request per file; cached between starts where the
        # folders' mtimes say when they changed (tree_cache.py).
        on_bucket_mount = store.scheme == "file" and object_store_mount_client(path) is not None
        tree, self.index_cached = cached_tree(store, path, self.progress, cache_dir, "imagefolder", not on_bucket_mount)
        self.classes = tree[""][0]
        self.keys: list[str] = []  # file paths relative to root, '/'-separated
        self.labels: list[int] = []
        for label, cls in enumerate(self.classes):
            for rel in _walk(tree, cls):
                self.keys.append(rel)
                self.labels.append(label)
        if not self.keys:
            raise DatasetError(
                f"ImageFolder {store.url(path)}: no image files ({', '.join(IMAGE_EXTENSIONS)}) in its class folders "
                f"{self.classes[:10]}"
            )
        # A file's path and name for messages by string concatenation where the store's own
        # `join` and `url` give the same (a local file system: "/data/x/" + key; a bucket:
        # "x/" + key, named "s3://bucket/" + that): three forwarding stores deep, those calls
        # were two microseconds of the loop's time per image.
        self._prefix, self._url_base = _concatenated(store, path)
        plan = getattr(store, "plan_whole_files", None)  # the server's cache: what its fill reads, in order
        if plan is not None:
            plan([self._path(k) for k in self.keys])

    def _path(self, key: str) -> str:
        return self._prefix + key if self._prefix is not None else self.store.join(self.root, key)

    def _where(self, path: str) -> str:
        return self._url_base + path if self._url_base is not None else self.store.url(path)

    def __len__(self) -> int:
        return len(self.keys)

    def info(self) -> DatasetInfo:
        return DatasetInfo(
            name=self.name, num_rows=len(self), kind="image", format=self.format, path=self.path, classes=tuple(self.classes)
        )

    async def read(self, index: int, columns: Sequence[str] = ()) -> ImageItem:
        self.check_index(index)
        key = self.keys[index]
        path = self._path(key)
        where = self._where(path)
        data = await read_bytes(self.store, path, index, where)
        return ImageItem(index, data, self.labels[index], checked_format(data, index, where), key, where)

    def start_read(self, index: int, columns: Sequence[str], done: Callable[[ImageItem | None, BaseException | None], None]) -> bool:
        """`read` without a task or a coroutine where the store reads files whole by callback
        (`Store.submit_whole`): the same item, and the same errors, passed to `done`."""
        if not 0 <= index < len(self.keys):
            return False  # `read` raises the index error
        path = self._path(self.keys[index])
        return self.store.submit_whole(path, functools.partial(self._landed, index, path, done))

    def _landed(self, index: int, path: str, done: Callable[[ImageItem | None, BaseException | None], None],
                data: bytes | None, err: BaseException | None) -> None:
        done(*self._item(index, path, data, err))

    def _item(self, index: int, path: str, data: bytes | None,
              err: BaseException | None) -> tuple[ImageItem | None, BaseException | None]:
        """What a read of image `index` returned, as `read` would return or raise it."""
        where = self._where(path)
        if err is not None:
            if isinstance(err, OSError):  # as read_bytes raises it; other errors (a link out of the roots) as they are
                cause, err = err, read_error(self.store, path, index, where, err)
                err.__cause__ = cause
            return None, err
        assert data is not None
        try:
            fmt = checked_format(data, index, where)
        except SampleError as exc:
            return None, exc
        return ImageItem(index, data, self.labels[index], fmt, self.keys[index], where), None

    @property
    def reads_in_groups(self) -> bool:  # type: ignore[override]
        """A group of images is one storage call (`start_reads`) where the store reads files
        in groups: by native threads, or by GETs on the loop (an S3 bucket)."""
        return self.store.reads_files_in_groups

    def start_reads(self, indices: Sequence[int], columns: Sequence[str],
                    done: Callable[[list[tuple[int, ImageItem | None, BaseException | None]]], None]) -> Sequence[int]:
        """The images of `indices` read whole by one storage call (`Store.submit_files`), each
        handed to `done` as it lands, those landed since the loop last woke in one call: the
        per-image Python of the store's layers paid once a group. All left to `start_read`
        where the store cannot."""
        n = len(self.keys)
        if not indices or not all(0 <= i < n for i in indices):
            return range(len(indices))
        paths = [self._path(self.keys[i]) for i in indices]
        if not self.store.submit_files(paths, False, functools.partial(self._files_landed, indices, paths, done)):
            return range(len(indices))
        return ()

    def _files_landed(self, indices: Sequence[int], paths: list[str], done: Callable, got: list[tuple[int, Any, Any]]) -> None:
        # Sound JPEGs (most images) checked by one call for the group and made items here;
        # anything else through `_item`, which names what is wrong.
        item, keys, labels, base = self._item, self.keys, self.labels, self._url_base
        out = []
        for (pos, data, err), sound in zip(got, sound_jpegs(got)):
            if sound:
                i, path = indices[pos], paths[pos]
                name = base + path if base is not None else self._where(path)
                out.append((pos, ImageItem(i, data, labels[i], "jpeg", keys[i], name), None))
            else:
                out.append((pos, *item(indices[pos], paths[pos], data, err)))
        done(out)

    def item_sizer(self, columns: Sequence[str] = ()) -> Callable[[ImageItem], int]:
        return image_nbytes

    def close(self) -> None:
        forget = getattr(self.store, "forget_whole_files", None)  # the server's cache lets this dataset's images go
        if forget is not None:
            forget()

    def encode(self, items: Sequence[ImageItem], columns: Sequence[str] = (), decode_images: bool = False) -> ImagePayload:
        return image_payload(items, decode_images, self.verify_images)

    def encodes_on_loop(self, decode_images: bool, nbytes: int) -> bool:
        return not decode_images and not self.verify_images  # records of the bytes as read
