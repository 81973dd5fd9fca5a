"""Turn a RawBatch into the list of samples a `collate_fn` expects.

Table rows become dicts of column -> value; numeric list columns become tensors so
that `default_collate` stacks them. Images are decoded with Pillow (or left encoded),
giving {"image": uint8 CHW tensor | PIL image | bytes, "label": int}.
"""

from __future__ import annotations

import io
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import torch

from croupier.v1 import croupier_pb2 as pb

from .assemble import RawBatch

ImageDecode = Literal["tensor", "pil", "none"]


class SampleDecodeError(ValueError):
    """A sample's payload cannot be decoded (bytes that are not an image...)."""


def _numeric_list(t: pa.DataType) -> bool:
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t = t.value_type
        if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
            return True
    return False


def _column_values(col: pa.ChunkedArray) -> list[Any]:
    if _numeric_list(col.type):
        return [None if v is None else torch.as_tensor(np.asarray(v)) for v in col.to_pylist()]
    return col.to_pylist()


def table_samples(table: pa.Table) -> list[dict[str, Any]]:
    columns = {name: _column_values(table.column(name)) for name in table.column_names}
    return [{name: values[i] for name, values in columns.items()} for i in range(table.num_rows)]


def decode_image(im: pb.Image, mode: ImageDecode, index: int) -> Any:
    if mode == "none":
        return im.data
    if im.format == "raw":
        arr = np.frombuffer(im.data, dtype=np.uint8).reshape(im.height, im.width, im.channels)
        if mode == "pil":
            from PIL import Image

            return Image.fromarray(arr)
        return torch.from_numpy(arr.copy()).permute(2, 0, 1)
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(im.data)) as img:
            img = img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise SampleDecodeError(f"sample {index} ({im.key or 'no key'}): not a decodable image: {exc}") from exc
    if mode == "pil":
        return img
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)


def image_samples(images: list[pb.Image], indices: np.ndarray, mode: ImageDecode) -> list[dict[str, Any]]:
    return [
        {"image": decode_image(im, mode, int(i)), "label": int(im.label)} for im, i in zip(images, indices.tolist())
    ]


def raw_batch_samples(raw: RawBatch, mode: ImageDecode = "tensor") -> list[dict[str, Any]]:
    if raw.table is not None:
        return table_samples(raw.table)
    assert raw.images is not None
    return image_samples(raw.images, raw.indices, mode)
