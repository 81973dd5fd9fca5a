"""Turn a RawBatch into the list of samples a `collate_fn` expects.

Table rows become dicts of column -> value; numeric list columns become tensors (NumPy
arrays in the "numpy" format) so that collation stacks them, and Hugging Face `Image`
columns are decoded like images. Images are decoded (or left encoded), giving {"image":
uint8 CHW tensor | uint8 HWC array | PIL image | bytes, "label": int}: JPEGs by simplejpeg (libjpeg-turbo with Pillow's
settings: the same pixels, about 3x faster on small images, where Pillow's per-image
overhead dominates; decoding is the trainer's main per-sample CPU cost), everything else,
and any JPEG simplejpeg refuses (CMYK, corrupt), by Pillow.
"""

from __future__ import annotations

import functools
import io
import json
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from croupier.v1 import croupier_pb2 as pb

from croupier.client.assemble import RawBatch

try:  # optional: without it every image goes through Pillow
    import simplejpeg as _simplejpeg
except ImportError:  # pragma: no cover - a platform without its wheel
    _simplejpeg = None
_FAST_JPEG_COLORSPACES = ("YCbCr", "Gray")

ImageDecode = Literal["tensor", "numpy", "pil", "none"]
#: What a Loader's batches are made of: torch tensors, or NumPy arrays (torch never imported).
BatchFormat = Literal["torch", "numpy"]


def _tensor(arr: np.ndarray) -> Any:
    import torch  # here, not at the top: the "numpy" format never imports torch

    return torch.from_numpy(arr)


def _array(arr: np.ndarray) -> np.ndarray:
    return arr


@dataclass(frozen=True)
class ImageDecoding:
    """How a Loader turns images into sample values: those of image datasets and the
    `Image` columns of Hugging Face datasets alike.

    output: "tensor" (a uint8 CHW torch tensor), "numpy" (a uint8 HWC array, what
        Pillow, JAX and TensorFlow use), "pil" (a PIL image) or "none" (the encoded bytes).
        A Loader with format="numpy" reads "tensor" as "numpy".
    on_server: the server decodes (raw pixels on the wire: more bytes, no decoding here).
    workers: threads decoding a batch here (0 or 1: inline). None: tuned while running
        (client/decode_tuner.py), from 2 up to the CPU count; a number given is kept.
    """

    output: ImageDecode = "tensor"
    on_server: bool = False
    workers: int | None = None


class SampleDecodeError(ValueError):
    """A sample's payload cannot be decoded (bytes that are not an image...)."""


def _numeric_list(t: pa.DataType) -> bool:
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t = t.value_type
        if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
            return True
    return False


def _leaf_dtype(t: pa.DataType) -> np.dtype:
    while hasattr(t, "value_type"):
        t = t.value_type
    return np.dtype(t.to_pandas_dtype())


def _column_values(col: pa.ChunkedArray, fmt: BatchFormat = "torch") -> list[Any]:
    if _numeric_list(col.type):
        dtype = _leaf_dtype(col.type)  # keep Arrow's dtype (int32 token ids stay int32)
        wrap = _array if fmt == "numpy" else _tensor
        return [None if v is None else wrap(np.array(v, dtype=dtype)) for v in col.to_pylist()]
    return col.to_pylist()


def hf_image_columns(schema: pa.Schema) -> list[str]:
    """Columns that Hugging Face `datasets` features declare as `Image` (stored as a
    struct of bytes and path; `load_from_disk` decodes them on access)."""
    meta = (schema.metadata or {}).get(b"huggingface")
    return [name for name in _image_features(meta) if name in schema.names] if meta else []


@functools.lru_cache(maxsize=16)
def _image_features(meta: bytes) -> tuple[str, ...]:
    # Every batch of a stream carries the same metadata: parse it once, not per batch.
    try:
        features = json.loads(meta).get("info", {}).get("features", {}) or {}
    except (ValueError, AttributeError):
        return ()
    return tuple(name for name, f in features.items() if isinstance(f, dict) and f.get("_type") == "Image")


def _hf_image(value: dict[str, Any] | None, mode: ImageDecode, index: int, column: str) -> Any:
    if value is None:
        return None
    data = value.get("bytes")
    if data is None:
        # The row points at a file on the server's disk, which this trainer cannot open.
        raise SampleDecodeError(
            f"sample {index}, column {column!r}: the Image feature holds only a path ({value.get('path')!r}), "
            "no bytes; store the images' bytes in the dataset (datasets' Image(decode=True) on save) to serve it"
        )
    return decode_image(pb.Image(data=data, key=value.get("path") or ""), mode, index)


def table_samples(
    table: pa.Table, mode: ImageDecode = "tensor", indices: np.ndarray | None = None, pool: Executor | None = None,
    fmt: BatchFormat = "torch",
) -> list[dict[str, Any]]:
    """Rows as dicts; Hugging Face `Image` columns decoded as `mode` says, like image datasets.
    Numeric list columns become tensors, or arrays in the "numpy" format."""
    columns = {name: _column_values(table.column(name), fmt) for name in table.column_names}
    if mode != "none":
        idx = indices.tolist() if indices is not None else list(range(table.num_rows))
        for name in hf_image_columns(table.schema):
            values = columns[name]
            columns[name] = parallel_map(_hf_image, pool, values, [mode] * len(values), idx, [name] * len(values))
    return [{name: values[i] for name, values in columns.items()} for i in range(table.num_rows)]


def _fixed_width_numeric(col: pa.ChunkedArray) -> np.ndarray | None:
    """A list column whose rows all have one length -> (rows, width) array, else None."""
    arr = col.combine_chunks()
    if arr.null_count or not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)
                              or pa.types.is_fixed_size_list(arr.type)):
        return None
    value_type = arr.type.value_type
    if not (pa.types.is_integer(value_type) or pa.types.is_floating(value_type)):
        return None
    if pa.types.is_fixed_size_list(arr.type):
        width = arr.type.list_size
        values = arr.flatten()
    else:
        offsets = arr.offsets.to_numpy()
        widths = np.diff(offsets)
        if len(widths) == 0 or (widths != widths[0]).any():
            return None
        width = int(widths[0])
        values = arr.flatten()
    if values.null_count:
        return None
    return values.to_numpy(zero_copy_only=False).reshape(len(arr), width)


def collate_table(table: pa.Table, fmt: BatchFormat = "torch") -> dict[str, Any] | None:
    """`default_collate(table_samples(table))` (or `numpy_collate`'s, for "numpy"), built
    column-wise without per-row Python.

    Returns None when a column has a type or nulls this fast path does not cover, in
    which case the caller goes through the samples. tests/test_client_collate.py pins
    the equality with default_collate.
    """
    wrap = _array if fmt == "numpy" else _tensor
    out: dict[str, Any] = {}
    for name in table.column_names:
        col = table.column(name)
        t = col.type
        if col.null_count:
            return None
        if pa.types.is_integer(t):
            out[name] = wrap(col.to_numpy().astype(np.int64))
        elif pa.types.is_floating(t):
            out[name] = wrap(col.to_numpy().astype(np.float64))
        elif pa.types.is_boolean(t):
            out[name] = wrap(col.to_numpy(zero_copy_only=False).astype(bool))
        elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
            out[name] = col.to_pylist()
        elif _numeric_list(t):
            arr = _fixed_width_numeric(col)
            if arr is None:
                return None
            out[name] = wrap(np.array(arr, copy=True))
        else:
            return None
    return out


def decode_image(im: pb.Image, mode: ImageDecode, index: int) -> Any:
    if mode == "none":
        return im.data
    if im.format == "raw":
        arr = np.frombuffer(im.data, dtype=np.uint8).reshape(im.height, im.width, im.channels)
        if mode == "pil":
            from PIL import Image

            return Image.fromarray(arr)
        return _pixels(arr.copy(), mode)
    from PIL import Image, UnidentifiedImageError

    if mode in ("tensor", "numpy") and _simplejpeg is not None and im.data[:3] == b"\xff\xd8\xff":
        try:
            # YCbCr and grayscale only: those decode to Pillow's pixels exactly (Pillow
            # converts CMYK/YCCK its own way); and no larger than Pillow's decompression-bomb
            # limit, so Pillow still warns about or refuses those as before.
            h, w, colorspace, _ = _simplejpeg.decode_jpeg_header(im.data)
            limit = Image.MAX_IMAGE_PIXELS
            if colorspace in _FAST_JPEG_COLORSPACES and (limit is None or h * w <= limit):
                return _pixels(_simplejpeg.decode_jpeg(im.data, colorspace="RGB"), mode)
        except ValueError:
            pass  # corrupt: Pillow's error says why

    try:
        with Image.open(io.BytesIO(im.data)) as img:
            img = img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise SampleDecodeError(f"sample {index} ({im.key or 'no key'}): not a decodable image: {exc}") from exc
    if mode == "pil":
        return img
    return _pixels(np.asarray(img).copy(), mode)


def _pixels(hwc: np.ndarray, mode: ImageDecode) -> Any:
    """Decoded uint8 HWC pixels as `mode` wants them: the array itself, or a CHW tensor view."""
    return hwc if mode == "numpy" else _tensor(hwc).permute(2, 0, 1)


def numpy_collate(samples: list[Any]) -> Any:
    """The NumPy counterpart of `default_collate`: dicts collate key by key; arrays of one
    shape stack (images: [B, H, W, C] uint8); ints become int64, floats float64, bools
    bool arrays; strings, bytes and anything else (arrays of unequal shapes, None) stay
    a list."""
    first = samples[0]
    if isinstance(first, dict):
        return {key: numpy_collate([s[key] for s in samples]) for key in first}
    if isinstance(first, np.ndarray) and all(isinstance(s, np.ndarray) and s.shape == first.shape for s in samples):
        return np.stack(samples)
    if all(isinstance(s, (bool, np.bool_)) for s in samples):
        return np.asarray(samples, dtype=np.bool_)
    if all(isinstance(s, (int, np.integer)) for s in samples):
        return np.asarray(samples, dtype=np.int64)
    if all(isinstance(s, (int, float, np.integer, np.floating)) for s in samples):
        return np.asarray(samples, dtype=np.float64)
    return list(samples)


def _run(fn: Any, args: tuple[list[Any], ...]) -> list[Any]:
    return list(map(fn, *args))


def parallel_map(fn: Any, pool: Executor | None, *args: list[Any]) -> list[Any]:
    """`list(map(fn, *args))`, in as many contiguous slices as `pool` has threads: the first
    on the calling thread, the rest each one task of the pool. One task per item cost a
    thread hand-off per image (about 170 us of CPU on a small VM, against 45 us to decode a
    64x64 JPEG), more than the decode itself. The first error in order is raised."""
    n = len(args[0])
    parts = min(getattr(pool, "_max_workers", 1), n) if pool is not None else 1
    if parts <= 1:
        return _run(fn, args)
    bounds = [n * k // parts for k in range(parts + 1)]
    futures = [pool.submit(_run, fn, tuple(a[lo:hi] for a in args))  # type: ignore[union-attr]
               for lo, hi in zip(bounds[1:-1], bounds[2:])]
    out = _run(fn, tuple(a[:bounds[1]] for a in args))
    for f in futures:
        out += f.result()
    return out


def image_samples(
    images: list[pb.Image], indices: np.ndarray, mode: ImageDecode, pool: Executor | None = None
) -> list[dict[str, Any]]:
    """Decode a batch's images; with `pool`, in parallel (Pillow releases the GIL while decoding)."""
    decoded = parallel_map(decode_image, pool if mode != "none" else None, images, [mode] * len(images), indices.tolist())
    return [{"image": img, "label": int(im.label)} for img, im in zip(decoded, images)]


def raw_batch_samples(raw: RawBatch, mode: ImageDecode = "tensor", pool: Executor | None = None,
                      fmt: BatchFormat = "torch") -> list[dict[str, Any]]:
    if raw.table is not None:
        return table_samples(raw.table, mode, raw.indices, pool, fmt)
    assert raw.images is not None
    return image_samples(raw.images, raw.indices, mode, pool)
