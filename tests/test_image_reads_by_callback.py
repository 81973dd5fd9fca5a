"""Images read without a task or a coroutine per image: ImageFolderReader.start_read over
`Store.submit_whole` (the native pool's callback, through the confined store's roots
check and the cache tier's whole-file keys). Real components: a gRPC server on loopback,
real files, links and latencyfs FUSE mounts. An epoch never awaits the reader's `read`
(the task path) and gets every image exactly once with its bytes; a missing, truncated or
non-image file, and a link out of the roots, fail exactly as `read` fails; the cache
counts and serves exactly as the awaited path does. With CROUPIER_READ_POOL=python the
stores say they have no callback path and the awaited one serves."""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path
from typing import Any

import pytest

from croupier.bench import latencyfs
from croupier.server.cache import BlockCache, CacheSizes, CachedStore
from croupier.server.readers.imagefolder import ImageFolderReader, _concatenated
from croupier.server.storage import native
from croupier.server.storage.confined import ConfinedStore
from croupier.server.storage.local import LocalStore
from croupier.server.storage.objectstore import ObjectStore
from cache_epochs import image_epoch
from readers_data import png_bytes, write_imagefolder

_REASON = latencyfs.check_available()
needs_fuse = pytest.mark.skipif(_REASON is not None, reason=f"latencyfs unusable here: {_REASON}")
#: The callback path needs the native pool (CROUPIER_READ_POOL=python: the awaited path).
CALLBACKS = native.available()


def _count_awaited_reads(reader: Any) -> list[int]:
    """Count the calls to the reader's awaited `read` (each one a task in the stream)."""
    calls = [0]
    read = reader.read

    async def counted(index: int, columns: Any = ()) -> Any:
        calls[0] += 1
        return await read(index, columns)

    reader.read = counted
    return calls


@pytest.mark.parametrize("cache", ["64M", "0"])
def test_an_image_folder_epoch_reads_every_image_once_without_a_task_per_image(
    tmp_path: Path, serve_inprocess, cache: str
) -> None:
    files = write_imagefolder(tmp_path / "data", 40)
    srv = serve_inprocess(datasets=[f"imgs={tmp_path / 'data'}"], cache_memory=cache)
    [reader] = srv.running.catalog.readers()
    assert isinstance(reader.store, CachedStore) == (cache != "0")
    awaited = _count_awaited_reads(reader)
    before = reader.store.stats.reads
    image_epoch(srv.address, "imgs", 0, len(files))  # every image exactly once, its bytes its own
    assert reader.store.stats.reads - before == len(files)  # one storage read per image
    assert awaited[0] == (0 if CALLBACKS else len(files))


@needs_fuse
def test_a_second_epoch_on_fuse_is_served_from_the_cache_by_callback_not_one_read_at_the_daemon(
    tmp_path: Path, serve_inprocess
) -> None:
    src = tmp_path / "src"
    files = write_imagefolder(src, 30)
    total = sum((src / rel).stat().st_size for rel, _ in files)
    with latencyfs.mounted(src, median_ms=2, distribution="fixed", max_background=latencyfs.KERNEL_DEFAULT) as fs:
        srv = serve_inprocess(datasets=[f"imgs={fs.path}"], cache_memory="64M")
        [reader] = srv.running.catalog.readers()
        awaited = _count_awaited_reads(reader)
        cache = srv.running.catalog.cache
        image_epoch(srv.address, "imgs", 0, len(files))  # cold: each image read once, and kept
        assert (cache.memory.resident, cache.stats.misses, cache.stats.hits) == (total, len(files), 0)
        daemon = fs.stats()
        image_epoch(srv.address, "imgs", 1, len(files))
        after = fs.stats()
        assert (after["requests"], after["opens"]) == (daemon["requests"], daemon["opens"])  # not one read, not one open
        assert (cache.stats.misses, cache.stats.hits) == (len(files), len(files))
        assert awaited[0] == (0 if CALLBACKS else 2 * len(files))


# ---- errors: the same as the awaited read's ------------------------------------------------


def _store(kind: str, inside: Path) -> Any:
    """A store an ImageFolder is read through: confined; confined and cached (the cache
    bypassed on a local disk, or its whole-file tier as on FUSE); the plain local store."""
    if kind == "local":
        return LocalStore(io_threads=4)
    confined = ConfinedStore(LocalStore(io_threads=4), [str(inside)])
    if kind == "confined":
        return confined
    return CachedStore(confined, BlockCache(CacheSizes(memory_bytes=1 << 20, fill="never")), "t")


async def _by_callback(reader: ImageFolderReader, index: int) -> tuple[bool, Any, BaseException | None]:
    """start_read of `index`: (whether it started, item, error)."""
    landed: asyncio.Future[tuple[Any, BaseException | None]] = asyncio.get_running_loop().create_future()
    started = reader.start_read(index, (), lambda item, err: landed.set_result((item, err)))
    if not started:
        return False, None, None
    item, err = await landed
    return True, item, err


async def _awaited(reader: ImageFolderReader, index: int) -> tuple[Any, BaseException | None]:
    try:
        return await reader.read(index), None
    except Exception as exc:
        return None, exc


def _broken_folder(tmp_path: Path, kind: str, n: int) -> tuple[ImageFolderReader, bytes]:
    """An ImageFolder of `n` images read through store `kind`, images 1-4 broken after the
    listing (missing, truncated, not an image, a link out of the roots); image 0's bytes."""
    inside, outside = tmp_path / "in", tmp_path / "out"
    files = write_imagefolder(inside, n, ("cat",))
    outside.mkdir()
    (outside / "secret.png").write_bytes(png_bytes(9))
    reader = ImageFolderReader("imgs", str(inside), store=_store(kind, inside))
    if kind == "cached-whole-files":
        reader.store.whole.bypass = False  # as on FUSE: the whole-file tier keys and keeps
    good = (inside / files[0][0]).read_bytes()
    (inside / files[1][0]).unlink()  # missing since the listing
    (inside / files[2][0]).write_bytes(png_bytes(2)[:20])  # truncated: a PNG header without its chunks
    (inside / files[3][0]).write_bytes(b"not an image at all")
    (inside / files[4][0]).unlink()
    (inside / files[4][0]).symlink_to(outside / "secret.png")  # swapped for a link out of the roots
    return reader, good


@pytest.mark.parametrize("kind", ["confined", "cached-local-disk", "cached-whole-files", "local"])
def test_a_missing_truncated_or_non_image_file_or_a_link_out_of_the_roots_fails_as_the_awaited_read_does(
    tmp_path: Path, kind: str
) -> None:
    reader, good = _broken_folder(tmp_path, kind, 5)

    async def go() -> list[tuple[tuple[bool, Any, BaseException | None], tuple[Any, BaseException | None]]]:
        return [(await _by_callback(reader, i), await _awaited(reader, i)) for i in range(len(reader))]

    results = asyncio.run(go())
    assert [started for (started, _, _), _ in results] == [CALLBACKS] * 5
    for i, ((_, item, err), (want_item, want_err)) in enumerate(results):
        if CALLBACKS:
            assert item == want_item, i
            assert (type(err), str(err)) == (type(want_err), str(want_err)), i
    want = [want_err for _, (_, want_err) in results]
    assert [type(e).__name__ for e in want] == (["NoneType", "SampleError", "SampleError", "SampleError"]
                                               + (["NoneType"] if kind == "local" else ["ConfinementError"]))
    assert results[0][1][0].data == good and (results[4][1][0].data == png_bytes(9) if kind == "local" else True)
    assert "sample 1 (" in str(want[1]) and "cannot read" in str(want[1]) and "No such file" in str(want[1])
    assert "sample 2 (" in str(want[2]) and "corrupt PNG" in str(want[2])
    assert "sample 3 (" in str(want[3]) and "not an image" in str(want[3])
    if kind != "local":
        assert "outside the dataset's roots" in str(want[4])
    reader.store.close()


async def _by_group(reader: ImageFolderReader, indices: list[int]) -> tuple[list[int], dict[int, tuple[Any, Any]], int]:
    """start_reads of `indices`: (the positions it left to start_read, position -> (item,
    error) for the rest, how many calls handed them over)."""
    got: dict[int, tuple[Any, Any]] = {}
    calls = [0]
    every = asyncio.Event()

    def done(results: list) -> None:
        calls[0] += 1
        for pos, item, err in results:
            assert pos not in got  # each image handed over exactly once
            got[pos] = (item, err)
        if len(got) == len(indices) - len(cold):
            every.set()

    cold = list(reader.start_reads(indices, (), done))
    if len(cold) < len(indices):
        await asyncio.wait_for(every.wait(), 30)
    await asyncio.sleep(0.05)  # nothing more comes
    return cold, got, calls[0]


@pytest.mark.parametrize("kind", ["confined", "cached-local-disk", "cached-whole-files", "local"])
def test_a_group_of_images_is_one_storage_call_and_fails_each_image_as_the_awaited_read_does(
    tmp_path: Path, kind: str
) -> None:
    reader, _ = _broken_folder(tmp_path, kind, 8)
    order = [7, 4, 0, 3, 6, 1, 5, 2]
    calls = {"submit_files": 0}
    submit = reader.store.submit_files

    def counted(*args: Any) -> bool:
        calls["submit_files"] += 1
        return submit(*args)

    reader.store.submit_files = counted  # type: ignore[method-assign]
    reads = reader.store.stats.reads

    async def go() -> tuple[list[int], dict[int, tuple[Any, Any]], int, int, list[tuple[Any, Any]]]:
        cold, got, handed = await _by_group(reader, order)
        grouped = reader.store.stats.reads - reads
        return cold, got, handed, grouped, [await _awaited(reader, i) for i in order]

    cold, got, handed, grouped, want = asyncio.run(go())
    assert reader.reads_in_groups
    if not CALLBACKS:
        assert cold == list(range(8)) and got == {}
        return
    assert cold == [] and calls["submit_files"] == 1 and 1 <= handed <= 8
    assert grouped == 8  # one storage read per image of the group
    for pos, (want_item, want_err) in enumerate(want):
        item, err = got[pos]
        assert item == want_item, pos
        assert (type(err), str(err)) == (type(want_err), str(want_err)), pos
    assert [type(got[order.index(i)][1]).__name__ for i in range(5)] == (
        ["NoneType", "SampleError", "SampleError", "SampleError"] + (["NoneType"] if kind == "local" else ["ConfinementError"]))
    reader.store.close()


def test_an_image_folder_epoch_is_read_in_groups_and_the_next_from_memory_in_groups(
    tmp_path: Path, serve_inprocess
) -> None:
    """Cold, a FUSE mount's images go in groups (one storage call each) and each is kept; the
    next epoch's cached names are looked up again (which file they lead to now), a group by
    one call, and served from memory, not one read at the daemon; every image exactly once."""
    if not CALLBACKS:
        pytest.skip("the native read pool is off (CROUPIER_READ_POOL=python)")
    if _REASON is not None:
        pytest.skip(f"latencyfs unusable here: {_REASON}")
    src = tmp_path / "src"
    files = write_imagefolder(src, 96)
    with latencyfs.mounted(src, median_ms=1, distribution="fixed", max_background=latencyfs.KERNEL_DEFAULT) as fs:
        srv = serve_inprocess(datasets=[f"imgs={fs.path}"], cache_memory="64M")
        [reader] = srv.running.catalog.readers()
        groups, singles = [0], [0]
        submit_files, start_read = reader.store.submit_files, reader.start_read

        def counted_files(*args: Any) -> bool:
            started = submit_files(*args)
            groups[0] += started
            return started

        def counted_single(*args: Any) -> bool:
            singles[0] += 1
            return start_read(*args)

        reader.store.submit_files = counted_files  # type: ignore[method-assign]
        reader.start_read = counted_single  # type: ignore[method-assign]
        cache = srv.running.catalog.cache
        image_epoch(srv.address, "imgs", 0, len(files))
        assert (cache.stats.misses, cache.stats.hits, singles[0]) == (len(files), 0, 0)
        assert 1 <= groups[0] < len(files) // 2  # groups of several images, not one call each
        cold_groups = groups[0]
        daemon = fs.stats()
        image_epoch(srv.address, "imgs", 1, len(files))
        after = fs.stats()
        assert (cache.stats.misses, cache.stats.hits) == (len(files), len(files))
        assert (after["requests"], after["opens"]) == (daemon["requests"], daemon["opens"])  # not one read at the daemon
        assert singles[0] == 0 and cold_groups < groups[0] < cold_groups + len(files) // 2  # the lookups in groups too


# ---- the cache tier: counted and keyed as the awaited path -------------------------------------


class _CountedVersions(ConfinedStore):
    """The real confined store, counting the lookups of which file a name leads to (both ways)."""

    lookups = 0

    async def version(self, path: str):
        self.lookups += 1
        return await super().version(path)

    def submit_version(self, path: str, callback) -> bool:
        self.lookups += 1
        return super().submit_version(path, callback)

    def submit_versions(self, paths, callback) -> bool:
        self.lookups += len(paths)
        return super().submit_versions(paths, callback)


async def _submit_whole(store: CachedStore, path: str) -> bytes | Exception:
    landed: asyncio.Future[bytes | Exception] = asyncio.get_running_loop().create_future()
    if not store.submit_whole(path, lambda data, err: landed.set_result(data if err is None else err)):
        try:
            return await store.read(path, 0, -1)
        except Exception as exc:
            return exc
    return await landed


async def _submit_files(store: CachedStore, paths: list[str]) -> list[bytes | Exception]:
    """The files as one group (`submit_files`): each one's bytes or error, by position."""
    got: dict[int, bytes | Exception] = {}
    every = asyncio.Event()

    def done(results: list) -> None:
        for pos, data, err in results:
            assert pos not in got  # each file handed over exactly once
            got[pos] = data if err is None else err
        if len(got) == len(paths):
            every.set()

    assert store.submit_files(paths, False, done)
    await asyncio.wait_for(every.wait(), 30)
    return [got[i] for i in range(len(paths))]


def _swaps(tmp_path: Path, by_callback: bool | str, memory: int) -> dict[str, Any]:
    """Two passes over 20 files of a cached dataset, names swapped between them (one file
    rewritten, one name now a link to another file of the dataset, one a link out of the
    roots), read by callback, awaited, or (by_callback "group") all 20 as one group,
    `memory` bytes of cache: what each pass returned and what was counted."""
    inside, outside = tmp_path / "in", tmp_path / "out"
    inside.mkdir(parents=True), outside.mkdir()
    data = [random.Random(i).randbytes(3000 + i) for i in range(20)]
    for i, body in enumerate(data):
        (inside / f"f{i:03d}.bin").write_bytes(body)
    (outside / "secret.bin").write_bytes(b"s" * 3000)
    cache = BlockCache(CacheSizes(memory_bytes=memory, fill="never"))
    inner = _CountedVersions(LocalStore(io_threads=4), [str(inside)])
    store = CachedStore(inner, cache, "t")
    awaited = [0]
    read = store.read

    async def counted_read(*args: Any) -> bytes:
        awaited[0] += 1
        return await read(*args)

    store.read = counted_read  # type: ignore[method-assign]

    async def one(path: str) -> bytes | str:
        if by_callback:
            got = await _submit_whole(store, path)
        else:
            try:
                got = await store.read(path, 0, -1)
            except Exception as exc:
                got = exc
        return got if isinstance(got, bytes) else f"{type(got).__name__}: {got}".replace(str(tmp_path), "<dir>")

    def read_all() -> list[bytes | str]:
        async def go() -> list[bytes | str]:  # one at a time: what is kept does not hang on which lands first
            return [await one(str(inside / f"f{i:03d}.bin")) for i in range(20)]

        async def group() -> list[bytes | str]:
            got = await _submit_files(store, [str(inside / f"f{i:03d}.bin") for i in range(20)])
            return [g if isinstance(g, bytes) else f"{type(g).__name__}: {g}".replace(str(tmp_path), "<dir>") for g in got]
        return asyncio.run(group() if by_callback == "group" else go())

    out: dict[str, Any] = {"cold": read_all(), "after cold": (inner.lookups, inner.stats.reads, cache.memory.resident)}
    (inside / "f000.bin").write_bytes(b"new" * 1500)
    (inside / "f001.bin").unlink()
    (inside / "f001.bin").symlink_to(inside / "f002.bin")
    (inside / "f003.bin").unlink()
    (inside / "f003.bin").symlink_to(outside / "secret.bin")
    out["warm"] = read_all()
    out["counts"] = (inner.lookups, inner.stats.reads, inner.stats.errors, cache.stats.hits, cache.stats.misses,
                     cache.stats.hit_bytes, cache.stats.miss_bytes, cache.memory.resident)
    out["awaited"] = awaited[0]
    out["data"] = data
    store.close()
    cache.close()
    return out


@pytest.mark.skipif(not CALLBACKS, reason="the callback path needs the native read pool")
@pytest.mark.parametrize("memory", [1 << 20, 10 * 3010], ids=["room for all", "room for 10 files"])
def test_by_callback_a_cached_name_is_served_only_while_it_names_the_same_file_and_counted_as_the_awaited_read(
    tmp_path: Path, memory: int
) -> None:
    mine, theirs = _swaps(tmp_path / "callback", True, memory), _swaps(tmp_path / "awaited", False, memory)
    data = mine.pop("data")
    theirs.pop("data")
    assert (mine.pop("awaited"), theirs.pop("awaited")) == (0, 40)
    assert mine == theirs  # the same bytes, errors, lookups, reads, hits, misses and residency
    assert mine["cold"] == data
    warm = mine["warm"]
    assert warm[0] == b"new" * 1500 and warm[1] == data[2] and "outside the dataset's roots" in warm[3]
    assert warm[4:] == data[4:] and warm[2] == data[2]
    if memory == 1 << 20:
        assert mine["after cold"] == (0, 20, sum(map(len, data)))  # cold: not one lookup
        # each cached name looked up once; f001 now names f002 (a hit); f000 read again, f003 refused
        assert mine["counts"][:5] == (20, 22, 1, 16 + 2, 20 + 1)
    else:  # all of a file or none: the first 9 or 10 files kept whole, the rest read again
        assert mine["after cold"][2] <= memory and mine["after cold"][2] in (sum(map(len, data[:k])) for k in (9, 10))
        assert mine["counts"][1] > 22


@pytest.mark.skipif(not CALLBACKS, reason="the group path needs the native read pool")
@pytest.mark.parametrize("memory", [1 << 20, 10 * 3010], ids=["room for all", "room for 10 files"])
def test_a_group_serves_a_cached_name_only_while_it_names_the_same_file_and_counts_as_the_awaited_read(
    tmp_path: Path, memory: int
) -> None:
    """The same swaps, each pass one group of 20: cold, one storage call reads them all; warm,
    one call asks which file each name leads to now, the same files come from memory and the
    rest are read again, with the awaited read's bytes, errors and counts."""
    mine, theirs = _swaps(tmp_path / "group", "group", memory), _swaps(tmp_path / "awaited", False, memory)
    data = mine.pop("data")
    theirs.pop("data")
    assert (mine.pop("awaited"), theirs.pop("awaited")) == (0, 40)
    assert (mine["cold"], mine["warm"]) == (theirs["cold"], theirs["warm"])
    assert mine["cold"] == data
    if memory == 1 << 20:
        assert mine == theirs  # lookups, reads, errors, hits, misses and residency too
        assert mine["counts"][:5] == (20, 22, 1, 16 + 2, 20 + 1)
    else:  # read at once, which 9 or 10 files were kept whole hangs on which landed first
        assert mine["after cold"][:2] == (0, 20) and mine["after cold"][2] <= memory
        assert mine["counts"][-1] <= memory


def test_the_readers_paths_and_names_are_the_stores_own(tmp_path: Path) -> None:
    # start_read joins by concatenation where the store's join and url agree with it (a local
    # file system, however many stores forward to it): the same paths and names, key for key.
    write_imagefolder(tmp_path / "imgs", 4, classes=("a", "b"))
    for root in (str(tmp_path / "imgs"), str(tmp_path / "imgs") + "/"):
        store = ConfinedStore(LocalStore(io_threads=2), [str(tmp_path)])
        try:
            reader = ImageFolderReader("d", root, store=store)
            assert reader._prefix is not None and reader._url_base == ""
            for key in reader.keys:
                path = store.join(root, key)
                assert reader._path(key) == path and reader._where(path) == store.url(path)
        finally:
            store.close()
    # a bucket's: "imgs/" + key, named "s3://bucket/" + that
    bucket = ObjectStore("b", options={"endpoint": "http://127.0.0.1:9", "access_key_id": "k", "secret_access_key": "s"})
    for root in ("imgs", "imgs/", "/imgs", ""):
        prefix, base = _concatenated(bucket, root)
        assert prefix is not None and base == "s3://b/"
        for key in ("a/0.png", "b c/1.jpg", "x/y/z.webp"):
            assert prefix + key == bucket.join(root, key) and base + prefix + key == bucket.url(bucket.join(root, key))
