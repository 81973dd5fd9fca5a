"""What image readers share: sniffing formats, building records, server-side decoding."""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np

from .base import ImagePayload, ImageRecord, SampleError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif")

_MAGIC = (
    (b"\xff\xd8\xff", "jpeg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"BM", "bmp"),
)


def sniff_format(data: bytes) -> str | None:
    for magic, fmt in _MAGIC:
        if data.startswith(magic):
            return fmt
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def checked_format(data: bytes, index: int, where: str) -> str:
    """The image format of `data`, or a SampleError naming the file and index."""
    fmt = sniff_format(data)
    if fmt is None:
        raise SampleError(
            f"sample {index} ({where}): not an image (starts with {data[:8]!r}; expected JPEG, PNG, WebP, BMP or GIF)",
            index=index,
            path=where,
        )
    return fmt


def decode_rgb(data: bytes, index: int, where: str) -> ImageRecord:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            arr = np.asarray(img.convert("RGB"))
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise SampleError(f"sample {index} ({where}): cannot decode image: {exc}", index=index, path=where) from exc
    h, w, c = arr.shape
    return ImageRecord(data=arr.tobytes(), label=-1, format="raw", key=where, height=h, width=w, channels=c)


def image_payload(
    items: Sequence[tuple[int, bytes, int, str, str]], decode_images: bool
) -> ImagePayload:
    """items: (index, encoded bytes, label, format, key) per sample, in chunk order."""
    records = []
    for index, data, label, fmt, key in items:
        if decode_images:
            rec = decode_rgb(data, index, key)
            rec.label, rec.key = label, key
        else:
            rec = ImageRecord(data=data, label=label, format=fmt, key=key)
        records.append(rec)
    return ImagePayload(records)
