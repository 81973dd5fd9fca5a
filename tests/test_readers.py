"""Every reader: length, info, exact rows/images by global index, errors that name things."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from croupier.server.readers import (
    DatasetError,
    LatencyInjected,
    OutsideRootsError,
    SampleError,
    open_dataset,
    resolve_under_roots,
)
from croupier.server.readers.base import ImagePayload, TablePayload

from readers_data import (
    expected_pixel,
    table_rows,
    write_arrow_file,
    write_hf_dataset,
    write_imagefolder,
    write_parquet,
    write_webdataset,
)


def _read_all(reader, indices, **kw):
    async def go():
        return [await reader.read(i) for i in indices]

    return reader.encode(asyncio.run(go()), **kw)


def _rows(payload: TablePayload) -> pa.Table:
    return pa.ipc.open_stream(payload.arrow_ipc).read_all()


@pytest.mark.parametrize("kind", ["arrow-file", "arrow-stream", "arrow-folder", "hf", "parquet"])
def test_table_readers_return_the_rows_written(tmp_path: Path, kind: str) -> None:
    n = 101
    if kind == "arrow-file":
        write_arrow_file(tmp_path / "t.arrow", n)
        path = tmp_path / "t.arrow"
    elif kind == "arrow-stream":
        write_arrow_file(tmp_path / "t.arrow", n, stream=True)
        path = tmp_path / "t.arrow"
    elif kind == "arrow-folder":
        path = tmp_path / "folder"
        write_arrow_file(path / "a.arrow", n)  # rows 0..100 then the second file again
        write_arrow_file(path / "b.arrow", n)
        n = 2 * n
    elif kind == "hf":
        path = tmp_path / "hf"
        write_hf_dataset(path, n)
    else:
        path = tmp_path / "t.parquet"
        write_parquet(path, n, row_group_size=16)
    reader = open_dataset(path)
    assert len(reader) == n
    info = reader.info()
    assert info.kind == "table" and [c.name for c in info.columns] == ["id", "text", "score", "tokens"]
    order = list(np.random.default_rng(0).permutation(n))
    got = _rows(_read_all(reader, order))
    want = table_rows(101)
    for row, i in zip(got.to_pylist(), order):
        assert row == want.slice(i % 101, 1).to_pylist()[0]
    only = _rows(_read_all(reader, [3, 1], columns=("text",)))
    assert only.column_names == ["text"]
    with pytest.raises(DatasetError, match="no column 'nope'"):
        _read_all(reader, [0], columns=("nope",))
    with pytest.raises(SampleError, match=f"index {n} is outside 0..{n - 1}"):
        _read_all(reader, [n])


def test_parquet_row_group_cache_is_bounded(tmp_path: Path) -> None:
    write_parquet(tmp_path / "t.parquet", 400, row_group_size=10)
    reader = open_dataset(tmp_path / "t.parquet")
    reader.cache_bytes = 1  # keep only the newest row group
    _read_all(reader, range(0, 400, 7))
    assert len(reader._cache) == 1


def test_hf_dataset_dict_points_at_its_splits(tmp_path: Path) -> None:
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"x": [1, 2]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match=r"DatasetDict with splits \['train'\]"):
        open_dataset(tmp_path / "dd")


def test_imagefolder_labels_and_pixels(tmp_path: Path) -> None:
    written = write_imagefolder(tmp_path / "img", 4)
    reader = open_dataset(tmp_path / "img")
    assert reader.info().classes == ("cat", "dog", "eel") and len(reader) == 12
    payload = _read_all(reader, range(12))
    assert isinstance(payload, ImagePayload)
    assert [(r.key, r.label, r.format) for r in payload.images] == [(k, lab, "png") for k, lab in written]
    raw = _read_all(reader, [5], decode_images=True).images[0]
    assert (raw.format, raw.height, raw.width, raw.channels) == ("raw", 8, 8, 3)
    assert set(raw.data) == {expected_pixel(5)}


def test_webdataset_index_is_cached_and_invalidated(tmp_path: Path) -> None:
    written = write_webdataset(tmp_path / "wds", 25, shard_size=10)
    reader = open_dataset(tmp_path / "wds")
    assert len(reader) == 25
    payload = _read_all(reader, range(25))
    assert [(r.key, r.label) for r in payload.images] == [(f"{k}.png", lab) for k, lab in written]
    assert set(_read_all(reader, [7], decode_images=True).images[0].data) == {expected_pixel(7)}
    index = tmp_path / "wds" / "shard-0000.tar.idx.json"
    assert index.exists()
    stamp = index.stat().st_mtime_ns
    open_dataset(tmp_path / "wds")
    assert index.stat().st_mtime_ns == stamp, "a second open should reuse the index"
    write_webdataset(tmp_path / "wds", 8, shard_size=10)  # rewrites shard 0 with fewer samples
    assert len(open_dataset(tmp_path / "wds")) == 8 + 10 + 5
    assert index.stat().st_mtime_ns != stamp


def test_webdataset_index_goes_to_cache_dir_when_data_is_read_only(tmp_path: Path) -> None:
    write_webdataset(tmp_path / "wds", 5)
    cache = tmp_path / "cache"
    open_dataset(tmp_path / "wds", cache_dir=str(cache))
    assert list(cache.glob("shard-0000.tar.*.idx.json"))


@pytest.mark.parametrize("name, content", [("x.arrow", b"garbage" * 100), ("x.parquet", b"PAR1" + b"\0" * 50)])
def test_corrupt_table_files_name_the_file(tmp_path: Path, name: str, content: bytes) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DatasetError, match=name):
        open_dataset(tmp_path / name)


def test_truncated_tar_names_the_shard(tmp_path: Path) -> None:
    write_webdataset(tmp_path / "wds", 10)
    shard = tmp_path / "wds" / "shard-0000.tar"
    shard.write_bytes(shard.read_bytes()[:2000])
    with pytest.raises(DatasetError, match="shard-0000.tar"):
        open_dataset(tmp_path / "wds")


def test_non_image_bytes_name_file_and_index(tmp_path: Path) -> None:
    write_imagefolder(tmp_path / "img", 2)
    (tmp_path / "img" / "dog" / "00001.png").write_bytes(b"<html>not an image</html>")
    reader = open_dataset(tmp_path / "img")
    with pytest.raises(SampleError, match=r"sample 3 \(.*dog/00001.png\): not an image"):
        _read_all(reader, [3])


def test_unknown_layout_lists_the_formats(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(DatasetError, match="cannot tell the format.*imagefolder"):
        open_dataset(tmp_path)


def test_latency_injector_is_seeded_and_overrides_finish_last(tmp_path: Path) -> None:
    write_arrow_file(tmp_path / "t.arrow", 40)
    base = open_dataset(tmp_path / "t.arrow")
    a = LatencyInjected(base, median_ms=1, seed=4)
    b = LatencyInjected(base, median_ms=1, seed=4)
    assert [a.sampler() for _ in range(50)] == [b.sampler() for _ in range(50)]
    slow = LatencyInjected(base, median_ms=1, distribution="uniform", overrides={17: 0.3})

    async def race() -> list[int]:
        done: list[int] = []

        async def one(i: int) -> None:
            done.append(await slow.read(i))

        await asyncio.gather(*(one(i) for i in range(40)))
        return done

    order = asyncio.run(race())
    assert order[-1] == 17 and sorted(order) == list(range(40))


def test_paths_are_confined_to_the_data_roots(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "ok").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    os.symlink(tmp_path / "secret", root / "link")
    assert resolve_under_roots(root / "ok", [str(root)]) == (root / "ok").resolve()
    for bad in (root / ".." / "secret", root / "link"):
        with pytest.raises(OutsideRootsError, match="outside the data roots"):
            resolve_under_roots(bad, [str(root)])
