"""Datasets in an S3 bucket, served by a real croupier server through range GETs.

The S3-protocol server runs on loopback, started here (croupier's latency server, with
moto's server mode for one format too). The croupier server finds the endpoint and
credentials in its environment, as the AWS SDKs do, and reads every format with range
reads: every sample exactly once per epoch, the same values as from local files; a
bucket deleted mid-epoch fails that stream with a clear error and the server goes on.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from croupier.client import Loader, LoaderError, RetryPolicy
from croupier.server.stream.fetch_limits import FetchLimits
from croupier.server.storage.urls import clear_cache
from readers_data import expected_pixel, expected_row, write_arrow_folder, write_hf_dataset, write_imagefolder
from readers_data import write_parquet, write_webdataset
from s3_fixtures import S3Backend, moto_backend, own_backend  # noqa: F401  (fixtures)


def _upload(s3: S3Backend, folder: Path, bucket: str, prefix: str) -> None:
    for f in sorted(folder.rglob("*")):
        if f.is_file() and not f.name.endswith(".idx.json"):
            s3.client.put_object(Bucket=bucket, Key=f"{prefix}/{f.relative_to(folder).as_posix()}", Body=f.read_bytes())


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch):
    def point_at(s3: S3Backend) -> None:
        s3.point_env_at(monkeypatch)

    yield point_at
    clear_cache()


def _write(kind: str, folder: Path) -> int:
    if kind == "arrow":
        write_arrow_folder(folder, [40, 35, 25])
        return 100
    if kind == "hf":
        write_hf_dataset(folder, 90, max_shard_size="4KB")
        return 90
    if kind == "parquet":
        folder.mkdir(parents=True)
        write_parquet(folder / "a.parquet", 50, row_group_size=8)
        write_parquet(folder / "b.parquet", 30, row_group_size=8, start=50)
        return 80
    if kind == "imagefolder":
        return len(write_imagefolder(folder, 20, ("cat", "dog", "eel")))
    if kind == "webdataset":
        return len(write_webdataset(folder, 55, shard_size=20))
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["arrow", "hf", "parquet", "imagefolder", "webdataset"])
def test_every_format_streams_from_s3_exactly_once_per_epoch(
    tmp_path: Path, own_backend: S3Backend, aws_env, serve_inprocess, kind: str  # noqa: F811
) -> None:
    aws_env(own_backend)
    n = _write(kind, tmp_path / "local")
    bucket = own_backend.make_bucket()
    _upload(own_backend, tmp_path / "local", bucket, "data/ds")
    url = f"s3://{bucket}/data/ds"
    before = own_backend.server.stats()["requests"]  # type: ignore[union-attr]
    srv = serve_inprocess(datasets=[f"ds={url}"], cache_dir=str(tmp_path / "cache"))
    loader = Loader("ds", servers=srv.address, batch_size=16, retry=RetryPolicy(max_retries=0))
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        seen: list[int] = []
        for batch in loader.batches():
            seen += batch.indices.tolist()
            if kind in ("imagefolder", "webdataset"):
                for i, img in zip(batch.indices.tolist(), batch.data["image"]):
                    assert int(img.reshape(-1)[0]) == expected_pixel(i)
            else:
                ids = batch.data["id"].tolist()
                assert ids == batch.indices.tolist()
                assert batch.data["text"] == [expected_row(i)["text"] for i in ids]
        assert sorted(seen) == list(range(n)), f"epoch {epoch}: every sample exactly once"
    assert own_backend.server.stats()["requests"] > before  # type: ignore[union-attr]


def test_arrow_from_moto_s3_server(tmp_path: Path, moto_backend: S3Backend, aws_env, serve_inprocess) -> None:  # noqa: F811
    """The same through an independent S3 implementation (moto's server mode)."""
    aws_env(moto_backend)
    write_arrow_folder(tmp_path / "local", [30, 30])
    bucket = moto_backend.make_bucket()
    _upload(moto_backend, tmp_path / "local", bucket, "ds")
    srv = serve_inprocess(datasets=[f"ds=s3://{bucket}/ds"])
    loader = Loader("ds", servers=srv.address, batch_size=8, retry=RetryPolicy(max_retries=0))
    rows = [row for batch in loader.batches() for row in batch.data["id"].tolist()]
    assert sorted(rows) == list(range(60))


def test_a_bucket_deleted_mid_epoch_fails_its_stream_clearly_and_the_server_goes_on(
    tmp_path: Path, own_backend: S3Backend, aws_env, serve_inprocess  # noqa: F811
) -> None:
    aws_env(own_backend)
    write_imagefolder(tmp_path / "gone", 200, ("a", "b"))
    write_arrow_folder(tmp_path / "kept", [50])
    doomed, kept = own_backend.make_bucket(), own_backend.make_bucket()
    _upload(own_backend, tmp_path / "gone", doomed, "imgs")
    _upload(own_backend, tmp_path / "kept", kept, "rows")
    # Reads wait for the trainer (a few in flight, little buffered): most happen after the drop.
    limits = FetchLimits(max_reads_per_stream=4, max_buffered_bytes=1, chunk_samples=4, default_prefetch=0)
    srv = serve_inprocess(datasets=[f"imgs=s3://{doomed}/imgs", f"rows=s3://{kept}/rows"], limits=limits)
    loader = Loader("imgs", servers=srv.address, batch_size=8, prefetch=0, retry=RetryPolicy(max_retries=0),
                    buffer_batches=1)
    seen = 0
    with pytest.raises(LoaderError) as failed:
        for batch in loader.batches():
            seen += len(batch.indices)
            if seen == 8:
                own_backend.drop_bucket(doomed)
    assert 8 <= seen < 400
    cause = failed.value.__cause__ if isinstance(failed.value.__cause__, grpc.RpcError) else None
    message = str(failed.value) + (cause.details() if cause is not None else "")
    # The dataset and the member, not where it lives (paths are not disclosed by default).
    assert "<imgs>/a/" in message and f"s3://{doomed}" not in message
    assert "NoSuch" in message or "does not exist" in message or "No such" in message
    # The server is up and its other dataset streams whole.
    rows = Loader("rows", servers=srv.address, batch_size=10, retry=RetryPolicy(max_retries=0))
    assert sorted(i for b in rows.batches() for i in b.data["id"].tolist()) == list(range(50))
