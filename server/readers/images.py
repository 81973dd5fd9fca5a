"""What image readers share: reading bytes through the store, sniffing formats,
building records, and decoding on the server when a client asks for it."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ..storage import Store
from .base import ImagePayload, ImageRecord, SampleError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif")

_MAGIC = (
    (b"\xff\xd8\xff", "jpeg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"BM", "bmp"),
)


class ImageItem(NamedTuple):
    """What an image reader's `read` hands to `encode`."""

    index: int
    data: bytes
    label: int
    format: str
    key: str  # sent with the record: path relative to the dataset, or tar member name
    where: str  # for error messages: the full file (and member)


def is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


async def read_bytes(store: Store, path: str, index: int, where: str, offset: int = 0, size: int = -1) -> bytes:
    """`size` bytes at `offset` of `path` (the whole file for -1), one real read on the
    store (a pread on its I/O pool, a range GET); errors name `where` and `index`."""
    try:
        data = await store.read(path, offset, size)
    except OSError as exc:
        raise SampleError(f"sample {index} ({where}): cannot read: {exc}", index=index, path=store.url(path)) from exc
    if size >= 0 and len(data) != size:
        raise SampleError(
            f"sample {index} ({where}): file is truncated ({len(data)} of {size} bytes)", index=index, path=store.url(path)
        )
    return data


def sniff_format(data: bytes) -> str | None:
    for magic, fmt in _MAGIC:
        if data.startswith(magic):
            return fmt
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def checked_format(data: bytes, index: int, where: str, path: str | None = None) -> str:
    """The image format of `data` from its magic bytes, or a SampleError naming file and index."""
    fmt = sniff_format(data)
    if fmt is None:
        raise SampleError(
            # The file's bytes are never echoed: an error may reach a client that must not see them.
            f"sample {index} ({where}): not an image (no JPEG, PNG, WebP, BMP or GIF signature in its first bytes)",
            index=index,
            path=path or where,
        )
    return fmt


def decode_rgb(item: ImageItem) -> ImageRecord:
    """The item's image as raw RGB bytes, height x width x 3, uint8."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(item.data)) as img:
            arr = np.asarray(img.convert("RGB"))
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise SampleError(
            f"sample {item.index} ({item.where}): cannot decode image: {exc}", index=item.index, path=item.where
        ) from exc
    h, w, c = arr.shape
    return ImageRecord(data=arr.tobytes(), label=item.label, format="raw", key=item.key, height=h, width=w, channels=c)


def image_payload(items: Sequence[ImageItem], decode_images: bool) -> ImagePayload:
    """One record per item, in chunk order: encoded bytes as read, or decoded RGB."""
    if decode_images:
        return ImagePayload([decode_rgb(it) for it in items])
    return ImagePayload([ImageRecord(data=it.data, label=it.label, format=it.format, key=it.key) for it in items])
