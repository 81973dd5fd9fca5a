"""TorchVision ImageFolder trees: root/<class>/<...>/<file>, the same samples and labels.

As in `torchvision.datasets.ImageFolder`: the classes are the sorted names of the
subfolders of root, the label is the class's position, and each class folder is walked
(following links) in sorted order with sorted file names. Files count when their
extension is one of IMAGE_EXTENSIONS, in any case.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .base import DatasetError, DatasetInfo, ImagePayload, Reader
from .images import IMAGE_EXTENSIONS, ImageItem, checked_format, image_payload, is_image_name, read_bytes


def looks_like_imagefolder(path: Path) -> bool:
    """Some subfolder of `path` directly holds an image file."""
    return path.is_dir() and any(
        sub.is_dir() and any(is_image_name(f) for f in os.listdir(sub)) for sub in path.iterdir()
    )


class ImageFolderReader(Reader):
    format = "imagefolder"

    def __init__(self, name: str, path: str):
        super().__init__(name, path)
        root = Path(path)
        if not root.is_dir():
            raise DatasetError(f"ImageFolder {path} is not a folder")
        self.root = root
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        self.keys: list[str] = []  # file paths relative to root
        self.labels: list[int] = []
        for label, cls in enumerate(self.classes):
            for dirpath, _dirs, names in sorted(os.walk(root / cls, followlinks=True)):
                rel = os.path.relpath(dirpath, root)
                for fname in sorted(names):
                    if is_image_name(fname):
                        self.keys.append(os.path.join(rel, fname))
                        self.labels.append(label)
        if not self.keys:
            raise DatasetError(
                f"ImageFolder {path}: no image files ({', '.join(IMAGE_EXTENSIONS)}) in its class folders "
                f"{self.classes[:10]}"
            )

    def __len__(self) -> int:
        return len(self.keys)

    def info(self) -> DatasetInfo:
        return DatasetInfo(
            name=self.name, num_rows=len(self), kind="image", format=self.format, path=self.path, classes=tuple(self.classes)
        )

    async def read(self, index: int) -> ImageItem:
        self.check_index(index)
        key = self.keys[index]
        path = os.path.join(self.path, key)
        data = await read_bytes(path, index, path, self.executor)
        return ImageItem(index, data, self.labels[index], checked_format(data, index, path), key, path)

    def encode(self, items: Sequence[ImageItem], columns: Sequence[str] = (), decode_images: bool = False) -> ImagePayload:
        return image_payload(items, decode_images)
