"""An image folder in a bucket is read in groups: a group of images is one storage call, a
GET each on the event loop, with no task or coroutine per image (server/storage/object_groups.py).

Real components: croupier's loopback S3 server (its request counter), obstore and the direct
GET client, the ImageFolder reader, the server's cache tier and an in-process gRPC server
end to end. The per-image path (`ObjectStore._read`) and the group call are counted by
wrapping the real methods, which still do the reads."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from croupier.bench.s3server import running
from croupier.server.readers.base import SampleError
from croupier.server.readers.imagefolder import ImageFolderReader
from croupier.server.storage.objectstore import ObjectStore
from croupier.server.storage.urls import clear_cache
from cache_epochs import image_epoch
from readers_data import write_imagefolder
from s3_fixtures import S3Backend


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Backend]:
    with running(None, latency=2) as srv:
        yield S3Backend("s3server", srv.endpoint, srv)


@pytest.fixture
def aws_env(s3: S3Backend, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    s3.point_env_at(monkeypatch)
    yield
    clear_cache()


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Calls of the per-image read and of the group call of every ObjectStore, and the
    objects the group calls asked for."""
    calls: Counter = Counter()
    per_image, group = ObjectStore._read, ObjectStore.submit_files

    async def read(self: ObjectStore, path: str, offset: int, size: int) -> bytes:
        calls["per_image"] += 1
        return await per_image(self, path, offset, size)

    def submit_files(self: ObjectStore, paths: Any, versioned: bool, callback: Any) -> bool:
        taken = group(self, paths, versioned, callback)
        calls["groups"] += taken
        calls["grouped_objects"] += len(paths) if taken else 0
        calls["largest_group"] = max(calls["largest_group"], len(paths) if taken else 0)
        return taken

    monkeypatch.setattr(ObjectStore, "_read", read)
    monkeypatch.setattr(ObjectStore, "submit_files", submit_files)
    return calls


def _requests(s3: S3Backend) -> int:
    return s3.server.stats()["requests"]  # type: ignore[union-attr]


def test_an_image_folder_in_a_bucket_is_read_in_groups_and_its_next_epoch_from_the_cache(
    s3: S3Backend, aws_env, counted: Counter, serve_inprocess
) -> None:
    bucket = s3.make_bucket()
    root = Path(s3.server.root) / bucket  # type: ignore[union-attr]
    files = write_imagefolder(root / "imgs", 30, ("cat", "dog", "eel"))
    srv = serve_inprocess(datasets=[f"imgs=s3://{bucket}/imgs"], cache_memory="64M")
    cache = srv.running.catalog.cache
    before = _requests(s3)
    image_epoch(srv.address, "imgs", 0, len(files))
    # one GET an image, every one asked for by a group call, none by the per-image path
    assert _requests(s3) - before == len(files)
    assert counted["grouped_objects"] == len(files) and counted["per_image"] == 0
    # a group is as large as the read slots free when it starts: the epoch's first has the
    # stream's whole in-flight bound (later ones, how many reads just landed: timing)
    assert counted["largest_group"] >= 8
    assert cache.stats.misses == len(files)
    requests, hits, groups = _requests(s3), cache.stats.hits, counted["groups"]
    image_epoch(srv.address, "imgs", 1, len(files))
    # the cache hands every image over: no request, no store call at all
    assert _requests(s3) == requests and cache.stats.hits == hits + len(files)
    assert counted["groups"] == groups and counted["per_image"] == 0


def test_a_group_names_each_image_once_and_an_object_gone_since_the_listing_as_a_read_of_it_would(
    s3: S3Backend, counted: Counter
) -> None:
    """A GET the direct client cannot complete (404: the object was deleted after the open) is
    handed back and done through obstore, whose error is the one the per-image read gives."""
    bucket = s3.make_bucket()
    root = Path(s3.server.root) / bucket  # type: ignore[union-attr]
    files = write_imagefolder(root / "imgs", 12, ("cat", "dog"))
    store = ObjectStore(bucket, options=s3.options())
    reader = ImageFolderReader("imgs", "imgs", store=store)
    gone = 5
    (root / "imgs" / files[gone][0]).unlink()

    async def run() -> tuple[list[list[tuple[int, Any, Any]]], BaseException]:
        calls: list[list[tuple[int, Any, Any]]] = []
        finished = asyncio.Event()
        indices = list(range(len(files)))

        def done(landed: list[tuple[int, Any, Any]]) -> None:
            calls.append(landed)
            if sum(map(len, calls)) == len(indices):
                finished.set()

        assert reader.reads_in_groups
        assert reader.start_reads(indices, (), done) == ()  # all taken by the group call
        await asyncio.wait_for(finished.wait(), 30)
        with pytest.raises(SampleError) as one_by_one:
            await reader.read(gone)
        return calls, one_by_one.value

    handed_back = store.fast.handed_back  # type: ignore[union-attr]
    calls, expected = asyncio.run(run())
    landed = [x for call in calls for x in call]
    assert sorted(pos for pos, _, _ in landed) == list(range(len(files)))  # each exactly once
    for pos, item, err in landed:
        if pos == gone:
            assert item is None and isinstance(err, SampleError)
            assert str(err) == str(expected) and f"s3://{bucket}/imgs/{files[gone][0]}" in str(err)
        else:
            assert err is None and item.data == (root / "imgs" / files[pos][0]).read_bytes()
            assert item.label == files[pos][1] and item.where == f"s3://{bucket}/imgs/{files[pos][0]}"
    # the 404 was handed back (the group's and the awaited read's), the rest done on the loop
    assert store.fast.handed_back - handed_back == 2  # type: ignore[union-attr]
    assert counted["groups"] == 1 and counted["per_image"] == 1  # the awaited read alone
    assert store.stats.errors == 2 and store.stats.in_flight == 0
    reader.close()
    store.close()
