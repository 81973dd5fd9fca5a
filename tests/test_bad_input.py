"""Bad input gets a clear status naming the value, file or index, and the server stays up."""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from croupier.client import Loader, LoaderError, RetryPolicy
from croupier.protocol.options import StreamOptions
from croupier.v1 import croupier_pb2_grpc


def _stream_error(address: str, **opts) -> grpc.RpcError:
    with grpc.insecure_channel(address) as ch:
        stub = croupier_pb2_grpc.CroupierStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            for _ in stub.StreamEpoch(StreamOptions(**opts).to_proto(), timeout=60):
                pass
    return info.value


def _still_serves(address: str) -> None:
    got = [i for b in Loader("rows", servers=address, batch_size=10).batches() for i in b.indices.tolist()]
    assert sorted(got) == list(range(50))


def _arrow_with_corrupt_offsets(path: Path, n: int = 100) -> None:
    """A valid Arrow file of 2 record batches with a string column, then one string
    offset of rows 0..49 pointed 1 GiB past the file: it passes `Table.validate()`."""
    table = pa.table({"id": np.arange(n), "s": ["x"] * n})
    with pa.ipc.new_file(path, table.schema) as w:
        w.write_table(table, max_chunksize=n // 2)
    raw = bytearray(path.read_bytes())
    offsets = np.arange(n // 2 + 1, dtype=np.int32).tobytes()  # each batch's offsets buffer
    at = raw.find(offsets)
    assert at > 0
    raw[at + 4 * 10 : at + 4 * 11] = np.int32(1 << 30).tobytes()
    path.write_bytes(bytes(raw))
    pa.ipc.open_file(pa.memory_map(str(path))).read_all().validate()  # the structure still checks out


def _png(value: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def data_root(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    root.mkdir()
    table = pa.table({"x": np.arange(100)})
    with pa.ipc.new_file(root / "good.arrow", table.schema) as w:
        w.write_table(table)
    (root / "corrupt.arrow").write_bytes(b"ARROW1\x00\x00" + bytes(range(256)) * 4)
    _arrow_with_corrupt_offsets(root / "bad_offsets.arrow")
    pq.write_table(table, root / "truncated.parquet", row_group_size=10)
    data = (root / "truncated.parquet").read_bytes()
    (root / "truncated.parquet").write_bytes(data[: len(data) // 2])
    shard = root / "shards" / "s-000.tar"
    shard.parent.mkdir()
    with tarfile.open(shard, "w") as tar:
        for i in range(4):
            for ext, payload in (("png", _png(i)), ("cls", str(i % 2).encode())):
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    raw = shard.read_bytes()
    (root / "broken_shards").mkdir()
    (root / "broken_shards" / "s-000.tar").write_bytes(raw[:1800])  # cut inside the 2nd member
    images = root / "images"
    for cls in ("a", "b"):
        (images / cls).mkdir(parents=True)
        for i in range(3):
            (images / cls / f"{i}.png").write_bytes(_png(i))
    (images / "b" / "9.png").write_bytes(b"this is not an image at all")
    return root


@pytest.fixture
def server(serve_inprocess, data_root: Path):
    return serve_inprocess(datasets=["rows=synthetic:50"], data_roots=[str(data_root)])


def test_unknown_dataset_is_not_found_and_named(server) -> None:
    err = _stream_error(server.address, dataset="nope", batch_size=4)
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "'nope'" in err.details() and "rows" in err.details()
    _still_serves(server.address)


def test_rank_outside_the_world_is_invalid_and_named(server) -> None:
    err = _stream_error(server.address, dataset="rows", batch_size=4, rank=3, world_size=3)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rank 3" in err.details() and "size 3" in err.details()
    _still_serves(server.address)


@pytest.mark.parametrize("batch_size, words", [(0, "at least 1"), (51, "larger than the dataset (50 rows)")])
def test_impossible_batch_size_is_invalid_and_named(server, batch_size: int, words: str) -> None:
    err = _stream_error(server.address, dataset="rows", batch_size=batch_size)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.details()
    _still_serves(server.address)


def test_start_batch_past_the_epoch_is_out_of_range(server) -> None:
    err = _stream_error(server.address, dataset="rows", batch_size=10, start_batch=6)
    assert err.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "start_batch 6" in err.details()


def test_unknown_column_is_invalid_and_lists_the_columns(server) -> None:
    err = _stream_error(server.address, dataset="rows", batch_size=5, columns=("index", "nope"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'nope'" in err.details() and "payload" in err.details()


def test_path_outside_the_data_roots_is_not_found_as_if_absent(server, tmp_path: Path) -> None:
    # Outside the roots, a file that exists and one that does not get the same answer:
    # a client cannot probe the server's file system, nor learn where the roots are.
    outside = tmp_path / "elsewhere.arrow"
    outside.write_bytes(b"")
    answers = set()
    for path in (str(outside), "../elsewhere.arrow", str(tmp_path / "absent.arrow"), "../absent.arrow", "/etc/shadow"):
        err = _stream_error(server.address, dataset=path, batch_size=4)
        assert err.code() == grpc.StatusCode.NOT_FOUND
        assert str(tmp_path / "data") not in err.details().replace(repr(path), "")
        answers.add(err.details().replace(repr(path), "PATH"))
    assert len(answers) == 1, answers
    _still_serves(server.address)


def test_path_under_a_data_root_is_served(server) -> None:
    got = [i for b in Loader("good.arrow", servers=server.address, batch_size=10).batches() for i in b.indices]
    assert sorted(got) == list(range(100))


def test_relative_path_is_looked_up_under_every_data_root(serve_inprocess, data_root: Path, tmp_path: Path) -> None:
    second = tmp_path / "second"
    second.mkdir()
    table = pa.table({"x": np.arange(30)})
    with pa.ipc.new_file(second / "only_here.arrow", table.schema) as w:
        w.write_table(table)
    srv = serve_inprocess(data_roots=[str(data_root), str(second)])
    got = [i for b in Loader("only_here.arrow", servers=srv.address, batch_size=10).batches() for i in b.indices]
    assert sorted(got) == list(range(30))
    err = _stream_error(srv.address, dataset="nowhere.arrow", batch_size=4)
    assert err.code() == grpc.StatusCode.NOT_FOUND and "nowhere.arrow" in err.details()
    assert str(second) not in err.details()  # where the roots are is not told to clients


@pytest.mark.parametrize("path", ["corrupt.arrow", "truncated.parquet", "broken_shards"])
def test_corrupt_or_truncated_files_are_data_loss_naming_the_file(server, path: str) -> None:
    err = _stream_error(server.address, dataset=path, batch_size=2)
    assert err.code() in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.FAILED_PRECONDITION)
    assert Path(path).name in err.details()
    _still_serves(server.address)


def test_corrupt_string_offsets_are_data_loss_and_other_streams_go_on(serve_process, data_root: Path) -> None:
    # A subprocess: before the fix, taking these rows killed the server with SIGBUS.
    srv = serve_process(["rows=synthetic:4000:1024", "--data-root", str(data_root),
                         "--latency-ms", "2", "--latency-distribution", "fixed"])
    good = Loader("rows", servers=srv.address, batch_size=50, prefetch=1, retry=RetryPolicy(max_retries=0),
                  buffer_batches=1)
    got: list[int] = []
    for b in good.batches():
        got += b.indices.tolist()
        if len(got) == 50:  # the good stream is open mid-epoch while the bad one fails
            err = _stream_error(srv.address, dataset="bad_offsets.arrow", batch_size=50)
            assert err.code() == grpc.StatusCode.DATA_LOSS
            # The file, the row and the column at fault: the row's own offsets were checked.
            assert "bad_offsets.arrow" in err.details() and "column 's'" in err.details()
            assert re.search(r"row \d+ of that file", err.details())
    assert sorted(got) == list(range(4000))
    assert srv.proc.poll() is None
    # Validation is per column: the intact one still streams.
    rows = Loader("bad_offsets.arrow", servers=srv.address, batch_size=10, retry=RetryPolicy(max_retries=0),
                  columns=["id"])
    assert sorted(i for b in rows.batches() for i in b.data["id"].tolist()) == list(range(100))


def test_bytes_that_are_not_an_image_name_the_file_and_index(server) -> None:
    loader = Loader("images", servers=server.address, batch_size=7, retry=RetryPolicy(max_retries=0))
    with pytest.raises(LoaderError) as info:
        list(loader)
    assert info.value.code == grpc.StatusCode.DATA_LOSS
    assert "9.png" in str(info.value)
    _still_serves(server.address)


def test_len_and_iteration_refuse_an_impossible_batch_size_alike(server) -> None:
    loader = Loader("rows", servers=server.address, batch_size=51, retry=RetryPolicy(max_retries=0))
    with pytest.raises(LoaderError) as by_len:
        len(loader)
    with pytest.raises(LoaderError) as by_iteration:
        list(loader)
    assert by_len.value.code == by_iteration.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "larger than the dataset (50 rows)" in str(by_len.value)
    assert "larger than the dataset (50 rows)" in str(by_iteration.value)


def test_a_row_over_the_message_limit_fails_at_once_naming_the_limit(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=["rows=synthetic:4:2000000"], max_message_bytes=1 << 20)
    loader = Loader("rows", servers=srv.address, batch_size=2, retry=RetryPolicy(max_retries=3, initial_backoff_s=0.01))
    with pytest.raises(LoaderError) as info:
        list(loader)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-message-mb" in str(info.value)
    assert loader.stats.reconnects == 0  # retrying would send the same message again


def test_bad_server_config_file_names_the_setting(tmp_path: Path) -> None:
    from croupier.server.config import load_config_file

    cfg = tmp_path / "server.yaml"
    cfg.write_text("port: 1\nmax_readz: 4\n")
    with pytest.raises(ValueError, match="unknown setting 'max_readz'"):
        load_config_file(cfg)
