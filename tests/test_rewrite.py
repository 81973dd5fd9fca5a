"""`croupier rewrite`: every source kind becomes small-batch, uncompressed Arrow IPC files
with the same rows in the same order, the schema metadata kept, and nothing half-written."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from readers_data import (
    expected_pixel,
    table_rows,
    write_arrow_file,
    write_imagefolder,
    write_parquet,
    write_webdataset,
)

import croupier
from croupier import rewrite as rw
from croupier.cli import main
from croupier.rewrite import MANIFEST, RewriteError, rewrite
from croupier.server.readers.imagefolder import ImageFolderReader
from croupier.server.readers.registry import detect_format, open_dataset
from croupier.server.readers.webdataset import WebDatasetReader

META = {b"note": b"kept by the rewrite"}


def parts_of(dst: Path) -> list[Path]:
    return sorted(dst.glob("*.arrow"))


def read_parts(dst: Path) -> pa.Table:
    tables = []
    for part in parts_of(dst):
        with pa.memory_map(str(part)) as f:
            tables.append(pa.ipc.open_file(f).read_all())
    return pa.concat_tables(tables)


def check_layout(dst: Path, rows_per_batch: int, rows: int) -> None:
    """IPC file format, uncompressed, every batch rows_per_batch rows but the very last."""
    sizes = []
    for part in parts_of(dst):
        data = part.read_bytes()
        assert data[:6] == b"ARROW1" and data[-6:] == b"ARROW1", part
        reader = pa.ipc.open_file(pa.BufferReader(data))
        assert reader.schema.metadata == read_parts(dst).schema.metadata
        for i in range(reader.num_record_batches):
            batch = reader.get_batch(i)
            sizes.append(batch.num_rows)
            assert_uncompressed(data, batch)
    assert sum(sizes) == rows
    assert all(n == rows_per_batch for n in sizes[:-1]), sizes
    assert 0 < sizes[-1] <= rows_per_batch or rows == 0
    assert detect_format(dst) == "arrow"


def assert_uncompressed(file_bytes: bytes, batch: pa.RecordBatch) -> None:
    """A batch's string or binary values lie in the file verbatim: no LZ4/ZSTD buffers."""
    for col in batch.columns:
        if pa.types.is_struct(col.type):
            col = col.field("bytes")
        if pa.types.is_string(col.type) or pa.types.is_binary(col.type):
            values = b"".join(v.as_buffer().to_pybytes() for v in col if v.is_valid)
            assert values in file_bytes
            return


def test_the_uncompressed_check_catches_compression(tmp_path: Path) -> None:
    table = table_rows(500)
    for compression, found in ((None, True), ("lz4", False)):
        path = tmp_path / f"{compression}.arrow"
        with pa.ipc.new_file(str(path), table.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as w:
            w.write_table(table, max_chunksize=250)
        batch = pa.ipc.open_file(str(path)).get_batch(0)
        if found:
            assert_uncompressed(path.read_bytes(), batch)
        else:
            with pytest.raises(AssertionError):
                assert_uncompressed(path.read_bytes(), batch)


def write_ipc(path: Path, table: pa.Table, *, stream: bool, batch_rows: int) -> None:
    opener = pa.ipc.new_stream if stream else pa.ipc.new_file
    with opener(str(path), table.schema) as w:
        w.write_table(table, max_chunksize=batch_rows)


@pytest.mark.parametrize("stream", [False, True], ids=["file-format", "stream-format"])
def test_arrow_file_rewritten_in_order_in_small_batches(tmp_path: Path, stream: bool) -> None:
    table = table_rows(203).replace_schema_metadata(META)
    src = tmp_path / ("src.arrows" if stream else "src.arrow")
    write_ipc(src, table, stream=stream, batch_rows=7)  # 7-row batches re-chunked into 10s
    result = rewrite(src, tmp_path / "out", rows_per_batch=10, progress=False)
    out = read_parts(tmp_path / "out")
    assert out.equals(table) and out.schema.metadata == META
    check_layout(tmp_path / "out", 10, 203)
    assert (result.rows, result.source_format, result.rows_per_batch) == (203, "arrow", 10)
    assert result.files == [str(tmp_path / "out" / "part-00000.arrow")]
    assert result.bytes == (tmp_path / "out" / "part-00000.arrow").stat().st_size


def test_arrow_folder_of_both_formats_and_several_parts(tmp_path: Path) -> None:
    tables, start = [], 0
    (tmp_path / "src").mkdir()
    for k, (n, batch_rows) in enumerate([(150, 1000), (37, 5), (1, 1), (90, 40)]):
        t = table_rows(n, start).replace_schema_metadata(META)
        write_ipc(tmp_path / "src" / f"f{k}.arrow", t, stream=k % 2 == 1, batch_rows=batch_rows)
        tables.append(t)
        start += n
    expected = pa.concat_tables(tables)
    result = rewrite(tmp_path / "src", tmp_path / "out", rows_per_batch=16, progress=False, max_file_bytes=4000)
    assert len(result.files) > 2  # a new part whenever one passes max_file_bytes
    assert read_parts(tmp_path / "out").equals(expected)
    check_layout(tmp_path / "out", 16, expected.num_rows)
    served = open_dataset(tmp_path / "out")  # the server reads the rewrite, manifest and all
    assert len(served) == expected.num_rows and served.format == "arrow"
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["source"] == str((tmp_path / "src").resolve())
    assert manifest["source_format"] == "arrow" and manifest["rows"] == expected.num_rows
    assert manifest["rows_per_batch"] == 16 and manifest["files"] == [Path(f).name for f in result.files]
    assert manifest["croupier_version"] == croupier.__version__


def test_dictionary_columns_are_decoded(tmp_path: Path) -> None:
    """The server refuses dictionary-encoded columns and the IPC file format cannot hold a
    dictionary that changes from batch to batch: the rewrite stores the plain values."""
    table = table_rows(40)
    words = pa.array([f"w{i % 6}" for i in range(40)]).dictionary_encode()
    table = table.append_column("word", words).replace_schema_metadata(META)
    with pa.ipc.new_stream(str(tmp_path / "d.arrow"), table.schema, options=pa.ipc.IpcWriteOptions(
            emit_dictionary_deltas=True)) as w:
        for k in range(0, 40, 9):  # each batch has its own dictionary
            part = table.slice(k, 9)
            w.write_table(pa.table([c.combine_chunks().dictionary_decode().dictionary_encode()
                                    if c.type.id == words.type.id else c for c in part.columns], schema=table.schema))
    rewrite(tmp_path / "d.arrow", tmp_path / "out", rows_per_batch=8, progress=False)
    out = read_parts(tmp_path / "out")
    assert out.schema.field("word").type == pa.string()
    assert out.column("word").to_pylist() == [f"w{i % 6}" for i in range(40)]
    assert out.drop_columns(["word"]).equals(table.drop_columns(["word"]))
    check_layout(tmp_path / "out", 8, 40)


def test_parquet_folder_with_several_row_groups(tmp_path: Path) -> None:
    a = write_parquet(tmp_path / "src" / "a.parquet", 100, row_group_size=16)
    b = write_parquet(tmp_path / "src" / "b.parquet", 45, row_group_size=7, start=100)
    assert pq.ParquetFile(str(tmp_path / "src" / "a.parquet")).num_row_groups == 7
    rewrite(tmp_path / "src", tmp_path / "out", rows_per_batch=12, progress=False)
    out = read_parts(tmp_path / "out")
    assert out.equals(pa.concat_tables([a, b]).replace_schema_metadata(out.schema.metadata))
    check_layout(tmp_path / "out", 12, 145)


def test_parquet_schema_metadata_is_kept(tmp_path: Path) -> None:
    table = table_rows(30).replace_schema_metadata(META)
    pq.write_table(table, str(tmp_path / "m.parquet"), row_group_size=8)
    rewrite(tmp_path / "m.parquet", tmp_path / "out", rows_per_batch=64, progress=False)
    assert read_parts(tmp_path / "out").schema.metadata[b"note"] == META[b"note"]


def hf_dataset(n: int):
    import datasets

    features = datasets.Features(
        {"id": datasets.Value("int64"), "text": datasets.Value("string"),
         "label": datasets.ClassLabel(names=["neg", "neu", "pos"])}
    )
    return datasets.Dataset.from_dict(
        {"id": list(range(n)), "text": [f"text {i} " + "xy" * (i % 9) for i in range(n)],
         "label": [i % 3 for i in range(n)]},
        features=features,
    )


def load_parts(dst: Path):
    """The rewritten parts as `datasets` loads Arrow files (its "arrow" builder reads the file format)."""
    import datasets

    return datasets.load_dataset("arrow", data_files=[str(p) for p in parts_of(dst)], split="train",
                                 cache_dir=str(dst.parent / "hf-cache"))


def test_hf_save_to_disk_keeps_rows_and_features(tmp_path: Path) -> None:
    import datasets

    hf_dataset(700).save_to_disk(str(tmp_path / "src"), max_shard_size="8KB")
    assert len(json.loads((tmp_path / "src" / "state.json").read_text())["_data_files"]) > 1
    result = rewrite(tmp_path / "src", tmp_path / "out", progress=False)
    assert result.source_format == "hf"
    check_layout(tmp_path / "out", 64, 700)
    reference = datasets.load_from_disk(str(tmp_path / "src"))
    loaded = load_parts(tmp_path / "out")
    assert loaded.features == reference.features
    assert loaded.features["label"].names == ["neg", "neu", "pos"]
    assert loaded.to_list() == reference.to_list()


def test_hf_saved_format_columns_are_what_is_kept(tmp_path: Path) -> None:
    import datasets

    hf_dataset(50).with_format("numpy", columns=["label", "id"]).save_to_disk(str(tmp_path / "src"))
    rewrite(tmp_path / "src", tmp_path / "out", rows_per_batch=8, progress=False)
    out = read_parts(tmp_path / "out")
    assert out.column_names == ["id", "label"]  # the files' order, as the server serves it
    assert out.column("label").to_pylist() == [i % 3 for i in range(50)]
    hf_features = json.loads(out.schema.metadata[b"huggingface"])["info"]["features"]
    assert list(hf_features) == ["id", "label"]  # the HF features were trimmed to match
    features = datasets.Dataset(out).features
    assert list(features) == ["id", "label"] and features["label"].names == ["neg", "neu", "pos"]


def test_hf_folders_the_server_refuses_are_refused(tmp_path: Path) -> None:
    import datasets

    datasets.DatasetDict({"train": hf_dataset(5), "test": hf_dataset(3)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(RewriteError, match="DatasetDict.*train"):
        rewrite(tmp_path / "dd", tmp_path / "out", progress=False)
    hf_dataset(5).save_to_disk(str(tmp_path / "idx"))
    state_file = tmp_path / "idx" / "state.json"
    state = json.loads(state_file.read_text())
    state["_indices_data_files"] = [{"filename": "indices.arrow"}]
    state_file.write_text(json.dumps(state))
    with pytest.raises(RewriteError, match="indices mapping"):
        rewrite(tmp_path / "idx", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def hf_image_metadata(names: list[str] | None) -> dict[bytes, bytes]:
    import datasets

    label = datasets.ClassLabel(names=names) if names is not None else datasets.Value("int64")
    return datasets.Features({"image": datasets.Image(), "label": label}).arrow_schema.metadata


def check_image_rewrite(dst: Path, labels: list[int], names: list[str], pixel_of) -> None:
    out = read_parts(dst)
    assert out.schema.metadata == hf_image_metadata(names)  # exactly as `datasets` writes it
    assert out.schema.field("image").type == pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    assert out.schema.field("label").type == pa.int64()
    loaded = load_parts(dst)
    assert loaded.features["label"].names == names
    assert loaded["label"] == labels
    for i, row in enumerate(loaded):
        pixels = np.asarray(row["image"])
        assert pixels.shape == (8, 8, 3) and (pixels == pixel_of(i)).all(), i
    # croupier's trainer side sees an HF Image column in what the server sends, and decodes it
    from croupier.client.samples import table_samples

    table = served_rows(dst, [2, 0])
    samples = table_samples(table, mode="pil")
    assert [s["label"] for s in samples] == [labels[2], labels[0]]
    assert np.asarray(samples[0]["image"])[0, 0, 0] == pixel_of(2)


def served_rows(dst: Path, indices: list[int]) -> pa.Table:
    """Rows as croupier's server sends them: read (async) then encode."""
    reader = open_dataset(dst)

    async def read_all():
        return await asyncio.gather(*(reader.read(i) for i in indices))

    items = asyncio.run(read_all())
    return pa.ipc.open_stream(reader.encode(items).arrow_ipc).read_all()


def test_imagefolder_becomes_hf_image_rows(tmp_path: Path) -> None:
    written = write_imagefolder(tmp_path / "src", 7, classes=("eel", "cat", "dog"))
    folder = ImageFolderReader("src", str(tmp_path / "src"))
    result = rewrite(tmp_path / "src", tmp_path / "out", rows_per_batch=4, progress=False)
    assert result.source_format == "imagefolder" and result.rows == 21
    check_layout(tmp_path / "out", 4, 21)
    assert folder.labels == [label for _, label in written]
    check_image_rewrite(tmp_path / "out", folder.labels, ["cat", "dog", "eel"], expected_pixel)
    assert read_parts(tmp_path / "out").column("image").combine_chunks().field("path").to_pylist() == folder.keys


def test_webdataset_shards_become_hf_image_rows(tmp_path: Path) -> None:
    write_webdataset(tmp_path / "src", 23, shard_size=5, num_classes=3)
    (tmp_path / "src" / "classes.txt").write_text("ant\nbee\ncow\n")
    wds = WebDatasetReader("src", str(tmp_path / "src"))
    labels = [label for *_, label in wds.samples]
    rewrite(tmp_path / "src", tmp_path / "out", rows_per_batch=6, progress=False)
    check_layout(tmp_path / "out", 6, 23)
    check_image_rewrite(tmp_path / "out", labels, ["ant", "bee", "cow"], expected_pixel)
    paths = read_parts(tmp_path / "out").column("image").combine_chunks().field("path").to_pylist()
    assert paths == [s[1] for s in wds.samples]


def test_webdataset_without_classes_names_labels_by_number(tmp_path: Path) -> None:
    write_webdataset(tmp_path / "src", 9, shard_size=4, num_classes=2)
    rewrite(tmp_path / "src", tmp_path / "out", progress=False)
    assert read_parts(tmp_path / "out").schema.metadata == hf_image_metadata(["0", "1"])


def test_a_non_empty_destination_needs_overwrite(tmp_path: Path) -> None:
    write_arrow_file(tmp_path / "src.arrow", 20)
    dst = tmp_path / "out"
    dst.mkdir()
    rewrite(tmp_path / "src.arrow", dst, progress=False)  # an empty folder is fine
    (dst / "mine.txt").write_text("precious")
    with pytest.raises(RewriteError, match=f"{dst}.*overwrite"):
        rewrite(tmp_path / "src.arrow", dst, progress=False)
    assert (dst / "mine.txt").read_text() == "precious"
    rewrite(tmp_path / "src.arrow", dst, rows_per_batch=3, overwrite=True, progress=False)
    assert not (dst / "mine.txt").exists()
    check_layout(dst, 3, 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src.arrow"]  # no tmp or old folders left


def test_destination_inside_the_source_is_refused(tmp_path: Path) -> None:
    write_parquet(tmp_path / "src" / "a.parquet", 10)
    with pytest.raises(RewriteError, match="inside the source"):
        rewrite(tmp_path / "src", tmp_path / "src" / "fast", progress=False)
    with pytest.raises(RewriteError, match="inside the source"):
        rewrite(tmp_path / "src", tmp_path / "src", overwrite=True, progress=False)
    with pytest.raises(RewriteError, match="inside the destination"):
        rewrite(tmp_path / "src", tmp_path, overwrite=True, progress=False)
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == ["a.parquet"]


@pytest.mark.parametrize("kind", ["garbage-arrow", "truncated-stream", "garbage-parquet", "not-an-image"])
def test_a_corrupt_source_names_the_file(tmp_path: Path, kind: str) -> None:
    src = tmp_path / "src"
    if kind == "garbage-arrow":
        write_arrow_file(src / "a.arrow", 30)
        bad = src / "b.arrow"
        bad.write_bytes(b"this is not arrow at all" * 10)
    elif kind == "truncated-stream":
        write_arrow_file(src / "a.arrow", 30)
        write_arrow_file(src / "b.arrow", 300, stream=True, start=30)
        bad = src / "b.arrow"
        bad.write_bytes(bad.read_bytes()[:-2000])
    elif kind == "garbage-parquet":
        write_parquet(src / "a.parquet", 30)
        bad = src / "b.parquet"
        bad.write_bytes(b"PAR1 not really" * 10)
    else:
        write_imagefolder(src, 2)
        bad = src / "dog" / "00001.png"
        bad.write_bytes(b"not a png")
    with pytest.raises(RewriteError, match=str(bad)):
        rewrite(src, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_an_interrupted_rewrite_leaves_no_destination(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_arrow_file(tmp_path / "src.arrow", 500)
    real_write, calls = rw._Parts._write, []

    def failing_write(self, batch):
        calls.append(batch.num_rows)
        if len(calls) == 5:
            raise KeyboardInterrupt  # Ctrl-C midway
        real_write(self, batch)

    monkeypatch.setattr(rw._Parts, "_write", failing_write)
    with pytest.raises(KeyboardInterrupt):
        rewrite(tmp_path / "src.arrow", tmp_path / "out", rows_per_batch=10, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.arrow"]
    # and an existing destination is left as it was
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        rewrite(tmp_path / "src.arrow", tmp_path / "out", rows_per_batch=10, overwrite=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src.arrow"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["old.txt"]


def test_progress_bar_counts_rows_on_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    write_arrow_file(tmp_path / "src.arrow", 300)
    for progress in (True, False):
        err = Terminal()
        monkeypatch.setattr(sys, "stderr", err)
        rewrite(tmp_path / "src.arrow", tmp_path / f"out-{progress}", progress=progress)
        assert ("300/300" in err.getvalue() and "rows" in err.getvalue()) == progress, err.getvalue()


def test_empty_source_gives_an_empty_dataset(tmp_path: Path) -> None:
    table = table_rows(0).replace_schema_metadata(META)
    write_ipc(tmp_path / "e.arrow", table, stream=True, batch_rows=1)
    result = rewrite(tmp_path / "e.arrow", tmp_path / "out", progress=False)
    assert result.rows == 0 and len(result.files) == 1
    out = read_parts(tmp_path / "out")
    assert out.num_rows == 0 and out.schema.equals(table.schema, check_metadata=True)


def test_cli_rewrites_and_prints_a_summary(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_parquet(tmp_path / "src.parquet", 100, row_group_size=30)
    code = main(["rewrite", str(tmp_path / "src.parquet"), str(tmp_path / "out"), "--rows-per-batch", "16",
                 "--no-progress", "--max-file-mb", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "rewrote 100 rows" in out and str(tmp_path / "out") in out and "16 rows per batch" in out
    check_layout(tmp_path / "out", 16, 100)
    # bad input: exit 2, one line naming the file, no traceback
    code = main(["rewrite", str(tmp_path / "src.parquet"), str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "overwrite" in err and str(tmp_path / "out") in err and len(err.strip().splitlines()) == 1


def test_cli_in_a_subprocess(tmp_path: Path) -> None:
    (tmp_path / "bad.arrow").write_bytes(b"nope" * 100)
    write_arrow_file(tmp_path / "good.arrow", 40)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent.parent),
                                                                      os.environ.get("PYTHONPATH")]))}
    script = (
        "import sys; from croupier.cli import main\n"
        f"a = main(['rewrite', {str(tmp_path / 'good.arrow')!r}, {str(tmp_path / 'out')!r}])\n"
        f"b = main(['rewrite', {str(tmp_path / 'bad.arrow')!r}, {str(tmp_path / 'out2')!r}, '--format', 'arrow'])\n"
        "print('codes', a, b)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert "codes 0 2" in proc.stdout, proc.stderr
    assert "rewrote 40 rows" in proc.stdout
    assert "bad.arrow" in proc.stderr and "Traceback" not in proc.stderr
    help_text = subprocess.run([sys.executable, "-m", "croupier.cli", "rewrite", "--help"], capture_output=True,
                               text=True, timeout=120, env=env, check=True).stdout
    for flag in ("--rows-per-batch", "--format", "--overwrite", "--no-progress", "--max-file-mb"):
        assert flag in help_text
