"""TorchVision ImageFolder trees: root/<class>/<file>, classes sorted, label = class number."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import aiofiles

from .base import DatasetError, DatasetInfo, ImagePayload, Reader, SampleError
from .images import IMAGE_EXTENSIONS, checked_format, image_payload


def is_image_file(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def looks_like_imagefolder(path: Path) -> bool:
    if not path.is_dir():
        return False
    for sub in path.iterdir():
        if sub.is_dir() and any(is_image_file(f) for f in os.listdir(sub)):
            return True
    return False


class ImageFolderReader(Reader):
    format = "imagefolder"

    def __init__(self, name: str, path: str):
        super().__init__(name, path)
        root = Path(path)
        if not root.is_dir():
            raise DatasetError(f"ImageFolder {path} is not a folder")
        self.classes = sorted(d.name for d in root.iterdir() if d.is_dir())
        self.files: list[str] = []
        self.labels: list[int] = []
        for label, cls in enumerate(self.classes):
            for dirpath, _dirs, names in sorted(os.walk(root / cls, followlinks=True)):
                for fname in sorted(names):
                    if is_image_file(fname):
                        self.files.append(os.path.join(dirpath, fname))
                        self.labels.append(label)
        if not self.files:
            raise DatasetError(f"ImageFolder {path}: no images ({', '.join(IMAGE_EXTENSIONS)}) in class folders")
        self.root = root

    def __len__(self) -> int:
        return len(self.files)

    def info(self) -> DatasetInfo:
        return DatasetInfo(
            name=self.name,
            num_rows=len(self),
            kind="image",
            format=self.format,
            path=self.path,
            classes=tuple(self.classes),
        )

    async def read(self, index: int) -> tuple[int, bytes, int, str, str]:
        self.check_index(index)
        path = self.files[index]
        try:
            async with aiofiles.open(path, "rb") as f:
                data = await f.read()
        except OSError as exc:
            raise SampleError(f"sample {index} ({path}): cannot read: {exc}", index=index, path=path) from exc
        key = os.path.relpath(path, self.root)
        return index, data, self.labels[index], checked_format(data, index, path), key

    def encode(self, items: Sequence, columns: Sequence[str] = (), decode_images: bool = False) -> ImagePayload:
        return image_payload(items, decode_images)
