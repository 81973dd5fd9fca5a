"""The cache tier for files read whole (ImageFolder images): cached whole at their first
read or by a fill in listing order, keyed by real path, size and mtime. Real components:
latencyfs FUSE mounts and their daemon's counters, real files and links, an in-process
gRPC server end to end: a second epoch makes not one read at the daemon; the fill runs on
FUSE and not on a local disk; reads racing the fill get every file's bytes; the budget
holds, all of a file or none; a link out of the dataset's roots is never cached."""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path

import pytest

from croupier.bench import latencyfs
from croupier.server.cache import BlockCache, CacheSizes, CachedStore
from croupier.server.storage.confined import ConfinedStore
from croupier.server.storage.local import LocalStore
from cache_epochs import image_epoch
from readers_data import write_imagefolder

_REASON = latencyfs.check_available()
needs_fuse = pytest.mark.skipif(_REASON is not None, reason=f"latencyfs unusable here: {_REASON}")


@needs_fuse
def test_a_second_epoch_of_an_image_folder_on_fuse_makes_no_read_at_the_daemon(
    tmp_path: Path, serve_inprocess, caplog
) -> None:
    src = tmp_path / "src"
    files = write_imagefolder(src, 100, ("cat", "dog", "eel"))
    total = sum((src / rel).stat().st_size for rel, _ in files)
    with latencyfs.mounted(src, median_ms=2, distribution="fixed", max_background=latencyfs.KERNEL_DEFAULT) as fs:
        with caplog.at_level(logging.INFO, logger="croupier.server.cache"):
            srv = serve_inprocess(datasets=[f"imgs={fs.path}"], cache_memory="64M")
            [reader] = srv.running.catalog.readers()
            store = reader.store
            assert isinstance(store, CachedStore)
            image_epoch(srv.address, "imgs", 0, len(files))  # cold: each image read once, and kept
            assert store.fill_done(60)
        # no fill ahead by default: each image was kept by the epoch's own read of it
        assert any(f"no whole-file fill of dataset {fs.path}:" in r.getMessage() for r in caplog.records)
        cache = srv.running.catalog.cache
        assert cache.memory.resident == total  # every image, whole
        daemon = fs.stats()
        hits = cache.stats.hits
        image_epoch(srv.address, "imgs", 1, len(files))
        image_epoch(srv.address, "imgs", 2, len(files))
        after = fs.stats()
        assert (after["requests"], after["opens"]) == (daemon["requests"], daemon["opens"])  # not one read, not one open
        assert cache.stats.hits == hits + 2 * len(files)


def test_files_on_a_local_disk_are_not_cached_their_reads_go_straight_to_the_store(tmp_path: Path, caplog) -> None:
    data = {f"f{i:03d}.bin": random.Random(i).randbytes(3000) for i in range(40)}
    for name, body in data.items():
        (tmp_path / name).write_bytes(body)
    cache = BlockCache(CacheSizes(memory_bytes=1 << 20, fill="auto"))
    store = CachedStore(ConfinedStore(LocalStore(io_threads=4), [str(tmp_path)]), cache, "t")
    paths = [str(tmp_path / n) for n in data]

    async def go() -> list[bytes]:
        return [await store.read(p, 0, -1) for p in paths[:5]]

    with caplog.at_level(logging.INFO, logger="croupier.server.cache"):
        store.plan_whole_files(paths)
        reads = store.stats.reads
        assert asyncio.run(go()) == list(data.values())[:5]
        assert store.fill_done(60)
    assert any("files of dataset t not cached" in r.getMessage() and "a local file system" in r.getMessage()
               for r in caplog.records)
    assert store.stats.reads == reads + 5  # each read the store's own
    assert cache.memory.resident == 0 and (cache.stats.hits, cache.stats.misses) == (0, 0)  # the cache never saw them
    store.close()
    cache.close()

    forced = BlockCache(CacheSizes(memory_bytes=1 << 20, fill="always"))  # --cache-fill always: cached anyway
    store = CachedStore(ConfinedStore(LocalStore(io_threads=4), [str(tmp_path)]), forced, "t")
    store.plan_whole_files(paths)

    async def go_and_fill() -> list[bytes]:  # the fill runs on this loop: wait for it before it closes
        got = await go()
        assert await asyncio.to_thread(store.fill_done, 60)
        return got

    assert asyncio.run(go_and_fill()) == list(data.values())[:5]
    assert forced.memory.resident == 40 * 3000  # the fill read them all
    store.close()
    forced.close()


@needs_fuse
def test_reads_racing_the_fill_get_every_files_bytes_and_later_ones_never_reach_the_daemon(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    data = {f"f{i:03d}.bin": random.Random(i).randbytes(random.Random(-i).randrange(1, 300_000)) for i in range(120)}
    for name, body in data.items():
        (src / name).write_bytes(body)
    cache = BlockCache(CacheSizes(memory_bytes=64 << 20, fill="always"))  # --cache-fill always: a fill to race
    with latencyfs.mounted(src, median_ms=2, distribution="fixed", max_background=latencyfs.KERNEL_DEFAULT) as fs:
        store = CachedStore(ConfinedStore(LocalStore(io_threads=16), [str(fs.path)]), cache, "t")
        paths = [str(fs.path / n) for n in data]
        store.plan_whole_files(paths)
        order = random.Random(7).sample(paths, len(paths)) * 2  # every file twice, shuffled

        async def epoch() -> list[bytes]:
            return list(await asyncio.gather(*(store.read(p, 0, -1) for p in order)))

        async def go() -> None:
            got = await epoch()  # the first read starts the fill: the rest race it
            assert got == [data[p.rsplit("/", 1)[-1]] for p in order]
            assert await asyncio.to_thread(store.fill_done, 60)
            assert cache.memory.resident == sum(map(len, data.values()))
            requests = fs.stats()["requests"]
            assert await epoch() == got
            assert fs.stats()["requests"] == requests
            assert cache.stats.hits + cache.stats.misses == 4 * len(paths)  # the fill's reads are not lookups

        asyncio.run(go())
        store.close()
    cache.close()


def test_the_budget_holds_all_of_a_file_or_none_and_the_rest_is_read_from_storage(tmp_path: Path) -> None:
    data = {f"f{i:03d}.bin": random.Random(i).randbytes(5000) for i in range(30)}
    for name, body in data.items():
        (tmp_path / name).write_bytes(body)
    cache = BlockCache(CacheSizes(memory_bytes=10 * 5000 + 4999, fill="never"))  # room for 10 files, not 11
    store = CachedStore(ConfinedStore(LocalStore(io_threads=4), [str(tmp_path)]), cache, "t")
    paths = [str(tmp_path / n) for n in data]

    async def epoch() -> list[bytes]:
        return list(await asyncio.gather(*(store.read(p, 0, -1) for p in paths)))

    assert asyncio.run(epoch()) == list(data.values())
    assert cache.memory.resident == 10 * 5000 and store.stats.reads == 30
    assert asyncio.run(epoch()) == list(data.values())
    assert (cache.stats.hits, cache.stats.misses, store.stats.reads) == (10, 50, 50)
    store.close()
    assert cache.memory.resident == 0  # the dataset closed: its files left memory
    cache.close()


def test_a_link_out_of_the_roots_is_refused_and_nothing_of_it_is_cached(tmp_path: Path) -> None:
    inside, outside = tmp_path / "in", tmp_path / "out"
    inside.mkdir(), outside.mkdir()
    (outside / "secret.bin").write_bytes(b"s" * 4000)
    (inside / "link.bin").symlink_to(outside / "secret.bin")
    (inside / "ok.bin").write_bytes(b"k" * 4000)
    cache = BlockCache(CacheSizes(memory_bytes=1 << 20, fill="never"))
    store = CachedStore(ConfinedStore(LocalStore(io_threads=4), [str(inside)]), cache, "t")

    async def go() -> None:
        assert await store.read(str(inside / "ok.bin"), 0, -1) == b"k" * 4000
        with pytest.raises(Exception, match="outside the dataset's roots"):
            await store.read(str(inside / "link.bin"), 0, -1)

    asyncio.run(go())
    assert cache.memory.resident == 4000  # ok.bin only
    store.close()
    cache.close()


class _CountedVersions(ConfinedStore):
    """The real confined store, counting the lookups of which file a name leads to."""

    lookups = 0

    async def version(self, path: str):
        self.lookups += 1
        return await super().version(path)


def test_a_cold_read_looks_nothing_up_and_a_cached_name_is_served_only_while_it_names_the_same_file(
    tmp_path: Path, caplog
) -> None:
    inside, outside = tmp_path / "in", tmp_path / "out"
    inside.mkdir(), outside.mkdir()
    data = {f"f{i:03d}.bin": random.Random(i).randbytes(3000 + i) for i in range(20)}
    for name, body in data.items():
        (inside / name).write_bytes(body)
    (outside / "secret.bin").write_bytes(b"s" * 3000)
    cache = BlockCache(CacheSizes(memory_bytes=1 << 20, fill="never"))
    inner = _CountedVersions(LocalStore(io_threads=4), [str(inside)])
    store = CachedStore(inner, cache, "t")
    paths = [str(inside / n) for n in data]

    async def read_all() -> list[bytes | Exception]:
        return list(await asyncio.gather(*(store.read(p, 0, -1) for p in paths), return_exceptions=True))

    # cold: one read each, its key from that read itself; not one lookup more
    assert asyncio.run(read_all()) == list(data.values())
    assert (inner.lookups, inner.stats.reads, cache.memory.resident) == (0, 20, sum(map(len, data.values())))

    (inside / "f000.bin").write_bytes(b"new" * 1500)  # rewritten: another size and mtime
    (inside / "f001.bin").unlink()
    (inside / "f001.bin").symlink_to(inside / "f002.bin")  # now names another file of the dataset
    (inside / "f003.bin").unlink()
    (inside / "f003.bin").symlink_to(outside / "secret.bin")  # now names a file outside the roots
    with caplog.at_level(logging.INFO, logger="croupier.server.cache"):
        got = asyncio.run(read_all())
    assert got[0] == b"new" * 1500 and got[1] == data["f002.bin"]
    assert isinstance(got[3], Exception) and "outside the dataset's roots" in str(got[3])
    assert [g for i, g in enumerate(got) if i not in (0, 1, 3)] == [b for i, b in enumerate(data.values()) if i not in (0, 1, 3)]
    assert inner.lookups == 20  # each cached name checked once against the file it names now
    # f001 now names f002, whose bytes are cached: a hit; f000 read again; f003's read refused
    assert (cache.stats.hits, cache.stats.misses) == (16 + 2, 20 + 1)
    assert any("f000.bin changed" in r.getMessage() for r in caplog.records)
    store.close()
    cache.close()


@pytest.mark.parametrize("client", ["rclone", "s3fs"])
def test_images_on_a_bucket_mount_are_served_from_the_cache_without_asking_the_bucket_again(
    tmp_path: Path, client: str, caplog
) -> None:
    # On a FUSE mount of an object store, asking which file a cached name leads to now goes to
    # the FUSE client each time (through s3fs a second epoch of 6,000 JPEGs all served from
    # memory made 144 images/s: bench/results/peers-cache-mounts.md): there the version its
    # first read found is kept, as an s3:// dataset trusts its listing at open.
    from croupier.bench import bucket_mount, s3server

    class Counted(ConfinedStore):  # the real store; its lookups counted
        lookups = 0

        def submit_version(self, path, callback):
            Counted.lookups += 1
            return super().submit_version(path, callback)

        async def version(self, path):
            Counted.lookups += 1
            return await super().version(path)

    mounted, unusable = bucket_mount.CLIENTS[client]
    if unusable() is not None:
        pytest.skip(f"no {client} mount here: {unusable()}")
    data = {f"f{i:03d}.bin": random.Random(i).randbytes(3000 + i) for i in range(40)}
    cache = BlockCache(CacheSizes(memory_bytes=16 << 20, fill="auto"))
    with s3server.running(None, latency=2) as s3:
        s3.create_bucket("data")
        for name, body in data.items():
            s3.put("data", f"imgs/{name}", body)
        with mounted(s3.endpoint, "data") as mnt:
            root = str(mnt / "imgs")
            store = CachedStore(Counted(LocalStore(io_threads=8), [root]), cache, "t")
            paths = [f"{root}/{n}" for n in data]
            with caplog.at_level(logging.INFO, logger="croupier.server.cache"):
                store.plan_whole_files(paths)
            assert store.whole is not None and store.whole.trust_first_read
            assert any(f"lies on a {client} mount of an object store" in r.getMessage() for r in caplog.records)

            async def epoch() -> list[bytes]:
                return list(await asyncio.gather(*(store.read(p, 0, -1) for p in paths)))

            assert asyncio.run(epoch()) == list(data.values())  # cold: each read once, and kept
            s3.reset_stats()
            assert asyncio.run(epoch()) == list(data.values())
            assert s3.stats()["requests"] == 0  # not a HEAD, not a GET: every image from memory
            assert cache.stats.hits == len(data) and Counted.lookups == 0  # and not one lookup on the mount
            store.close()
    cache.close()
