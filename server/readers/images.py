"""What image readers share: reading bytes through the store, sniffing formats,
building records, and decoding on the server when a client asks for it."""

from __future__ import annotations

import io
import struct
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
        raise read_error(store, path, index, where, exc) from exc
    if size >= 0 and len(data) != size:
        raise SampleError(
            f"sample {index} ({where}): file is truncated ({len(data)} of {size} bytes)", index=index, path=store.url(path)
        )
    return data


def read_error(store: Store, path: str, index: int, where: str, exc: OSError) -> SampleError:
    """The error of a sample whose file could not be read (`exc`), naming it and its index."""
    return SampleError(f"sample {index} ({where}): cannot read: {exc}", index=index, path=store.url(path))


def image_nbytes(item: ImageItem) -> int:
    """The bytes an image item adds to a chunk: its file's (base.item_nbytes would walk
    every field of the tuple, once per sample on the event loop)."""
    return len(item.data)


def sniff_format(data: bytes) -> str | None:
    for magic, fmt in _MAGIC:
        if data.startswith(magic):
            return fmt
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


#: JPEG markers of a frame header (SOF0..SOF15 but DHT, JPG and DAC), which give the size.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
#: Markers that stand alone, without a length (TEM, RST0..7, SOI).
_JPEG_STANDALONE = frozenset((0x01, *range(0xD0, 0xD8), 0xD8))
_MARKER = struct.Struct(">BBH")  # 0xFF, marker, segment length
_U16 = struct.Struct(">H")


def _jpeg_problem_py(data: bytes) -> str | None:
    """Walk the header segments to the start of scan: each has a length that fits, a
    frame header (SOF) gives a non-zero size, and an end-of-image marker follows the
    scan (about ten segments: a few microseconds, whatever the image's size)."""
    n, i, sized = len(data), 2, False
    unpack = _U16.unpack_from
    for _ in range(4096):  # bounded: real headers have tens of segments
        if i + 4 > n:
            return "the file ends inside its header (truncated?)"
        ff, marker, length = _MARKER.unpack_from(data, i)
        if ff != 0xFF:
            return f"no segment marker at byte {i} of its header (corrupt)"
        if marker == 0xFF:  # fill byte before a marker
            i += 1
            continue
        if marker in _JPEG_STANDALONE:
            i += 2
            continue
        if marker == 0xD9:
            return "it ends (end-of-image marker) before any image data"
        if length < 2 or i + 2 + length > n:
            return f"the header segment at byte {i} runs past the end of the file (truncated?)"
        if marker == 0xDA:  # start of scan: entropy-coded data, then EOI
            if not sized:
                return "image data starts before any frame header (SOF)"
            if data.rfind(b"\xff\xd9", i + 2 + length) < 0:
                return "no end-of-image marker after its image data (truncated or overwritten?)"
            return None
        if marker in _JPEG_SOF:
            if length < 8 or not unpack(data, i + 5)[0] or not unpack(data, i + 7)[0]:
                return "its frame header declares a zero width or height"
            sized = True
        i += 2 + length
    return "its header has too many segments (corrupt)"


try:  # optional: an install without a C compiler walks in Python; the same messages either way
    from ._imagecheck import jpeg_problem as _jpeg_problem, sound_jpegs as _sound_jpegs
except ImportError:  # pragma: no cover - built by the package's install
    _jpeg_problem = _jpeg_problem_py
    _sound_jpegs = None


def sound_jpegs(landed: Sequence[tuple[int, object, object]]) -> list[bool]:
    """For each (position, data, error) of a read group: True where the read did not fail
    and `data` is a JPEG with nothing wrong in its header (`checked_format` would return
    "jpeg"); False where `checked_format` must look (another format, or an error to name).
    One call a group where the C walk is built."""
    if _sound_jpegs is not None:
        return _sound_jpegs(landed)
    return [err is None and type(data) is bytes and data[:3] == b"\xff\xd8\xff" and _jpeg_problem(data) is None
            for _, data, err in landed]


def image_problem(data: bytes, fmt: str) -> str | None:
    """What is structurally wrong with an image of format `fmt` (None: nothing seen):
    header fields, declared sizes against the bytes present, end markers. A cheap check
    (no decode); it catches truncated files and headers followed by garbage, not every
    corruption of the compressed data (--verify-images decodes for that)."""
    n = len(data)
    if fmt == "jpeg":
        return _jpeg_problem(data)
    if fmt == "png":
        if n < 33:
            return "the file ends inside its header (truncated?)"
        if data[12:16] != b"IHDR":
            return "no IHDR header chunk (corrupt)"
        if not int.from_bytes(data[16:20], "big") or not int.from_bytes(data[20:24], "big"):
            return "its header declares a zero width or height"
        if data.rfind(b"IEND", 33) < 0:
            return "no IEND chunk at its end (truncated?)"
    elif fmt == "gif":
        if n < 14 or not data.rstrip(b"\0").endswith(b";"):
            return "no trailer byte at its end (truncated?)"
    elif fmt == "bmp":
        declared = int.from_bytes(data[2:6], "little")
        if n < 26 or declared > n or int.from_bytes(data[10:14], "little") >= n:
            return f"its header declares {declared} bytes and pixel data at byte {int.from_bytes(data[10:14], 'little')}, the file has {n} (truncated?)"
    elif fmt == "webp":
        declared = int.from_bytes(data[4:8], "little") + 8
        if declared > n:
            return f"its RIFF header declares {declared} bytes, the file has {n} (truncated?)"
    return None


def checked_format(data: bytes, index: int, where: str, path: str | None = None) -> str:
    """The image format of `data` from its magic bytes, its structure checked
    (`image_problem`); else a SampleError naming file and index."""
    fmt = sniff_format(data)
    if fmt is None:
        raise SampleError(
            # The file's bytes are never echoed: an error may reach a client that must not see them.
            f"sample {index} ({where}): not an image (no JPEG, PNG, WebP, BMP or GIF signature in its first bytes)",
            index=index,
            path=path or where,
        )
    problem = image_problem(data, fmt)
    if problem is not None:
        raise SampleError(f"sample {index} ({where}): corrupt {fmt.upper()} image: {problem}", index=index, path=path or where)
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


def verify_decodes(item: ImageItem) -> None:
    """Decode the item's image fully (and drop the pixels); SampleError naming the file
    and index when it does not decode (--verify-images)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(item.data)) as img:
            img.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise SampleError(
            f"sample {item.index} ({item.where}): corrupt image, it does not decode: {exc}", index=item.index, path=item.where
        ) from exc


def image_payload(items: Sequence[ImageItem], decode_images: bool, verify: bool = False) -> ImagePayload:
    """One record per item, in chunk order: encoded bytes as read, or decoded RGB;
    `verify` decodes each image first, sent as read (runs in the CPU pool, in encode)."""
    if decode_images:
        return ImagePayload([decode_rgb(it) for it in items])
    if verify:
        for it in items:
            verify_decodes(it)
    return ImagePayload([ImageRecord(data=it.data, label=it.label, format=it.format, key=it.key) for it in items])
