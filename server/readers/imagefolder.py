"""TorchVision ImageFolder trees: root/<class>/<...>/<file>, the same samples and labels.

As in `torchvision.datasets.ImageFolder`: the classes are the sorted names of the
subfolders of root, the label is the class's position, and each class folder is walked
(following links) in sorted order with sorted file names. Files count when their
extension is one of IMAGE_EXTENSIONS, in any case.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..storage import Store, default_local_store
from .base import DatasetError, DatasetInfo, ImagePayload, Reader
from .images import IMAGE_EXTENSIONS, ImageItem, checked_format, image_payload, is_image_name, read_bytes


def looks_like_imagefolder(store: Store, path: str) -> bool:
    """Some subfolder of `path` directly holds an image file."""
    if not store.is_dir(path):
        return False
    return any(
        any(is_image_name(f.path) for f in store.list_dir(store.join(path, sub))[1]) for sub in store.list_dir(path)[0]
    )


class ImageFolderReader(Reader):
    format = "imagefolder"
    #: Decode every image in `encode` before sending it (--verify-images).
    verify_images = False

    def __init__(self, name: str, path: str, store: Store | None = None):
        super().__init__(name, path, store=store if store is not None else default_local_store())
        store = self.store
        if not store.is_dir(path):
            raise DatasetError(f"ImageFolder {store.url(path)} is not a folder")
        self.root = path
        self.classes = store.list_dir(path)[0]
        self.keys: list[str] = []  # file paths relative to root, '/'-separated
        self.labels: list[int] = []
        for label, cls in enumerate(self.classes):
            for rel in self._walk(cls):
                self.keys.append(rel)
                self.labels.append(label)
        if not self.keys:
            raise DatasetError(
                f"ImageFolder {store.url(path)}: no image files ({', '.join(IMAGE_EXTENSIONS)}) in its class folders "
                f"{self.classes[:10]}"
            )

    def _walk(self, cls: str) -> list[str]:
        """Image files under root/cls in torchvision's order: folders sorted by path (as
        `sorted(os.walk(...))` does), each folder's files sorted by name."""
        folders: list[tuple[str, list[str]]] = []
        todo = [cls]
        while todo:
            rel = todo.pop()
            dirs, files = self.store.list_dir(self.store.join(self.root, rel))
            folders.append((rel, sorted(f.path.rsplit("/", 1)[-1] for f in files if is_image_name(f.path))))
            todo.extend(f"{rel}/{d}" for d in dirs)
        return [f"{rel}/{name}" for rel, names in sorted(folders) for name in names]

    def __len__(self) -> int:
        return len(self.keys)

    def info(self) -> DatasetInfo:
        return DatasetInfo(
            name=self.name, num_rows=len(self), kind="image", format=self.format, path=self.path, classes=tuple(self.classes)
        )

    async def read(self, index: int, columns: Sequence[str] = ()) -> ImageItem:
        self.check_index(index)
        key = self.keys[index]
        path = self.store.join(self.root, key)
        where = self.store.url(path)
        data = await read_bytes(self.store, path, index, where)
        return ImageItem(index, data, self.labels[index], checked_format(data, index, where), key, where)

    def encode(self, items: Sequence[ImageItem], columns: Sequence[str] = (), decode_images: bool = False) -> ImagePayload:
        return image_payload(items, decode_images, self.verify_images)
