"""Corrupt data, caught and contained: bad datasets at start, Parquet page checksums,
mixed-format folders and broken images, each refused with a status naming the file."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from croupier.client import ImageDecoding, Loader, LoaderError, RetryPolicy
from croupier.server.readers.images import image_problem, sniff_format
from readers_data import image_bytes, write_imagefolder


def _rows(address: str, dataset: str, **kw) -> list:
    loader = Loader(dataset, servers=address, batch_size=4, retry=RetryPolicy(max_retries=0),
                    decoding=ImageDecoding(output="none"), **kw)
    out = []
    for b in loader.batches():
        out.extend(b.data["x"].tolist() if isinstance(b.data, dict) and "x" in b.data else b.indices.tolist())
    return out


def _error(address: str, dataset: str, **kw) -> LoaderError:
    with pytest.raises(LoaderError) as info:
        _rows(address, dataset, **kw)
    return info.value


def _arrow(path: Path, n: int) -> Path:
    table = pa.table({"x": np.arange(n, dtype=np.int64)})
    with pa.ipc.new_file(path, table.schema) as w:
        w.write_table(table)
    return path


# ---- bad datasets at start ------------------------------------------------------------


@pytest.fixture
def bad_and_good(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """One good dataset and several bad ones: name -> the file its log line must name."""
    d = tmp_path / "ds"
    d.mkdir()
    good = _arrow(d / "good.arrow", 40)
    pq.write_table(pa.table({"x": np.arange(100)}), d / "trunc.parquet", row_group_size=10)
    raw = (d / "trunc.parquet").read_bytes()
    (d / "trunc.parquet").write_bytes(raw[: len(raw) // 2])
    (d / "empty.arrow").write_bytes(b"")
    (d / "text.arrow").write_text("this is a text file, not Arrow\n" * 20)
    (d / "emptydir").mkdir()
    bad = {
        "trunc": str(d / "trunc.parquet"),
        "empty": str(d / "empty.arrow"),
        "text": str(d / "text.arrow"),
        "emptydir": str(d / "emptydir"),
        "missing": str(d / "missing.arrow"),
    }
    specs = [f"good={good}", *(f"{name}={path}" for name, path in bad.items())]
    return specs, bad


def test_bad_datasets_at_start_are_reported_and_left_unserved(serve_process, bad_and_good) -> None:
    specs, bad = bad_and_good
    srv = serve_process(specs)
    assert sorted(_rows(srv.address, "good")) == list(range(40))
    log = srv.output()
    for name, path in bad.items():
        lines = [line for line in log.splitlines() if f"dataset {name!r} is NOT served" in line]
        assert len(lines) == 1, (name, log)
        assert os.path.basename(path) in lines[0], lines[0]
        err = _error(srv.address, name)
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION, str(err)
        assert "failed to open when the server started" in str(err) and os.path.basename(path) in str(err)
    # A name that was never configured is still NOT_FOUND: the two are told apart.
    assert _error(srv.address, "never-named").code == grpc.StatusCode.NOT_FOUND
    assert srv.proc.poll() is None


def test_strict_datasets_fails_the_start_with_one_line(tmp_path: Path, bad_and_good) -> None:
    specs, bad = bad_and_good
    cmd = [sys.executable, "-m", "croupier.cli", "serve", specs[0], f"trunc={bad['trunc']}", "--strict-datasets",
           "--host", "127.0.0.1", "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("croupier serve:")]
    assert len(errors) == 1 and "'trunc=" in errors[0] and "trunc.parquet" in errors[0] and "--strict-datasets" in errors[0]
    assert "Traceback" not in done.stderr


# ---- Parquet page checksums ------------------------------------------------------------


def _flip_in_first_page(path: Path, column: str) -> None:
    """Flip one byte of the values of `column`'s first data page in row group 0."""
    md = pq.ParquetFile(path).metadata
    names = [md.schema.column(i).name for i in range(md.num_columns)]
    col = md.row_group(0).column(names.index(column))
    raw = bytearray(path.read_bytes())
    at = col.data_page_offset + col.total_compressed_size - 5  # inside the page's values, past its header
    raw[at] ^= 0x5A
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("checksums", [True, False])
def test_a_flipped_byte_in_a_checksummed_page_is_data_loss(serve_inprocess, tmp_path: Path, checksums: bool) -> None:
    root = tmp_path / "data"
    root.mkdir()
    table = pa.table({"id": np.arange(64, dtype=np.int64), "x": np.arange(64, dtype=np.int64) * 3})
    path = root / "t.parquet"
    pq.write_table(table, path, row_group_size=32, compression="NONE", use_dictionary=False,
                   write_page_checksum=checksums)
    _flip_in_first_page(path, "x")
    srv = serve_inprocess(data_roots=[str(root)])
    if checksums:
        err = _error(srv.address, "t.parquet")
        assert err.code == grpc.StatusCode.DATA_LOSS, str(err)
        assert "t.parquet" in str(err) and "row group 0" in str(err) and "column 'x'" in str(err), str(err)
    else:  # the control: without checksums the flipped value is served as if it were right
        got = _rows(srv.address, "t.parquet")
        assert len(got) == 64 and sorted(got) != list(range(0, 192, 3))


# ---- mixed-format folders --------------------------------------------------------------


def test_a_mixed_format_folder_is_refused_naming_the_formats(serve_inprocess, tmp_path: Path) -> None:
    root = tmp_path / "data"
    mixed = root / "mixed"
    mixed.mkdir(parents=True)
    _arrow(mixed / "a.arrow", 10)
    pq.write_table(pa.table({"x": np.arange(5)}), mixed / "b.parquet")
    (mixed / "c.jpg").write_bytes(image_bytes(1, 16, "JPEG"))
    (mixed / "README.md").write_text("notes are not data")
    alone = root / "alone"
    alone.mkdir()
    _arrow(alone / "a.arrow", 10)
    (alone / "README.md").write_text("notes are not data")
    srv = serve_inprocess(data_roots=[str(root)])
    err = _error(srv.address, "mixed")
    assert err.code == grpc.StatusCode.DATA_LOSS, str(err)
    for word in ("mixes formats", "arrow: a.arrow", "parquet: b.parquet", "images: c.jpg"):
        assert word in str(err), str(err)
    assert sorted(_rows(srv.address, "alone")) == list(range(10))


# ---- broken images ---------------------------------------------------------------------


def _jpeg(size: int = 64, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _header_then_garbage(jpeg: bytes) -> bytes:
    """A JPEG's header up to its start of scan, then garbage without any end marker."""
    sos = jpeg.index(b"\xff\xda")
    return jpeg[: sos + 20] + b"\x13\x37garbage" * 200


def _scan_garbled(jpeg: bytes) -> bytes:
    """The header and the end marker intact, the entropy-coded data in between noise."""
    sos = jpeg.index(b"\xff\xda")
    body = np.random.default_rng(1).integers(0, 255, len(jpeg) - sos - 40, dtype=np.uint8).tobytes()
    return jpeg[: sos + 20] + body.replace(b"\xff", b"\x00") + b"\xff\xff\xff\xff" + jpeg[-18:]


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "GIF", "BMP", "WEBP"])
def test_the_cheap_check_passes_good_images_and_catches_cut_ones(fmt: str) -> None:
    for size in (1, 8, 64):
        data = image_bytes(3, size, fmt)
        kind = sniff_format(data)
        assert kind is not None and image_problem(data, kind) is None, (fmt, size)
        assert image_problem(data[: len(data) * 2 // 3], kind) is not None, (fmt, size)
    assert image_problem(_jpeg(), "jpeg") is None
    assert image_problem(_header_then_garbage(_jpeg()), "jpeg") is not None


def test_a_jpeg_with_garbage_after_its_header_is_data_loss_on_the_server(serve_inprocess, tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_imagefolder(root / "imgs", 3, classes=("a", "b"))
    (root / "imgs" / "b" / "00001.png").unlink()
    (root / "imgs" / "b" / "00001.jpg").write_bytes(_header_then_garbage(_jpeg()))
    srv = serve_inprocess(data_roots=[str(root)])
    err = _error(srv.address, "imgs")
    assert err.code == grpc.StatusCode.DATA_LOSS, str(err)
    # The file, and its sample index in the dataset (b/00001.jpg is the 5th of 6).
    assert "b/00001.jpg" in str(err) and "sample 4 " in str(err) and "corrupt JPEG image" in str(err), str(err)


def test_verify_images_catches_a_jpeg_whose_data_does_not_decode(serve_inprocess, tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_imagefolder(root / "imgs", 2, classes=("a", "b"))
    (root / "imgs" / "a" / "00001.png").unlink()
    broken = _scan_garbled(_jpeg())
    assert image_problem(broken, "jpeg") is None  # structurally whole: only a decode sees it
    (root / "imgs" / "a" / "00001.jpg").write_bytes(broken)
    plain = serve_inprocess(data_roots=[str(root)])
    assert len(_rows(plain.address, "imgs")) == 4  # the cheap check lets it through
    strict = serve_inprocess(data_roots=[str(root)], verify_images=True)
    err = _error(strict.address, "imgs")
    assert err.code == grpc.StatusCode.DATA_LOSS, str(err)
    assert "a/00001.jpg" in str(err) and "sample 1 " in str(err) and "does not decode" in str(err), str(err)
