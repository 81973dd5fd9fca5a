"""Every reader: length, info, exact rows/images by global index, errors that name things."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from croupier.server.readers import (
    DatasetError,
    LatencyInjected,
    OutsideRootsError,
    Reader,
    SampleError,
    UnknownColumnError,
    open_dataset,
    resolve_under_roots,
)
from croupier.bench import latencyfs
from croupier.server.readers import latency as latency_module
from croupier.server.readers import webdataset as webdataset_module
from croupier.server.readers.base import ImagePayload, TablePayload

from readers_data import (
    COLUMNS,
    expected_pixel,
    image_bytes,
    expected_row,
    png_bytes,
    write_arrow_file,
    write_arrow_folder,
    write_hf_dataset,
    write_imagefolder,
    write_parquet,
    write_tar,
    write_webdataset,
)


def _read_all(reader: Reader, indices, **kw):
    """Read `indices` concurrently, as the server does, and encode them as one chunk."""

    async def go():
        return await asyncio.gather(*(reader.read(int(i)) for i in indices))

    return reader.encode(asyncio.run(go()), **kw)


def _rows(payload: TablePayload) -> pa.Table:
    return pa.ipc.open_stream(payload.arrow_ipc).read_all()


def _write_table_dataset(tmp_path: Path, kind: str, n: int) -> Path:
    if kind == "arrow-file":
        write_arrow_file(tmp_path / "t.arrow", n)
        return tmp_path / "t.arrow"
    if kind == "arrow-stream":
        write_arrow_file(tmp_path / "t.arrows", n, stream=True)
        return tmp_path / "t.arrows"
    if kind == "arrow-folder":
        write_arrow_folder(tmp_path / "folder", [n // 3, 1, n - n // 3 - 1])
        return tmp_path / "folder"
    if kind == "hf":
        write_hf_dataset(tmp_path / "hf", n)
        return tmp_path / "hf"
    if kind == "parquet":
        write_parquet(tmp_path / "t.parquet", n, row_group_size=16)
        return tmp_path / "t.parquet"
    assert kind == "parquet-folder"
    write_parquet(tmp_path / "pq" / "a.parquet", 40, row_group_size=7)
    write_parquet(tmp_path / "pq" / "b.parquet", n - 40, row_group_size=16, start=40)
    return tmp_path / "pq"


TABLE_KINDS = ["arrow-file", "arrow-stream", "arrow-folder", "hf", "parquet", "parquet-folder"]


@pytest.mark.parametrize("kind", TABLE_KINDS)
def test_table_readers_serve_every_row_written_at_its_global_index(tmp_path: Path, kind: str) -> None:
    n = 101
    reader = open_dataset(_write_table_dataset(tmp_path, kind, n))
    assert len(reader) == n
    info = reader.info()
    assert (info.kind, info.num_rows, info.format) == ("table", n, kind.split("-")[0])
    assert tuple(c.name for c in info.columns) == COLUMNS
    assert pa.ipc.read_schema(pa.py_buffer(info.arrow_schema)).names == list(COLUMNS)
    order = np.random.default_rng(0).permutation(n)
    assert _rows(_read_all(reader, order)).to_pylist() == [expected_row(i) for i in order]


@pytest.mark.parametrize("kind", TABLE_KINDS)
def test_table_payload_is_one_record_batch_of_the_chosen_columns(tmp_path: Path, kind: str) -> None:
    reader = open_dataset(_write_table_dataset(tmp_path, kind, 60))
    payload = _read_all(reader, [59, 3, 17, 3], columns=("tokens", "id"))
    stream = pa.ipc.open_stream(payload.arrow_ipc)
    batches = list(stream)
    assert len(batches) == 1 and batches[0].schema.names == ["tokens", "id"]
    assert batches[0].column("id").to_pylist() == [59, 3, 17, 3]
    assert payload.nbytes == len(payload.arrow_ipc)
    with pytest.raises(UnknownColumnError, match=r"no column 'nope'; columns: \['id', 'text', 'score', 'tokens'\]"):
        _read_all(reader, [0], columns=("id", "nope"))
    with pytest.raises(SampleError, match=r"index 60 is outside 0\.\.59"):
        _read_all(reader, [60])


@pytest.mark.parametrize("pick", ["one-batch", "sparse", "dense"])
def test_rows_spread_over_many_record_batches_come_back_in_the_requested_order(tmp_path: Path, pick: str) -> None:
    write_arrow_file(tmp_path / "t.arrow", 500, batch_rows=7)  # 72 record batches
    reader = open_dataset(tmp_path / "t.arrow")
    rng = np.random.default_rng(3)
    indices = {"one-batch": [9, 7, 13, 9], "sparse": rng.integers(0, 500, 40), "dense": rng.integers(0, 500, 2000)}[pick]
    got = _rows(_read_all(reader, indices, columns=("text", "id")))
    assert got.to_pylist() == [{"text": expected_row(i)["text"], "id": int(i)} for i in indices]


def test_arrow_reader_opens_from_metadata_and_reads_rows_by_range(tmp_path: Path) -> None:
    from croupier.server.storage import LocalStore

    path = tmp_path / "big.arrow"
    table = pa.table({"x": np.arange(500_000, dtype=np.int64)})
    with pa.ipc.new_file(str(path), table.schema) as w:
        w.write_table(table)
    del table
    store = LocalStore(io_threads=8)
    before = pa.total_allocated_bytes()
    reader = open_dataset(path, store=store)
    assert pa.total_allocated_bytes() - before < 100_000, "opening reads metadata, not the 4 MB of values"
    assert store.stats.bytes < 10_000
    assert reader.read_does_io is True
    assert _rows(_read_all(reader, [499_999, 0])).column("x").to_pylist() == [499_999, 0]


def test_hf_rows_equal_load_from_disk(tmp_path: Path) -> None:
    import datasets

    write_hf_dataset(tmp_path / "hf", 120, max_shard_size="4KB")
    assert len(list((tmp_path / "hf").glob("data-*.arrow"))) > 1
    reference = datasets.load_from_disk(str(tmp_path / "hf"))
    reader = open_dataset(tmp_path / "hf")
    assert reader.format == "hf" and reader.name == "hf"
    served = _rows(_read_all(reader, range(120))).to_pylist()
    assert served == [reference[i] for i in range(120)]


def test_hf_saved_format_columns_are_the_served_columns(tmp_path: Path) -> None:
    import datasets

    ds = datasets.Dataset.from_dict({"a": [1, 2, 3], "b": ["x", "y", "z"], "c": [0.5, 1.5, 2.5]})
    ds.set_format(columns=["c", "a"])
    ds.save_to_disk(str(tmp_path / "hf"))
    reference = datasets.load_from_disk(str(tmp_path / "hf"))
    reader = open_dataset(tmp_path / "hf")
    assert [c.name for c in reader.info().columns] == list(reference[0])
    assert _rows(_read_all(reader, [2, 0])).to_pylist() == [reference[2], reference[0]]


def test_hf_dataset_dict_lists_its_splits_and_points_at_one(tmp_path: Path) -> None:
    import datasets

    one = datasets.Dataset.from_dict({"x": [1, 2]})
    datasets.DatasetDict({"train": one, "test": one}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match=r"DatasetDict with splits \['train', 'test'\].*dd/<split>.*dd/train"):
        open_dataset(tmp_path / "dd")


def test_hf_indices_mapping_is_refused_not_misread(tmp_path: Path) -> None:
    write_hf_dataset(tmp_path / "hf", 10)
    state_file = tmp_path / "hf" / "state.json"
    state = json.loads(state_file.read_text())
    state["_indices_data_files"] = [{"filename": "indices.arrow"}]
    state_file.write_text(json.dumps(state))
    with pytest.raises(DatasetError, match="indices mapping.*flatten_indices"):
        open_dataset(tmp_path / "hf")


def test_parquet_row_group_cache_is_bounded_in_bytes(tmp_path: Path) -> None:
    write_parquet(tmp_path / "t.parquet", 400, row_group_size=10)
    reader = open_dataset(tmp_path / "t.parquet")
    group_bytes = reader._decode(0).nbytes
    reader.cache_bytes = 3 * group_bytes
    order = np.random.default_rng(1).permutation(400)
    for part in np.array_split(order, 20):
        assert _rows(_read_all(reader, part)).to_pylist() == [expected_row(i) for i in part]
        assert reader._cached_bytes <= reader.cache_bytes and len(reader._cache) <= 3
    assert reader.decodes > 40, "with room for 3 of 40 groups, random reads must decode again"


def test_parquet_concurrent_reads_of_a_row_group_share_one_decode(tmp_path: Path) -> None:
    write_parquet(tmp_path / "t.parquet", 100, row_group_size=50)
    reader = open_dataset(tmp_path / "t.parquet")

    async def go() -> list:
        reads = [asyncio.ensure_future(reader.read(i)) for i in range(100)]
        await asyncio.sleep(0)
        reads[0].cancel()  # one stream giving up must not fail the others' shared decode
        return await asyncio.gather(*reads[1:])

    items = asyncio.run(go())
    assert reader.decodes == 2
    assert _rows(reader.encode(items)).column("id").to_pylist() == list(range(1, 100))


def test_imagefolder_serves_classes_labels_and_images_in_torchvision_order(tmp_path: Path) -> None:
    written = write_imagefolder(tmp_path / "img", 4, classes=("eel", "cat", "dog"))
    (tmp_path / "img" / "cat" / "notes.txt").write_text("not an image, not a sample")
    (tmp_path / "img" / "dog" / "sub").mkdir()
    (tmp_path / "img" / "dog" / "sub" / "X.PNG").write_bytes(png_bytes(99))
    written.insert(8, ("dog/sub/X.PNG", 1))
    reader = open_dataset(tmp_path / "img")
    info = reader.info()
    assert (info.kind, info.format, info.classes, len(reader)) == ("image", "imagefolder", ("cat", "dog", "eel"), 13)
    payload = _read_all(reader, range(13))
    assert isinstance(payload, ImagePayload)
    assert [(r.key, r.label, r.format) for r in payload.images] == [(k, lab, "png") for k, lab in written]
    assert payload.images[0].data == (tmp_path / "img" / written[0][0]).read_bytes()
    decoded = _read_all(reader, range(13), decode_images=True).images
    assert all((r.format, r.height, r.width, r.channels) == ("raw", 8, 8, 3) for r in decoded)
    pixels = [i if i < 8 else (99 if i == 8 else i - 1) for i in range(13)]
    assert [set(r.data) for r in decoded] == [{expected_pixel(p)} for p in pixels]
    assert [r.label for r in decoded] == [lab for _, lab in written]


def test_imagefolder_skips_a_link_back_to_a_parent_once_and_says_so(tmp_path: Path, caplog) -> None:
    written = write_imagefolder(tmp_path / "img", 4, classes=("cat", "dog"))
    os.symlink(tmp_path / "img", tmp_path / "img" / "cat" / "loop")  # followed: cat/loop/cat/loop/...
    os.symlink(tmp_path / "img" / "dog", tmp_path / "img" / "cat" / "dogs")  # a sibling: followed, as torchvision does
    with caplog.at_level("WARNING", logger="croupier.server.storage"):
        reader = open_dataset(tmp_path / "img")
    assert len(reader) == len(written) + 4  # cat's 4, dog's 4, and dog's 4 again through cat/dogs
    assert any(f"{tmp_path / 'img' / 'cat' / 'loop'} -> {tmp_path / 'img'}: it links to a folder that contains it"
               in r.getMessage() for r in caplog.records)


def test_imagefolder_without_images_is_a_dataset_error(tmp_path: Path) -> None:
    (tmp_path / "img" / "cat").mkdir(parents=True)
    with pytest.raises(DatasetError, match="no image files"):
        open_dataset(tmp_path / "img", format="imagefolder")


def test_webdataset_serves_keys_labels_and_images_across_shards(tmp_path: Path) -> None:
    written = write_webdataset(tmp_path / "wds", 25, shard_size=10)
    (tmp_path / "wds" / "classes.txt").write_text("zero\none\ntwo\n")
    reader = open_dataset(tmp_path / "wds")
    info = reader.info()
    assert (info.kind, info.format, info.classes, len(reader)) == ("image", "webdataset", ("zero", "one", "two"), 25)
    payload = _read_all(reader, range(25))
    assert [(r.key, r.label, r.format) for r in payload.images] == [(f"{k}.png", lab, "png") for k, lab in written]
    assert payload.images[12].data == png_bytes(12)
    decoded = _read_all(reader, [24, 7], decode_images=True).images
    assert [set(r.data) for r in decoded] == [{expected_pixel(24)}, {expected_pixel(7)}]


def test_webdataset_groups_members_by_key_and_reads_labels(tmp_path: Path) -> None:
    members = {
        "a/x.y.JPG": image_bytes(0, 8, "JPEG"),  # real images: the server checks their structure
        "a/x.y.label": b" 4\n",
        "b/x.png": png_bytes(1),
        "b/x.txt": b"a caption, not a label",
        "c.json": b"{}",  # no image: not a sample
        "d.webp": image_bytes(2, 8, "WEBP"),
        "d.txt": b"7",
    }
    reader = open_dataset(write_tar(tmp_path / "wds" / "s.tar", members))
    payload = _read_all(reader, range(len(reader)))
    assert [(r.key, r.label, r.format) for r in payload.images] == [
        ("a/x.y.JPG", 4, "jpeg"),
        ("b/x.png", -1, "png"),
        ("d.webp", 7, "webp"),
    ]


def test_webdataset_non_integer_cls_names_the_member(tmp_path: Path) -> None:
    write_tar(tmp_path / "wds" / "s.tar", {"k.png": png_bytes(0), "k.cls": b"cat"})
    with pytest.raises(DatasetError, match=r"s\.tar: member k\.cls holds b'cat', not an integer label"):
        open_dataset(tmp_path / "wds")


@pytest.fixture
def scanned(monkeypatch) -> list[str]:
    """The names of the tar shards scanned (not found in an index cache) during the test."""
    names: list[str] = []
    real_scan = webdataset_module.scan_shard
    monkeypatch.setattr(
        webdataset_module, "scan_shard", lambda shard, store=None: names.append(Path(shard).name) or real_scan(shard, store)
    )
    return names


def test_webdataset_index_is_built_once_reused_and_invalidated(tmp_path: Path, scanned: list[str]) -> None:
    write_webdataset(tmp_path / "wds", 25, shard_size=10)
    assert len(open_dataset(tmp_path / "wds")) == 25
    assert scanned == ["shard-0000.tar", "shard-0001.tar", "shard-0002.tar"]
    assert (tmp_path / "wds" / "shard-0000.tar.idx.json").is_file()

    scanned.clear()
    assert len(open_dataset(tmp_path / "wds")) == 25
    assert scanned == [], "a second open must reuse the cached index"

    write_webdataset(tmp_path / "wds", 8, shard_size=10)  # rewrites shard 0 with 8 samples
    reader = open_dataset(tmp_path / "wds")
    assert scanned == ["shard-0000.tar"] and len(reader) == 8 + 10 + 5
    assert [r.key for r in _read_all(reader, [7, 8]).images] == ["sample000007.png", "sample000010.png"]


def test_webdataset_index_goes_to_cache_dir_when_given(tmp_path: Path) -> None:
    write_webdataset(tmp_path / "wds", 5)
    cache = tmp_path / "cache"
    reader = open_dataset(tmp_path / "wds", cache_dir=str(cache))
    assert list(cache.glob("shard-0000.tar.*.idx.json")) and not list((tmp_path / "wds").glob("*.idx.json"))
    assert len(reader) == 5


def test_webdataset_index_beside_read_only_data_is_used_else_home_cache(
    tmp_path: Path, monkeypatch, scanned: list[str]
) -> None:
    write_webdataset(tmp_path / "wds", 5)
    open_dataset(tmp_path / "wds")  # ships shard-0000.tar.idx.json beside the shard
    scanned.clear()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(webdataset_module.os, "access", lambda path, mode: False)  # the data is read-only
    assert len(open_dataset(tmp_path / "wds")) == 5 and scanned == []

    (tmp_path / "wds" / "shard-0000.tar.idx.json").unlink()
    assert len(open_dataset(tmp_path / "wds")) == 5 and scanned == ["shard-0000.tar"]
    assert list((tmp_path / "home" / ".cache" / "croupier" / "tar-index").glob("shard-0000.tar.*.idx.json"))
    assert not (tmp_path / "wds" / "shard-0000.tar.idx.json").exists()


@pytest.mark.skipif(latencyfs.check_available() is not None, reason=f"latencyfs unusable here: {latencyfs.check_available()}")
def test_webdataset_index_is_never_written_beside_shards_on_a_mount(tmp_path: Path, monkeypatch) -> None:
    # A FUSE mount (a bucket through rclone or s3fs writes each file as PUTs into the bucket):
    # the index goes to the home cache, and the shards' folder is left as it was.
    write_webdataset(tmp_path / "wds", 5)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(webdataset_module.os, "access", lambda path, mode: True)  # a mount that takes writes
    with latencyfs.mounted(tmp_path / "wds", median_ms=1, distribution="fixed") as fs:
        assert len(open_dataset(fs.path)) == 5
        assert not list(fs.path.glob("*.idx.json"))
    assert not list((tmp_path / "wds").glob("*.idx.json"))
    assert list((tmp_path / "home" / ".cache" / "croupier" / "tar-index").glob("shard-0000.tar.*.idx.json"))


def _truncate(path: Path, keep: float) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def _write_corrupt(d: Path, case: str) -> tuple[Path, str]:
    """A broken dataset: (the path to open, the file name the error must give)."""
    if case == "garbage-arrow":
        (d / "x.arrow").write_bytes(bytes(range(256)) * 8)
    elif case == "empty-arrow":
        (d / "x.arrow").write_bytes(b"")
    elif case == "truncated-arrow-file":
        write_arrow_file(d / "x.arrow", 500)
        _truncate(d / "x.arrow", 0.7)
    elif case == "truncated-arrow-stream":
        write_arrow_file(d / "x.arrow", 500, stream=True)
        _truncate(d / "x.arrow", 0.5)
    elif case == "garbage-parquet":
        (d / "x.parquet").write_bytes(b"PAR1" + bytes(range(256)) * 8)
    elif case == "truncated-parquet":
        write_parquet(d / "x.parquet", 500)
        _truncate(d / "x.parquet", 0.6)
    elif case == "truncated-tar":
        write_webdataset(d / "wds", 10)
        _truncate(d / "wds" / "shard-0000.tar", 0.3)
        return d / "wds", "shard-0000.tar"
    else:
        assert case == "garbage-tar"
        (d / "wds").mkdir()
        (d / "wds" / "shard-0000.tar").write_bytes(bytes(range(256)) * 8)
        return d / "wds", "shard-0000.tar"
    path = next(d.iterdir())
    return path, path.name


@pytest.mark.parametrize(
    "case",
    ["garbage-arrow", "empty-arrow", "truncated-arrow-file", "truncated-arrow-stream", "garbage-parquet",
     "truncated-parquet", "truncated-tar", "garbage-tar"],
)
def test_corrupt_or_truncated_files_are_dataset_errors_naming_the_file(tmp_path: Path, case: str) -> None:
    path, name = _write_corrupt(tmp_path, case)
    with pytest.raises(DatasetError, match=name.replace(".", r"\.")):
        open_dataset(path)


def test_truncated_tar_names_the_member(tmp_path: Path) -> None:
    write_webdataset(tmp_path / "wds", 4)
    shard = tmp_path / "wds" / "shard-0000.tar"
    data = shard.read_bytes()
    shard.write_bytes(data[: data.index(b"sample000002.png") + 600])  # header whole, data cut
    with pytest.raises(DatasetError, match=r"shard-0000\.tar.*sample000002\.png"):
        open_dataset(shard)


def test_non_image_bytes_are_sample_errors_naming_file_and_index(tmp_path: Path) -> None:
    write_imagefolder(tmp_path / "img", 2)
    (tmp_path / "img" / "dog" / "00001.png").write_bytes(b"<html>not an image</html>")
    reader = open_dataset(tmp_path / "img")
    with pytest.raises(SampleError, match=r"sample 3 \(.*img/dog/00001\.png\): not an image") as info:
        _read_all(reader, [3])
    assert info.value.index == 3 and info.value.path.endswith("dog/00001.png")
    assert "<html>" not in str(info.value), "the file's bytes are never echoed to a client"

    write_tar(tmp_path / "wds" / "s.tar", {"k0.png": png_bytes(0), "k1.png": b"PK\x03\x04 a zip file"})
    with pytest.raises(SampleError, match=r"sample 1 \(.*s\.tar:k1\.png\): not an image"):
        _read_all(open_dataset(tmp_path / "wds"), [1])


def test_undecodable_image_is_a_sample_error_naming_file_and_index(tmp_path: Path) -> None:
    write_imagefolder(tmp_path / "img", 2)
    bad = tmp_path / "img" / "cat" / "00001.png"
    bad.write_bytes(png_bytes(1)[:30])  # PNG magic, cut body
    reader = open_dataset(tmp_path / "img")
    # The magic bytes are right; the server's structural check sees the cut.
    with pytest.raises(SampleError, match=r"sample 1 \(.*cat/00001\.png\): corrupt PNG image: the file ends inside its header"):
        _read_all(reader, [1])


DETECTED = {  # dataset written by ... -> (format, default name)
    "c4.train.feather": ("arrow", "c4.train"),
    "shards": ("arrow", "shards"),
    "squad": ("hf", "squad"),
    "rows.parquet": ("parquet", "rows"),
    "pets": ("imagefolder", "pets"),
    "laion": ("webdataset", "laion"),
    "laion/shard-0000.tar": ("webdataset", "shard-0000"),
}


def _write_for_detection(d: Path, rel: str) -> Path:
    writers = {
        "c4.train.feather": lambda p: write_arrow_file(p, 3),
        "shards": lambda p: write_arrow_folder(p, [2, 2]),
        "squad": lambda p: write_hf_dataset(p, 3),
        "rows.parquet": lambda p: write_parquet(p, 3),
        "pets": lambda p: write_imagefolder(p, 1),
        "laion": lambda p: write_webdataset(p, 3),
        "laion/shard-0000.tar": lambda p: write_webdataset(p.parent, 3),
    }
    writers[rel](d / rel)
    return d / rel


@pytest.mark.parametrize("rel", list(DETECTED))
def test_format_is_detected_and_name_defaults_to_the_basename(tmp_path: Path, rel: str) -> None:
    reader = open_dataset(_write_for_detection(tmp_path, rel))
    assert (reader.format, reader.name) == DETECTED[rel]
    assert open_dataset(tmp_path / rel, name="mine").name == "mine"


def test_unknown_layout_names_the_path_and_lists_the_formats(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(DatasetError, match=f"cannot tell the format of {tmp_path}.*arrow, hf, parquet, imagefolder, webdataset"):
        open_dataset(tmp_path)
    with pytest.raises(DatasetError, match="does not exist"):
        open_dataset(tmp_path / "missing.arrow")
    with pytest.raises(DatasetError, match="unknown format 'csv'"):
        open_dataset(tmp_path / "notes.txt", format="csv")


def _recorded_delays(monkeypatch, reader: LatencyInjected, indices) -> list[float]:
    delays: list[float] = []

    async def fake_wait(delay: float) -> None:
        delays.append(delay)

    monkeypatch.setattr(latency_module, "wait", fake_wait)

    async def go() -> None:
        for i in indices:
            await reader.read(i)

    asyncio.run(go())
    monkeypatch.undo()
    return delays


def test_latency_delays_are_seeded_and_follow_the_stated_distribution(tmp_path: Path, monkeypatch) -> None:
    write_arrow_file(tmp_path / "t.arrow", 50)
    base = open_dataset(tmp_path / "t.arrow")
    reads = list(range(50)) * 40

    def delays(**kw) -> np.ndarray:
        return np.array(_recorded_delays(monkeypatch, LatencyInjected(base, **kw), reads))

    a, b = delays(median_ms=4, seed=7), delays(median_ms=4, seed=7)
    assert np.array_equal(a, b) and not np.array_equal(a, delays(median_ms=4, seed=8))
    assert 0.0036 < np.median(a) < 0.0044 and a.min() > 0
    assert np.all(delays(median_ms=4, distribution="fixed") == 0.004)
    uniform = delays(median_ms=4, distribution="uniform")
    assert uniform.min() >= 0 and uniform.max() <= 0.008 and 0.0036 < np.median(uniform) < 0.0044
    with pytest.raises(ValueError, match="'pareto' is not one of"):
        LatencyInjected(base, median_ms=1, distribution="pareto")


def test_latency_override_makes_that_read_complete_last(tmp_path: Path) -> None:
    write_arrow_file(tmp_path / "t.arrow", 40)
    slow = LatencyInjected(open_dataset(tmp_path / "t.arrow"), median_ms=1, distribution="uniform", overrides={17: 0.3})

    async def race() -> list[int]:
        done: list[int] = []

        async def one(i: int) -> None:
            done.append((await slow.read(i)).index)

        await asyncio.gather(*(one(i) for i in range(40)))
        return done

    order = asyncio.run(race())
    assert order[-1] == 17 and sorted(order) == list(range(40))


def test_latency_injected_is_a_reader_delegating_to_the_inner_one(tmp_path: Path) -> None:
    write_parquet(tmp_path / "t.parquet", 30, row_group_size=8)
    inner = open_dataset(tmp_path / "t.parquet")
    wrapped = LatencyInjected(inner, median_ms=0.1, seed=1)
    assert isinstance(wrapped, Reader) and wrapped.read_does_io
    assert (len(wrapped), wrapped.info(), wrapped.format) == (len(inner), inner.info(), "parquet")
    assert _rows(_read_all(wrapped, [29, 0], columns=("id",))).column("id").to_pylist() == [29, 0]
    write_arrow_folder(tmp_path / "a", [3])
    # Over a reader whose reads do real I/O, the delay comes first and the read follows
    # (no timer shortcut: that is only for readers without I/O, like synthetic data).
    arrow = LatencyInjected(open_dataset(tmp_path / "a"), median_ms=0.1)
    assert arrow.read_does_io and arrow.inner.read_does_io and arrow.read_later(0) is None


def test_resolve_under_roots_rejects_dotdot_escapes_and_symlinks_out(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "ok").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    os.symlink(tmp_path / "secret", root / "link")
    os.symlink(root / "ok", tmp_path / "inward")
    assert resolve_under_roots(root / "ok", [str(root)]) == (root / "ok").resolve()
    assert resolve_under_roots(root / "ok" / ".." / "ok", [str(tmp_path / "x"), str(root)]) == (root / "ok").resolve()
    assert resolve_under_roots(tmp_path / "inward", [str(root)]) == (root / "ok").resolve()
    for bad in (root / ".." / "secret", root / "link", root / "link" / "file.arrow", tmp_path / "rootx"):
        with pytest.raises(OutsideRootsError, match=rf"{bad}.*outside the data roots \['{root}'\]") as info:
            resolve_under_roots(bad, [str(root)])
        assert isinstance(info.value, PermissionError) and isinstance(info.value, DatasetError)
