"""The cache tier for object-store datasets (s3://): keyed by URL, size and ETag, filled by
large range GETs. Real components: croupier's loopback S3 server (5 ms a request) and its
request counter, obstore and the direct GET client, and an in-process gRPC server end to
end: a second epoch of a dataset that fits makes not one request; a changed object is read
again, never served stale, and the log names it; the budget bounds both tiers; reads racing
the fill get every byte right."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import random
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from croupier.bench.s3server import running
from croupier.server.cache import BlockCache, CacheSizes, CachedObjectStore
from croupier.server.cache.blocks import BLOCK_BYTES
from croupier.server.storage.objectstore import ObjectStore
from croupier.server.storage.urls import clear_cache
from cache_epochs import image_epoch
from readers_data import expected_pixel, png_bytes, write_imagefolder
from s3_fixtures import S3Backend


@pytest.fixture(scope="module")
def slow_s3() -> Iterator[S3Backend]:
    """The loopback S3 server, 5 ms a request: large GETs pay by a wide margin (the fill rule)."""
    with running(None, latency=5) as srv:
        yield S3Backend("s3server", srv.endpoint, srv)


def _requests(s3: S3Backend) -> int:
    return s3.server.stats()["requests"]  # type: ignore[union-attr]


def _object_store(s3: S3Backend, bucket: str) -> ObjectStore:
    return ObjectStore(bucket, options=s3.options())


def _noise_png(i: int, rng: np.random.Generator) -> bytes:
    """A 64x64 PNG of noise (about 12 KB: it does not compress) whose first byte is expected_pixel(i)."""
    pixels = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    pixels[0, 0, 0] = expected_pixel(i)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _shards(s3: S3Backend, bucket: str, n: int, per_shard: int) -> int:
    """WebDataset shards of n samples in the bucket (about 12 KB each); their bytes."""
    rng = np.random.default_rng(1)
    total = 0
    for s in range(0, n, per_shard):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for i in range(s, min(s + per_shard, n)):
                for name, data in ((f"sample{i:06d}.png", _noise_png(i, rng)), (f"sample{i:06d}.cls", str(i % 3).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        s3.client.put_object(Bucket=bucket, Key=f"ds/shard-{s // per_shard:04d}.tar", Body=buf.getvalue())
        total += len(buf.getvalue())
    return total


@pytest.fixture
def aws_env(slow_s3: S3Backend, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    slow_s3.point_env_at(monkeypatch)
    yield
    clear_cache()


def test_a_second_epoch_of_an_s3_dataset_that_fits_makes_no_request(
    tmp_path: Path, slow_s3: S3Backend, aws_env, serve_inprocess, caplog
) -> None:
    n = 500
    bucket = slow_s3.make_bucket()
    size = _shards(slow_s3, bucket, n, per_shard=250)  # 2 shards of about 3 MB
    with caplog.at_level(logging.INFO, logger="croupier.server.cache"):
        srv = serve_inprocess(datasets=[f"ds=s3://{bucket}/ds"], cache_memory="64M", cache_dir=str(tmp_path / "idx"))
        [reader] = srv.running.catalog.readers()
        store = reader.store
        assert isinstance(store, CachedObjectStore)
        before = _requests(slow_s3)
        image_epoch(srv.address, "ds", 0, n)  # cold: samples' GETs beside the fill's
        assert store.fill_done(60)
        assert _requests(slow_s3) > before
    # the rule was measured and said so: large GETs on this store pay
    assert any("a fill from s3://" in r.getMessage() and "GET took" in r.getMessage() for r in caplog.records)
    cache = srv.running.catalog.cache
    assert cache.memory.resident == size
    requests, hits = _requests(slow_s3), cache.stats.hits
    image_epoch(srv.address, "ds", 1, n)
    image_epoch(srv.address, "ds", 2, n)
    assert _requests(slow_s3) == requests  # not one GET (nor HEAD, nor LIST)
    assert cache.stats.hits >= hits + 2 * n


def _put(s3: S3Backend, bucket: str, key: str, data: bytes, mtime_ns: int) -> None:
    s3.server.put(bucket, key, data)  # type: ignore[union-attr]
    path = os.path.join(s3.server.root, bucket, key)  # type: ignore[union-attr]
    os.utime(path, ns=(mtime_ns, mtime_ns))  # the server's ETag is size and mtime: another ETag


def test_a_changed_object_is_read_again_never_served_stale_and_the_log_names_it(slow_s3: S3Backend, caplog) -> None:
    bucket = slow_s3.make_bucket()
    old, new = random.Random(1).randbytes(3 * BLOCK_BYTES), random.Random(2).randbytes(3 * BLOCK_BYTES)
    _put(slow_s3, bucket, "obj.bin", old, 10**18)
    cache = BlockCache(CacheSizes(memory_bytes=8 * BLOCK_BYTES, fill="always"))
    inner = _object_store(slow_s3, bucket)
    reads = [(5, 100), (BLOCK_BYTES + 3, 4000), (3 * BLOCK_BYTES - 10, 10)]
    url = f"s3://{bucket}/obj.bin"

    async def epoch(store: CachedObjectStore) -> list[bytes]:
        return await store.read_ranges("obj.bin", reads)

    async def go() -> None:
        first = CachedObjectStore(inner, cache, "t")
        first.pin("obj.bin")
        assert await epoch(first) == [old[o:o + s] for o, s in reads]
        assert await asyncio.to_thread(first.fill_done, 60) and cache.memory.resident == 3 * BLOCK_BYTES
        count = _requests(slow_s3)
        assert await epoch(first) == [old[o:o + s] for o, s in reads] and _requests(slow_s3) == count  # cached
        first.close()

        # 1. rewritten between two opens: the new open's HEAD sees another ETag
        _put(slow_s3, bucket, "obj.bin", new, 2 * 10**18)
        second = CachedObjectStore(inner, cache, "t")
        with caplog.at_level(logging.INFO, logger="croupier.server.cache"):
            second.pin("obj.bin")
        assert [r.getMessage() for r in caplog.records if url in r.getMessage() and "changed" in r.getMessage()]
        count = _requests(slow_s3)
        assert await epoch(second) == [new[o:o + s] for o, s in reads]
        assert _requests(slow_s3) > count  # read again from the store
        assert await asyncio.to_thread(second.fill_done, 60)
        assert cache.memory.resident == 3 * BLOCK_BYTES  # the new version's blocks only
        assert await epoch(second) == [new[o:o + s] for o, s in reads]
        second.close()

        # 2. rewritten while its dataset is open, before the fill: the fill's GET carries the
        # new ETag; nothing of either version is served from the cache, the log names it once
        third = CachedObjectStore(inner, cache, "t")
        third.pin("obj.bin")  # keyed on `new` (its memory blocks left when `second` closed)
        _put(slow_s3, bucket, "obj.bin", old, 3 * 10**18)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="croupier.server.cache"):
            got = await epoch(third)  # starts the fill, which sees the new ETag
            assert await asyncio.to_thread(third.fill_done, 60)
        assert got == [old[o:o + s] for o, s in reads]  # the store's bytes: the object as it is now
        changed = [r for r in caplog.records if "changed while dataset" in r.getMessage()]
        assert len(changed) == 1 and url in changed[0].getMessage() and changed[0].levelname == "WARNING"
        assert third.key_of("obj.bin") is None and cache.memory.resident == 0
        count = _requests(slow_s3)
        assert await epoch(third) == [old[o:o + s] for o, s in reads]
        assert _requests(slow_s3) == count + len(reads)  # straight to the store, one GET a range
        third.close()

    asyncio.run(go())
    cache.close()


def test_the_budget_bounds_both_tiers_and_what_is_left_out_is_read_from_the_store(tmp_path: Path, slow_s3: S3Backend) -> None:
    bucket = slow_s3.make_bucket()
    data = random.Random(3).randbytes(6 * BLOCK_BYTES)
    _put(slow_s3, bucket, "big.bin", data, 10**18)
    disk_bound = 3 * BLOCK_BYTES  # headers count: 2 blocks fit, not 3
    cache = BlockCache(CacheSizes(memory_bytes=2 * BLOCK_BYTES, disk_dir=str(tmp_path / "c"), disk_bytes=disk_bound,
                                  fill="always"))
    store = CachedObjectStore(_object_store(slow_s3, bucket), cache, "t")
    store.pin("big.bin")
    reads = [(b * BLOCK_BYTES + 17, 1000) for b in range(6)]

    async def go() -> None:
        assert await store.read_ranges("big.bin", reads[:1]) == [data[17:1017]]
        assert await asyncio.to_thread(store.fill_done, 60)
        assert store._fill.full  # the fill stopped: neither tier had room
        key = store.key_of("big.bin")
        assert key is not None
        in_memory = [b for b in range(6) if cache.memory.has(key.version_id, b)]
        on_disk = [b for b in range(6) if cache.disk.has((key.path_id, key.version_id, b))]  # type: ignore[union-attr]
        # two GETs in flight land in either order: which blocks, not how many, may vary
        assert len(in_memory) == 2 and len(on_disk) == 2 and not set(in_memory) & set(on_disk)
        assert cache.memory.resident == 2 * BLOCK_BYTES and cache.disk.used <= disk_bound  # type: ignore[union-attr]
        on_folder = sum(p.stat().st_size for p in (tmp_path / "c").rglob("*") if p.is_file())
        assert on_folder == cache.disk.used  # type: ignore[union-attr]
        count = _requests(slow_s3)
        assert await store.read_ranges("big.bin", reads) == [data[o:o + s] for o, s in reads]
        assert _requests(slow_s3) == count + 2  # the 2 blocks in neither tier: from the store, one GET each

    asyncio.run(go())
    store.close()
    cache.close()


def test_reads_racing_the_fill_get_every_byte_right_and_later_ones_never_reach_the_store(slow_s3: S3Backend) -> None:
    bucket = slow_s3.make_bucket()
    data = random.Random(4).randbytes(5 * BLOCK_BYTES + 123)
    _put(slow_s3, bucket, "f.bin", data, 10**18)
    cache = BlockCache(CacheSizes(memory_bytes=16 * BLOCK_BYTES, fill="always"))
    store = CachedObjectStore(_object_store(slow_s3, bucket), cache, "t")
    store.pin("f.bin")
    rng = random.Random(5)
    reads = [(o, rng.randrange(1, 3000)) for o in (rng.randrange(len(data)) for _ in range(300))]

    async def go() -> None:
        results: list[bytes | None] = [None] * len(reads)

        async def one(i: int) -> None:
            results[i] = (await store.read_ranges("f.bin", [reads[i]]))[0]

        # the first read starts the fill; the rest run beside it, each from wherever its bytes are
        await asyncio.gather(*(one(i) for i in range(len(reads))))
        assert await asyncio.to_thread(store.fill_done, 60)
        assert results == [data[o:o + s] for o, s in reads]
        assert cache.stats.hits + cache.stats.misses == len(reads)
        assert cache.memory.resident == len(data)
        count = _requests(slow_s3)
        assert await store.read_ranges("f.bin", reads) == [data[o:o + s] for o, s in reads]
        assert _requests(slow_s3) == count

    asyncio.run(go())
    store.close()
    cache.close()


def test_an_image_folder_in_a_bucket_is_kept_by_its_first_epoch_under_its_listings_versions(
    slow_s3: S3Backend, aws_env, serve_inprocess
) -> None:
    bucket = slow_s3.make_bucket()
    root = Path(slow_s3.server.root) / bucket  # type: ignore[union-attr]
    files = write_imagefolder(root / "imgs", 40, ("cat", "dog", "eel"))
    total = sum((root / "imgs" / rel).stat().st_size for rel, _ in files)
    srv = serve_inprocess(datasets=[f"imgs=s3://{bucket}/imgs"], cache_memory="64M")
    [reader] = srv.running.catalog.readers()
    cache = srv.running.catalog.cache
    before = _requests(slow_s3)
    image_epoch(srv.address, "imgs", 0, len(files))  # cold: one GET an image (no HEAD), each kept
    assert _requests(slow_s3) - before == len(files) and cache.memory.resident == total
    requests, hits = _requests(slow_s3), cache.stats.hits
    image_epoch(srv.address, "imgs", 1, len(files))
    assert _requests(slow_s3) == requests and cache.stats.hits == hits + len(files)  # not one request

    # an image rewritten: a dataset opened on the new listing reads it again, the rest from memory
    rel = files[7][0]
    _put(slow_s3, bucket, f"imgs/{rel}", png_bytes(7) + b"\0" * 16, 2 * 10**18)
    store = CachedObjectStore(reader.store.inner, cache, "again")
    store.inner.list_dir(f"imgs/{rel.split('/')[0]}")  # the new open's listing of that folder

    async def read_all() -> list[bytes]:
        return [await store.read(f"imgs/{r}", 0, -1) for r, _ in files]

    requests = _requests(slow_s3)
    got = asyncio.run(read_all())
    assert got[7] == png_bytes(7) + b"\0" * 16 and _requests(slow_s3) == requests + 1  # that image alone
    assert [g for i, g in enumerate(got) if i != 7] == [(root / "imgs" / r).read_bytes() for i, (r, _) in enumerate(files) if i != 7]
    store.close()
