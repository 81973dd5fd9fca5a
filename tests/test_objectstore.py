"""ObjectStore (obstore) against S3 servers on loopback: moto's server mode and croupier's own
latency server, which must agree; `open_store`; and concurrency proved by the server's counts."""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest
from s3_fixtures import CREDENTIALS, S3Backend, moto_backend, own_backend, s3  # noqa: F401

from croupier.bench.s3server import Latency, running
from croupier.server.storage import LocalStore
from croupier.server.storage.base import FileEntry
from croupier.server.storage.objectstore import (
    BucketNotFoundError,
    ObjectStore,
    ObjectStoreConnectionError,
    ObjectStorePermissionError,
)
from croupier.server.storage.urls import clear_cache, is_url, open_store

DATA = random.Random(7).randbytes(300_000)
OBJECTS = {
    "ds/part-0.bin": DATA,
    "ds/part-1.bin": b"hello world",
    "ds/empty.bin": b"",
    "ds/images/cat/1.jpg": b"cat-1",
    "ds/images/cat/2.jpg": b"cat-2",
    "ds/images/dog/1.jpg": b"dog-1",
    "ds-other/x.bin": b"not under ds/",
    "top.json": b"{}",
}


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def store(s3: S3Backend) -> ObjectStore:
    bucket = s3.make_bucket(OBJECTS)
    return ObjectStore(bucket, options=s3.options())


def test_size_is_file_is_dir(store: ObjectStore) -> None:
    assert store.size("ds/part-0.bin") == len(DATA)
    assert store.size("ds/empty.bin") == 0
    assert store.is_file("ds/part-1.bin") and store.is_file("top.json")
    assert not store.is_file("ds") and not store.is_file("ds/nope") and not store.is_file("")
    assert store.is_dir("ds") and store.is_dir("ds/images/cat") and store.is_dir("ds/") and store.is_dir("")
    assert not store.is_dir("ds/part-0.bin") and not store.is_dir("nope") and not store.is_dir("ds/ima")


def test_list_dir_and_list_files(store: ObjectStore) -> None:
    dirs, files = store.list_dir("")
    assert dirs == ["ds", "ds-other"] and files == [FileEntry("top.json", 2)]
    dirs, files = store.list_dir("ds")
    assert dirs == ["images"]
    assert files == [FileEntry("ds/empty.bin", 0), FileEntry("ds/part-0.bin", len(DATA)),
                     FileEntry("ds/part-1.bin", 11)]
    assert store.list_dir("ds/images/") == (["cat", "dog"], [])
    assert [f.path for f in store.list_files("ds/images")] == ["ds/images/cat/1.jpg", "ds/images/cat/2.jpg",
                                                               "ds/images/dog/1.jpg"]
    assert len(store.list_files("")) == len(OBJECTS)
    assert [f.path for f in store.list_files("ds")] == sorted(k for k in OBJECTS if k.startswith("ds/"))
    with pytest.raises(FileNotFoundError, match="s3://"):
        store.list_dir("no/such/folder")


def test_reads_return_the_bytes_put(store: ObjectStore) -> None:
    n = len(DATA)
    cases = [(0, 10), (1000, 4096), (n - 5, 5), (n - 5, 100), (n, 10), (n + 1000, 10), (0, -1), (n - 7, -1),
             (n, -1), (123, 0)]
    for offset, size in cases:
        want = DATA[offset:] if size < 0 else DATA[offset:offset + size]
        assert store.read_range("ds/part-0.bin", offset, size) == want, (offset, size)
        assert run(store.read("ds/part-0.bin", offset, size)) == want, (offset, size)
    assert store.read_file("ds/part-0.bin") == DATA and store.read_file("ds/empty.bin") == b""
    assert run(store.read("ds/empty.bin", 0, -1)) == b"" and run(store.read("ds/empty.bin", 0, 10)) == b""
    rng = random.Random(1)
    ranges = [(rng.randrange(n + 500), rng.choice([0, 1, 100, 5000, -1])) for _ in range(60)] + cases
    got = run(store.read_ranges("ds/part-0.bin", ranges))
    assert got == [DATA[o:] if s < 0 else DATA[o:o + s] for o, s in ranges]
    assert all(type(b) is bytes for b in got)
    snap = store.stats.snapshot()
    assert snap["in_flight"] == 0 and snap["errors"] == 0 and snap["reads"] >= 2 * len(cases) + len(ranges)


def test_missing_key_raises_file_not_found_naming_the_url(store: ObjectStore) -> None:
    url = f"s3://{store.bucket}/ds/nope.bin"
    for call in (lambda: store.size("ds/nope.bin"), lambda: store.read_file("ds/nope.bin"),
                 lambda: run(store.read("ds/nope.bin", 0, 10)),
                 lambda: run(store.read_ranges("ds/nope.bin", [(0, 1), (100_000, 1)]))):
        with pytest.raises(FileNotFoundError) as err:
            call()
        assert type(err.value) is FileNotFoundError and url in str(err.value)
    assert store.stats.snapshot()["errors"] == 4


def test_deleted_bucket_gives_a_clear_error(s3: S3Backend) -> None:
    bucket = s3.make_bucket({"a/b.bin": b"0123456789"})
    store = ObjectStore(bucket, options=s3.options())
    assert run(store.read("a/b.bin", 2, 3)) == b"234"
    s3.drop_bucket(bucket)
    calls = {"size": lambda: store.size("a/b.bin"), "is_file": lambda: store.is_file("a/b.bin"),
             "is_dir": lambda: store.is_dir("a"), "list_dir": lambda: store.list_dir("a"),
             "read_range": lambda: store.read_range("a/b.bin", 0, 3), "read": lambda: run(store.read("a/b.bin", 0, 3))}
    for name, call in calls.items():
        with pytest.raises(BucketNotFoundError) as err:
            call()
        assert not isinstance(err.value, FileNotFoundError), name  # not "a missing file": the bucket is gone
        assert f"s3://{bucket}" in str(err.value) and "does not exist" in str(err.value), (name, str(err.value))


def test_open_store_paths_and_urls(s3: S3Backend, tmp_path) -> None:
    clear_cache()
    local = LocalStore(io_threads=2)
    try:
        assert open_store(str(tmp_path), local=local) == (local, str(tmp_path))
        assert open_store(f"file://{tmp_path}/x", local=local) == (local, f"{tmp_path}/x")
        rel_store, rel = open_store("some/rel")
        assert isinstance(rel_store, LocalStore) and rel == os.path.abspath("some/rel")
        rel_store.close()
    finally:
        local.close()
    bucket = s3.make_bucket({"ds/a.bin": b"abc"})
    store, prefix = open_store(f"s3://{bucket}/ds/", options=s3.options())
    assert isinstance(store, ObjectStore) and prefix == "ds" and store.url(prefix) == f"s3://{bucket}/ds"
    assert store.read_file(store.join(prefix, "a.bin")) == b"abc"
    again, root = open_store(f"s3://{bucket}", options=s3.options())
    assert again is store and root == ""  # one client per bucket and options
    other, _ = open_store(f"s3://{bucket}/ds", options=s3.options(max_retries=2))
    assert other is not store
    assert is_url("s3://b/k") and is_url("file:///x") and not is_url("/data/x") and not is_url("rel/path")
    with pytest.raises(ValueError, match=r"unsupported storage scheme 'ftp'.*s3://"):
        open_store("ftp://host/x")
    with pytest.raises(ValueError, match="no bucket"):
        open_store("s3:///x")
    clear_cache()


def test_environment_configures_the_store(own_backend: S3Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = own_backend.make_bucket({"k": b"env"})
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # AWS_ENDPOINT_URL_S3 wins over it
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", own_backend.endpoint)
    store = ObjectStore(bucket)
    assert store.endpoint == own_backend.endpoint and store.read_file("k") == b"env"
    assert store.client.config["region"] == "eu-west-1"
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    assert ObjectStore(bucket).client.config["region"] == "us-west-2"
    # explicit options beat the environment
    overridden = ObjectStore(bucket, options={"endpoint": "http://127.0.0.1:1", "region": "ap-south-1",
                                              "retry_timeout": 0.5})
    assert overridden.endpoint == "http://127.0.0.1:1" and overridden.client.config["region"] == "ap-south-1"
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SKIP_SIGNATURE", "true")  # anonymous: no credentials looked up
    assert ObjectStore(bucket).read_file("k") == b"env"


def test_denied_and_unreachable_are_clear_oserrors() -> None:
    with running(None, access_key="right") as srv:
        srv.create_bucket("locked")
        srv.put("locked", "k", b"secret")
        base = {"endpoint": srv.endpoint, "region": "us-east-1", "retry_timeout": 1}
        good = ObjectStore("locked", options={**base, "access_key_id": "right", "secret_access_key": "s"})
        assert good.read_file("k") == b"secret"
        for opts in ({"access_key_id": "wrong", "secret_access_key": "s"}, {"skip_signature": True}):
            store = ObjectStore("locked", options={**base, **opts})
            for call in (lambda: store.size("k"), lambda: run(store.read("k", 0, 2)), lambda: store.list_dir("")):
                with pytest.raises(ObjectStorePermissionError) as err:
                    call()
                assert isinstance(err.value, PermissionError) and "s3://locked" in str(err.value)
                assert "access denied" in str(err.value)
    with running(None) as srv:  # a free port once the server is gone
        endpoint = srv.endpoint
    gone = ObjectStore("bkt", options={"endpoint": endpoint, **CREDENTIALS, "retry_timeout": 0.3})
    with pytest.raises(ObjectStoreConnectionError) as err:
        gone.size("k")
    assert isinstance(err.value, ConnectionError) and endpoint in str(err.value) and "s3://bkt/k" in str(err.value)


def test_reads_are_concurrent_by_the_servers_count() -> None:
    """128 reads issued at once through the store are all in flight at the server at once."""
    n = 128
    with running(None, latency=Latency.fixed(300)) as srv:
        srv.create_bucket("lat")
        srv.put("lat", "data.bin", DATA)
        store = ObjectStore("lat", options={"endpoint": srv.endpoint, **CREDENTIALS})

        async def reads() -> list[bytes]:
            return await asyncio.gather(*(store.read("data.bin", i * 2000, 1000) for i in range(n)))

        got = run(reads())
        assert got == [DATA[i * 2000:i * 2000 + 1000] for i in range(n)]
        stats = srv.stats()
        assert stats["requests"] == n and stats["max_in_flight"] == n
        assert store.stats.snapshot()["max_in_flight"] == n
        # one read_ranges call: far-apart ranges are separate GETs, all in flight together
        srv.reset_stats()
        ranges = [(i * 2000, 100) for i in range(n)]
        sparse = ObjectStore("lat", options={"endpoint": srv.endpoint, **CREDENTIALS, "coalesce_bytes": 0})
        assert run(sparse.read_ranges("data.bin", ranges)) == [DATA[o:o + s] for o, s in ranges]
        stats = srv.stats()
        assert stats["requests"] == n and stats["max_in_flight"] == n
        # ... and close ranges are merged into one GET
        srv.reset_stats()
        assert run(store.read_ranges("data.bin", ranges)) == [DATA[o:o + s] for o, s in ranges]
        assert srv.stats()["requests"] == 1


# ---- the own server: latency, and agreement with moto ---------------------------------------


def test_latency_is_seeded_and_applied_per_request() -> None:
    lat = Latency.lognormal(20, 0.5, seed=3)
    assert lat.draws(50) == Latency.lognormal(20, 0.5, seed=3).draws(50) != Latency.lognormal(20, 0.5, seed=4).draws(50)
    uni = Latency.uniform(5, 9, seed=1).draws(200)
    assert all(5 <= d <= 9 for d in uni) and Latency.fixed(7).draws(3) == [7.0, 7.0, 7.0]
    with running(None, latency=lat) as srv:
        srv.create_bucket("lat")
        srv.put("lat", "k", b"x" * 10)
        store = ObjectStore("lat", options={"endpoint": srv.endpoint, **CREDENTIALS})
        t0 = time.monotonic()
        for _ in range(10):
            store.read_range("k", 0, 1)
        elapsed = time.monotonic() - t0
        stats = srv.stats()
        # the k-th request waited the k-th draw
        assert stats["requests"] == 10 and stats["delay_ms"] == pytest.approx(sum(lat.draws(10)))
        assert elapsed >= sum(lat.draws(10)) / 1000 * 0.95


def test_the_own_server_agrees_with_moto(moto_backend: S3Backend, own_backend: S3Backend) -> None:
    """The same boto3 calls against both servers give the same answers."""
    from botocore.exceptions import ClientError

    keys = {"a/b/c.txt": b"c", "a/b/d.txt": b"dd", "a/e.txt": b"eee", "a-f.txt": b"f", "g.txt": DATA[:5000],
            "a/b2/x.txt": b"x", "a b/sp ace+plus%.txt": b"odd"}

    def answers(backend: S3Backend) -> list:
        bucket = backend.make_bucket(keys, name=f"agree-{backend.name}")
        c = backend.client
        out: list = []
        for prefix, delimiter, page in [("", "", 2), ("", "/", 2), ("a/", "/", 1), ("a", "/", 1), ("a/b", "", 3),
                                        ("zzz", "/", 5), ("a b/", "/", 10)]:
            pages = c.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix, Delimiter=delimiter, PaginationConfig={"PageSize": page})
            out.append([([(o["Key"], o["Size"]) for o in p.get("Contents", [])],
                         [cp["Prefix"] for cp in p.get("CommonPrefixes", [])], p["KeyCount"], p["IsTruncated"])
                        for p in pages])
        for rng in ["bytes=0-9", "bytes=4990-6000", "bytes=-10", "bytes=100-"]:
            r = c.get_object(Bucket=bucket, Key="g.txt", Range=rng)
            out.append((r["ResponseMetadata"]["HTTPStatusCode"], r["ContentRange"], r["Body"].read()))
        out.append(c.head_object(Bucket=bucket, Key="a/e.txt")["ContentLength"])
        for call in (lambda: c.get_object(Bucket=bucket, Key="g.txt", Range="bytes=5000-"),
                     lambda: c.get_object(Bucket=bucket, Key="nope"), lambda: c.head_object(Bucket=bucket, Key="nope"),
                     lambda: c.get_object(Bucket="no-such-bucket-x", Key="k"), lambda: c.delete_bucket(Bucket=bucket)):
            with pytest.raises(ClientError) as err:
                call()
            out.append((err.value.response["Error"]["Code"], err.value.response["ResponseMetadata"]["HTTPStatusCode"]))
        backend.drop_bucket(bucket)
        out.append(bucket in [b["Name"] for b in c.list_buckets()["Buckets"]])
        return out

    assert answers(own_backend) == answers(moto_backend)


def test_the_server_runs_as_a_process_from_its_cli(tmp_path) -> None:
    (tmp_path / "bkt" / "d").mkdir(parents=True)
    (tmp_path / "bkt" / "d" / "f.bin").write_bytes(b"0123456789")
    big = DATA * 12  # 3.6 MB: streamed by the server under flow control
    (tmp_path / "bkt" / "big.bin").write_bytes(big)
    with running(tmp_path, latency=Latency.uniform(1, 2, seed=5), process=True) as srv:
        store = ObjectStore("bkt", options={"endpoint": srv.endpoint, **CREDENTIALS})
        assert store.list_files("") == [FileEntry("big.bin", len(big)), FileEntry("d/f.bin", 10)]
        assert run(store.read("d/f.bin", 8, 10)) == b"89"
        assert store.read_file("big.bin") == big and run(store.read("big.bin", 5, -1)) == big[5:]
        stats = srv.stats()
        assert stats["requests"] == 4 and stats["delay_ms"] == pytest.approx(sum(srv.latency.draws(4)))
    with pytest.raises(ValueError, match="loopback"):
        with running(None, host="0.0.0.0"):
            pass
