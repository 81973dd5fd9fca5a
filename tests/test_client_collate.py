"""The client's column-wise collation equals default_collate over per-row samples."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch.utils.data import default_collate

from croupier.client.samples import collate_table, table_samples


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b


def test_fast_collation_equals_default_collate() -> None:
    n = 7
    table = pa.table(
        {
            "i32": pa.array(np.arange(n, dtype=np.int32)),
            "i64": pa.array(np.arange(n, dtype=np.int64) * 3),
            "f32": pa.array(np.linspace(0, 1, n, dtype=np.float32)),
            "f64": pa.array(np.linspace(0, 2, n)),
            "flag": pa.array([i % 2 == 0 for i in range(n)]),
            "text": pa.array([f"row {i}" for i in range(n)]),
            "blob": pa.array([bytes([i]) * 3 for i in range(n)], type=pa.binary()),
            "tokens": pa.array([[i, i + 1, i + 2] for i in range(n)], type=pa.list_(pa.int32())),
            "vec": pa.array([[0.5 * i] * 4 for i in range(n)], type=pa.list_(pa.float32(), 4)),
        }
    )
    fast = collate_table(table)
    assert fast is not None
    _same(fast, default_collate(table_samples(table)))


@pytest.mark.parametrize(
    "column",
    [
        pa.array([[1, 2], [3]], type=pa.list_(pa.int64())),  # ragged: needs a user collate_fn
        pa.array([1, None], type=pa.int64()),
        pa.array([{"a": 1}, {"a": 2}]),
    ],
)
def test_fast_collation_declines_what_it_does_not_cover(column: pa.Array) -> None:
    assert collate_table(pa.table({"c": column})) is None
