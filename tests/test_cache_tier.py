"""The server's cache tier (server/cache): exact hit and miss counts, a second epoch that
reads nothing from storage, crashes mid-write, changed files, the disk bound, a full disk,
and cache and direct reads racing for one block. Real files, a real tmpfs for the full
disk, latencyfs FUSE mounts and an in-process gRPC server where the mount matters."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from croupier.bench import latencyfs
from croupier.client import Loader, RetryPolicy
from croupier.server.cache import BlockCache, CacheSizes, CachedStore
from croupier.server.cache.blocks import BLOCK_BYTES
from croupier.server.cache.disk_tier import DiskTier
from croupier.server.storage.confined import ConfinedStore
from croupier.server.storage.local import LocalStore

from stores import WrappedStore

_REASON = latencyfs.check_available()
needs_fuse = pytest.mark.skipif(_REASON is not None, reason=f"latencyfs unusable here: {_REASON}")


def _data(path: Path, blocks: float, seed: int = 1) -> bytes:
    data = random.Random(seed).randbytes(int(blocks * BLOCK_BYTES))
    path.write_bytes(data)
    return data


def _store(root: Path, cache: BlockCache) -> CachedStore:
    return CachedStore(ConfinedStore(LocalStore(io_threads=16), [str(root)]), cache, "t")


def test_hits_and_misses_are_counted_exactly_and_a_hit_never_reaches_storage(tmp_path: Path) -> None:
    data = _data(tmp_path / "f.bin", 3)
    cache = BlockCache(CacheSizes(memory_bytes=2 * BLOCK_BYTES, fill="never"))
    store = _store(tmp_path, cache)
    path = str(tmp_path / "f.bin")
    store.pin(path)

    async def go() -> None:
        whole = await store.read(path, 0, 2 * BLOCK_BYTES)  # a direct read of two whole blocks: admitted
        assert whole == data[: 2 * BLOCK_BYTES]
        assert (cache.stats.hits, cache.stats.misses, store.stats.reads) == (0, 1, 1)
        ranges = [(10, 100), (BLOCK_BYTES - 50, 100), (BLOCK_BYTES + 7, 1000)]  # one straddles blocks 0 and 1
        parts = await store.read_ranges(path, ranges)
        assert parts == [data[o:o + s] for o, s in ranges]
        assert (cache.stats.hits, cache.stats.misses, store.stats.reads) == (3, 1, 1)  # storage untouched
        # block 2 did not fit the budget: read from storage, one range each
        parts = await store.read_ranges(path, [(2 * BLOCK_BYTES + 5, 10), (20, 30)])
        assert parts == [data[2 * BLOCK_BYTES + 5:2 * BLOCK_BYTES + 15], data[20:50]]
        assert (cache.stats.hits, cache.stats.misses, store.stats.reads) == (4, 2, 2)
        landed: asyncio.Future = asyncio.get_running_loop().create_future()
        assert store.submit_ranges(path, [(0, 8), (BLOCK_BYTES, 8)], lambda p, e: landed.set_result((p, e)))
        assert await landed == ([data[:8], data[BLOCK_BYTES:BLOCK_BYTES + 8]], None)
        assert (cache.stats.hits, cache.stats.misses, store.stats.reads) == (6, 2, 2)

    asyncio.run(go())
    assert cache.memory.resident == 2 * BLOCK_BYTES and cache.stats.hit_ratio == 6 / 8
    store.unpin(path)  # the last dataset reading the file closed: its blocks leave memory
    assert cache.memory.resident == 0 and cache.memory.evictions == 2
    store.close()
    cache.close()


def test_the_cache_serves_only_files_the_datasets_confined_store_opened(tmp_path: Path) -> None:
    inside, outside = tmp_path / "in", tmp_path / "out"
    inside.mkdir(), outside.mkdir()
    _data(outside / "secret.bin", 1, seed=2)
    (inside / "link.bin").symlink_to(outside / "secret.bin")
    cache = BlockCache(CacheSizes(memory_bytes=4 * BLOCK_BYTES, fill="never"))
    store = _store(inside, cache)
    with pytest.raises(Exception, match="outside the dataset's roots"):
        store.pin(str(inside / "link.bin"))
    assert store.key_of(str(inside / "link.bin")) is None and cache.in_use() == set()
    store.close()
    cache.close()


def _table(path: Path, rows: int, row_bytes: int = 1000) -> pa.Table:
    table = pa.table({"id": np.arange(rows, dtype=np.int64),
                      "text": [f"{i:08d}" + "x" * (row_bytes - 8) for i in range(rows)]})
    with pa.ipc.new_file(str(path), table.schema) as w:
        w.write_table(table, max_chunksize=500)
    return table


def _epoch(address: str, epoch: int) -> dict[int, str]:
    loader = Loader("t", servers=address, batch_size=64, seed=3, retry=RetryPolicy(max_retries=0), format="numpy")
    loader.set_epoch(epoch)
    got: dict[int, str] = {}
    for batch in loader:
        for i, text in zip(batch["id"].tolist(), batch["text"]):
            assert i not in got, f"sample {i} delivered twice"
            got[i] = str(text)
    return got


@needs_fuse
def test_a_second_epoch_of_a_dataset_that_fits_reads_nothing_from_storage(tmp_path: Path, serve_inprocess) -> None:
    src = tmp_path / "src"
    src.mkdir()
    table = _table(src / "t.arrow", 6000)  # about 6 MB: fits the 64 MiB budget
    want = dict(zip(table["id"].to_pylist(), table["text"].to_pylist()))
    with latencyfs.mounted(src, median_ms=2, distribution="fixed", max_background=latencyfs.KERNEL_DEFAULT) as fs:
        # cache_fill="always": the rule's timing (a 1 MiB read against 16 small ones) is not what
        # this test is about, and a loaded machine can make the first block slow enough to lose.
        srv = serve_inprocess(datasets=[f"t={fs.path / 't.arrow'}"], cache_memory="64M", cache_fill="always",
                              metrics_port=0)
        [reader] = srv.running.catalog.readers()
        store = reader.store
        assert isinstance(store, CachedStore)
        assert _epoch(srv.address, 0) == want  # cold: the fill runs beside direct reads
        assert store.fill_done(60)
        cache = srv.running.catalog.cache
        assert cache.memory.resident == os.path.getsize(src / "t.arrow")
        before, requests = store.stats.reads, fs.stats()["requests"]
        hits, misses = cache.stats.hits, cache.stats.misses
        assert _epoch(srv.address, 1) == want and _epoch(srv.address, 2) == want
        assert store.stats.reads == before and fs.stats()["requests"] == requests  # not one read of storage
        assert cache.stats.misses == misses and cache.stats.hits >= hits + 2 * 6000  # every row's value bytes, a hit
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{srv.running.metrics_port}/metrics").read().decode()
        metric = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("croupier_cache_")}
        assert metric['croupier_cache_lookups_total{result="hit"}'] == cache.stats.hits
        assert metric['croupier_cache_lookups_total{result="miss"}'] == misses
        assert metric['croupier_cache_resident_bytes{tier="memory"}'] == os.path.getsize(src / "t.arrow")
        # 3 epochs of 6,000 samples; the storage served the file about once (fill and cold reads)
        assert 0 < metric["croupier_cache_storage_bytes_per_sample"] < 2 * os.path.getsize(src / "t.arrow") / 18000
        assert metric["croupier_cache_hit_ratio"] == cache.stats.hits / (cache.stats.hits + misses)
        assert metric["croupier_cache_hit_ratio"] > 2 / 3  # epochs 2 and 3 all hits
        # every block admitted once (the fill's, or a cold read's that fetched whole blocks), none dropped
        assert metric['croupier_cache_fill_bytes_total{tier="memory"}'] == os.path.getsize(src / "t.arrow")
        assert metric['croupier_cache_evictions_total{tier="memory"}'] == 0


def test_partial_files_from_a_crash_are_ignored_and_a_bad_block_is_dropped_and_read_again(tmp_path: Path, caplog) -> None:
    folder = tmp_path / "blocks"
    tier = DiskTier(str(folder), 8 * BLOCK_BYTES)
    block = random.Random(4).randbytes(BLOCK_BYTES)
    assert tier.put(("p" * 24, "v" * 24, 0), block) and tier.put(("p" * 24, "v" * 24, 1), block)
    sub = next(folder.iterdir())
    (sub / f"{'p' * 24}-{'v' * 24}-2.blk.tmp.123.456").write_bytes(block[:1000])  # a write cut by a crash
    bad = sub / f"{'p' * 24}-{'v' * 24}-1.blk"
    raw = bytearray(bad.read_bytes())
    raw[-1] ^= 0xFF  # a flipped bit
    bad.write_bytes(bytes(raw))
    with caplog.at_level(logging.INFO, logger="croupier.server.cache"):
        again = DiskTier(str(folder), 8 * BLOCK_BYTES)
        assert again.partial_removed == 1 and not list(sub.glob("*.tmp*"))
        assert not again.has(("p" * 24, "v" * 24, 2))
        assert again.get(("p" * 24, "v" * 24, 0)) == block
        assert again.get(("p" * 24, "v" * 24, 1)) is None and again.corrupt == 1 and not bad.exists()
        assert again.get(("p" * 24, "v" * 24, 1)) is None and again.corrupt == 1  # gone, not checked again
    assert [r.levelname for r in caplog.records if "checksum" in r.getMessage()] == ["WARNING"]


def test_a_fill_killed_mid_write_leaves_nothing_the_next_start_serves(tmp_path: Path) -> None:
    """A real process filling the disk tier is SIGKILLed while it writes; the next start
    serves only whole, checked blocks (each equal to the file's bytes)."""
    data = _data(tmp_path / "f.bin", 24, seed=5)
    folder = tmp_path / "cache"
    script = f"""
import asyncio, os, signal, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from croupier.server.cache import BlockCache, CacheSizes, CachedStore
from croupier.server.cache import disk_tier
from croupier.server.storage.local import LocalStore
calls = 0
real_put = disk_tier.DiskTier.put
def put(self, bid, data):
    global calls
    calls += 1
    if calls == 6:  # mid-way through the sixth block's file: killed with its temp file open
        path = self._path(bid)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{{path}}.tmp.{{os.getpid()}}.1", "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    return real_put(self, bid, data)
disk_tier.DiskTier.put = put
cache = BlockCache(CacheSizes(memory_bytes=0, disk_dir={str(folder)!r}, disk_bytes=1 << 30, fill="always"))
store = CachedStore(LocalStore(io_threads=4), cache, "t")
store.pin({str(tmp_path / 'f.bin')!r})
asyncio.run(store.read({str(tmp_path / 'f.bin')!r}, 0, 10))
store.fill_done(60)
"""
    proc = subprocess.run(["python", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert list(folder.rglob("*.tmp*")), "the kill left no partial file: the test did not cut a write"
    cache = BlockCache(CacheSizes(memory_bytes=0, disk_dir=str(folder), disk_bytes=1 << 30, fill="never"))
    assert cache.disk is not None and cache.disk.partial_removed >= 1 and not list(folder.rglob("*.tmp*"))
    store = CachedStore(LocalStore(io_threads=4), cache, "t")
    path = str(tmp_path / "f.bin")
    store.pin(path)
    key = store.key_of(path)
    on_disk = [b for b in range(key.blocks()) if cache.disk.has((key.path_id, key.version_id, b))]
    assert 1 <= len(on_disk) < 24
    reads = [(b * BLOCK_BYTES + 3, 5000) for b in range(24)]
    assert asyncio.run(store.read_ranges(path, reads)) == [data[o:o + s] for o, s in reads]
    # the whole blocks are served from disk, checked; the rest from storage, one read each
    assert (cache.stats.hits, cache.stats.misses, store.stats.reads) == (len(on_disk), 24 - len(on_disk), 24 - len(on_disk))
    store.close()
    cache.close()


def test_a_changed_file_is_never_served_stale_and_the_log_says_so(tmp_path: Path, caplog) -> None:
    path = tmp_path / "f.bin"
    old = _data(path, 2, seed=6)
    cache = BlockCache(CacheSizes(memory_bytes=8 * BLOCK_BYTES, disk_dir=str(tmp_path / "c"), disk_bytes=8 * BLOCK_BYTES,
                                  fill="always"))
    first = CachedStore(LocalStore(io_threads=4), cache, "t")
    first.pin(str(path))
    assert asyncio.run(first.read(str(path), 0, 4)) == old[:4]
    assert first.fill_done(60) and cache.memory.resident == 2 * BLOCK_BYTES
    new = random.Random(7).randbytes(len(old))
    path.write_bytes(new)
    os.utime(path, ns=(1, 1))  # another mtime, whatever the clock's resolution
    second = CachedStore(LocalStore(io_threads=4), cache, "t")
    with caplog.at_level(logging.INFO, logger="croupier.server.cache"):
        second.pin(str(path))  # a dataset opened on the changed file
    assert any("changed" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)
    assert asyncio.run(second.read_ranges(str(path), [(0, 64), (BLOCK_BYTES + 9, 64)])) == [new[:64], new[BLOCK_BYTES + 9:BLOCK_BYTES + 73]]
    assert cache.stats.misses >= 1 and cache.memory.resident <= 2 * BLOCK_BYTES
    first.close(), second.close()
    cache.close()


def test_the_disk_tier_never_outgrows_its_size(tmp_path: Path) -> None:
    bound = int(2.5 * BLOCK_BYTES)
    data = _data(tmp_path / "f.bin", 6, seed=8)
    cache = BlockCache(CacheSizes(memory_bytes=0, disk_dir=str(tmp_path / "c"), disk_bytes=bound, fill="always"))
    store = CachedStore(LocalStore(io_threads=4), cache, "t")
    path = str(tmp_path / "f.bin")
    store.pin(path)
    asyncio.run(store.read(path, 0, 1))
    assert store.fill_done(60)
    on_disk = sum(p.stat().st_size for p in (tmp_path / "c").rglob("*") if p.is_file())
    assert cache.disk is not None and on_disk == cache.disk.used <= bound and cache.disk.filled == 2 * BLOCK_BYTES
    reads = [(b * BLOCK_BYTES, 100) for b in range(6)]
    assert asyncio.run(store.read_ranges(path, reads)) == [data[o:o + 100] for o, _ in reads]
    store.close()
    cache.close()


def test_a_full_disk_tier_drops_blocks_no_open_dataset_reads_and_a_smaller_bound_trims_it_at_start(tmp_path: Path) -> None:
    # Blocks of a dataset no longer open make room for one that is (a repeated job's files
    # stay until then); a restart with a smaller --cache-size deletes down to it.
    folder, bound = tmp_path / "c", int(3.5 * BLOCK_BYTES)

    def on_disk() -> int:
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())

    def filled(cache: BlockCache, name: str, seed: int) -> tuple[CachedStore, str, bytes]:
        data = _data(tmp_path / name, 3, seed=seed)
        store = CachedStore(LocalStore(io_threads=4), cache, name)
        path = str(tmp_path / name)
        store.pin(path)
        asyncio.run(store.read(path, 0, 1))
        assert store.fill_done(60)
        return store, path, data

    cache = BlockCache(CacheSizes(memory_bytes=0, disk_dir=str(folder), disk_bytes=bound, fill="always"))
    first, _, _ = filled(cache, "a.bin", 1)
    assert cache.disk is not None and cache.disk.filled == 3 * BLOCK_BYTES and cache.disk.evictions == 0
    first.close()  # its blocks stay on disk, read by no open dataset
    second, path, data = filled(cache, "b.bin", 2)
    assert cache.disk.filled == 6 * BLOCK_BYTES and cache.disk.evictions >= 2  # a.bin's made the room
    assert on_disk() == cache.disk.used <= bound
    reads = [(b * BLOCK_BYTES + 7, 100) for b in range(3)]
    before = second.inner.stats.reads
    assert asyncio.run(second.read_ranges(path, reads)) == [data[o:o + 100] for o, _ in reads]
    assert second.inner.stats.reads == before  # b.bin whole on disk: no read of storage
    second.close()
    cache.close()

    smaller = int(1.5 * BLOCK_BYTES)
    again = BlockCache(CacheSizes(memory_bytes=0, disk_dir=str(folder), disk_bytes=smaller, fill="never"))
    assert again.disk is not None and on_disk() == again.disk.used <= smaller and again.disk.used > 0
    again.close()


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_means_direct_reads_and_one_warning_never_a_failed_read(tmp_path: Path, small_tmpfs: Path, caplog) -> None:
    data = _data(tmp_path / "f.bin", 5, seed=9)
    cache = BlockCache(CacheSizes(memory_bytes=0, disk_dir=str(small_tmpfs), disk_bytes=1 << 30, fill="always"))
    store = CachedStore(LocalStore(io_threads=4), cache, "t")
    path = str(tmp_path / "f.bin")
    store.pin(path)
    with caplog.at_level(logging.WARNING, logger="croupier.server.cache"):
        asyncio.run(store.read(path, 0, 1))
        assert store.fill_done(60)
        reads = [(b * BLOCK_BYTES + 11, 4096) for b in range(5)]
        assert asyncio.run(store.read_ranges(path, reads)) == [data[o:o + s] for o, s in reads]
    assert cache.disk is not None and not cache.disk.writing and cache.disk.used <= 1500 * 1024
    assert len([r for r in caplog.records if "cannot write to the disk tier" in r.getMessage()]) == 1
    assert not list(small_tmpfs.rglob("*.tmp*"))
    store.close()
    cache.close()


class GatedLocal(WrappedStore):
    """A LocalStore whose async reads wait for `gate`, pinned as the inner store's."""

    def __init__(self, inner: LocalStore):
        super().__init__(inner)
        self.gate = asyncio.Event()
        self.waiting = 0

    def pin(self, path: str) -> None:
        self.inner.pin(path)

    def unpin(self, path: str) -> None:
        self.inner.unpin(path)

    def pinned_fd(self, path: str) -> int | None:
        return self.inner.pinned_fd(path)

    async def _read_ranges(self, path, ranges):
        self.waiting += len(ranges)
        await self.gate.wait()
        return [self.inner._read_range(path, o, s) for o, s in ranges]


def test_cache_and_direct_reads_racing_for_one_block_deliver_each_read_once_with_its_bytes(tmp_path: Path) -> None:
    data = _data(tmp_path / "f.bin", 2, seed=10)
    cache = BlockCache(CacheSizes(memory_bytes=4 * BLOCK_BYTES, fill="always"))
    gated = GatedLocal(LocalStore(io_threads=4))
    store = CachedStore(gated, cache, "t")
    path = str(tmp_path / "f.bin")
    store.pin(path)
    reads = [(random.Random(i).randrange(2 * BLOCK_BYTES - 1000), 1000) for i in range(200)]

    async def go() -> list[bytes]:
        # The fill starts once every early read has missed and is held at the storage (left
        # to the first read, a fill of two blocks could end before the last early read looks,
        # and that read would hit: seen once in CI, the loop below then never ended).
        start_fill = store._start_fill
        store._start_fill = lambda: None  # type: ignore[method-assign]
        early = [asyncio.ensure_future(store.read_ranges(path, [r])) for r in reads[:100]]
        for _ in range(100_000):
            if gated.waiting == 100:
                break
            await asyncio.sleep(0)
        assert gated.waiting == 100  # every early read is held at the storage
        store._start_fill = start_fill  # type: ignore[method-assign]
        store._start_fill()  # the fill goes on meanwhile
        await asyncio.get_running_loop().run_in_executor(None, store.fill_done, 60)
        assert cache.memory.resident == 2 * BLOCK_BYTES
        late = await asyncio.gather(*(store.read_ranges(path, [r]) for r in reads[100:]))  # from the cache
        assert gated.waiting == 100
        gated.gate.set()
        return [p[0] for p in await asyncio.gather(*early)] + [p[0] for p in late]

    got = asyncio.run(go())
    assert got == [data[o:o + s] for o, s in reads]
    assert (cache.stats.hits, cache.stats.misses) == (100, 100)
    store.close()
    cache.close()


def test_the_fill_rule_weighs_a_blocks_read_against_the_small_reads_it_replaces() -> None:
    from croupier.server.cache.fill import pays

    # Measured on latencyfs at 5 ms: a 1 MiB block in 20 ms against 16 reads of 5.7 ms.
    assert pays(0.020, 0.0057)
    assert not pays(0.100, 0.0057)  # 100 ms > 16 x 5.7 ms: small reads would do better
    assert pays(0.004, 0.005, block_len=32 << 10) and not pays(0.006, 0.005, block_len=32 << 10)  # a short block: one read


def _pinned(fs, blobs: dict[str, bytes], fill: str) -> tuple[CachedStore, list[str]]:
    """A cached store (64 MiB of memory, `fill`) over the mount with every file of `blobs` pinned."""
    store = CachedStore(LocalStore(io_threads=16), BlockCache(CacheSizes(memory_bytes=64 << 20, fill=fill)), "t")
    paths = [str(fs.path / name) for name in blobs]
    for p in paths:
        store.pin(p)
    return store, paths


@needs_fuse
def test_a_fill_reads_each_file_as_sequential_streams_on_descriptors_of_their_own(tmp_path: Path) -> None:
    # A FUSE client of an object store (rclone mount) serves an open file's reads one at a
    # time and answers a read away from the last one's end with a new GET: the fill reads
    # streams, each in order on its own descriptor. latencyfs counts the reads that did not
    # start where their handle's last one ended (seeks); one worker thread serves them in
    # the order the kernel sent them.
    src = tmp_path / "src"
    src.mkdir()
    blobs = {f"part-{i}.arrow": random.Random(i).randbytes(16 * BLOCK_BYTES + 777) for i in range(2)}
    for name, data in blobs.items():
        (src / name).write_bytes(data)
    with latencyfs.mounted(src, median_ms=0, distribution="fixed", max_threads=1,
                           max_background=latencyfs.KERNEL_DEFAULT) as fs:
        store, paths = _pinned(fs, blobs, "always")
        try:
            fs.reset_stats()
            opens_before = fs.stats()["opens"]
            store._start_fill()
            assert store.fill_done(60)
            stats = fs.stats()
            assert all(store.held_in_memory(p) for p in paths)
            for p, data in zip(paths, blobs.values()):
                assert asyncio.run(store.read_ranges(p, [(5, 100), (len(data) - 50, 50)])) == [data[5:105], data[-50:]]
        finally:
            store.close()
    # 2 files of 17 blocks and 4 streams: each file in 2 parts (9 and 8 blocks), one descriptor each
    assert stats["opens"] - opens_before == 4, stats
    # every byte once, but for the kernel's readahead past the end of a file's first part
    assert 0 <= stats["bytes"] - sum(len(d) for d in blobs.values()) <= 2 * BLOCK_BYTES, stats
    # a stream's reads follow one another (the kernel may split and reorder its readahead a
    # little); 4 blocks in flight on one descriptor made a seek of nearly every request
    assert stats["seeks"] <= 4 * 2, (stats["seeks"], stats["requests"])


@needs_fuse
@pytest.mark.parametrize("direct", ["1", "0"])
def test_a_fill_on_a_fuse_mount_reads_each_block_as_one_o_direct_request(tmp_path: Path, monkeypatch, direct: str) -> None:
    # On FUSE a buffered 1 MiB read reaches the daemon as several readahead requests, which
    # the kernel caps per mount (12 background ones by default); the fill's O_DIRECT read of
    # a block is one request of its size, and keeps no page-cache copy beside the cache's.
    # latencyfs counts the requests and their sizes; CROUPIER_FILL_DIRECT=0 is the old way.
    monkeypatch.setenv("CROUPIER_FILL_DIRECT", direct)
    src = tmp_path / "src"
    src.mkdir()
    blobs = {"part-0.arrow": random.Random(3).randbytes(12 * BLOCK_BYTES + 777)}
    (src / "part-0.arrow").write_bytes(blobs["part-0.arrow"])
    with latencyfs.mounted(src, median_ms=0, distribution="fixed", max_background=latencyfs.KERNEL_DEFAULT) as fs:
        store, paths = _pinned(fs, blobs, "always")
        try:
            fs.reset_stats()
            store._start_fill()
            assert store.fill_done(60)
            stats = fs.stats()
            assert store.held_in_memory(paths[0])
            data = blobs["part-0.arrow"]
            assert asyncio.run(store.read_ranges(paths[0], [(0, len(data))])) == [data]
        finally:
            store.close()
    if direct == "1":
        # 13 blocks, 13 requests (a 1 MiB one each, the last 777 bytes): nothing read twice,
        # nothing read ahead
        assert (stats["requests"], stats["bytes"], stats["max_request_bytes"]) == (13, len(data), BLOCK_BYTES), stats
    else:
        assert stats["requests"] > 13 and stats["max_request_bytes"] < BLOCK_BYTES, stats


def test_a_direct_read_the_file_system_refuses_goes_on_buffered(tmp_path: Path) -> None:
    # A file system may open a file O_DIRECT and then refuse a read for its alignment (ext4,
    # xfs: EINVAL): the fill's read takes O_DIRECT off that descriptor and reads it buffered.
    import fcntl

    from croupier.server.cache.fill import _pread, open_for_fill

    path = tmp_path / "f.bin"
    data = random.Random(4).randbytes(3 * 4096 + 100)
    path.write_bytes(data)
    fd = open_for_fill(lambda p: os.open(p, os.O_RDONLY), str(path))
    try:
        if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            pytest.skip(f"{tmp_path}'s file system has no O_DIRECT")
        assert _pread(fd, 4096, 8192) == data[4096:12288]  # aligned: stays direct
        assert _pread(fd, 2 * 4096, 4196) == data[8192:]  # the end of the file: a short read
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        try:
            os.pread(fd, 10, 3)
            pytest.skip(f"{tmp_path}'s file system takes unaligned O_DIRECT reads")
        except OSError:
            pass
        assert _pread(fd, 3, 5000) == data[3:5003]
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
    finally:
        os.close(fd)


@needs_fuse
def test_a_fill_whose_trial_read_the_first_files_only_block_goes_on_to_the_next_file(tmp_path: Path, caplog) -> None:
    # The rule's trial reads a mount's first block; when that was a small file's only block,
    # the fill still goes on to the dataset's other files.
    src = tmp_path / "src"
    src.mkdir()
    blobs = {"a-small.arrow": random.Random(1).randbytes(300_000), "b-large.arrow": random.Random(2).randbytes(3 * BLOCK_BYTES)}
    for name, data in blobs.items():
        (src / name).write_bytes(data)
    with latencyfs.mounted(src, median_ms=2, distribution="fixed") as fs:
        store, paths = _pinned(fs, blobs, "auto")
        try:
            with caplog.at_level(logging.INFO, logger="croupier.server.cache"):
                store._start_fill()
                assert store.fill_done(60)
            assert "a fill on" in caplog.text, caplog.text  # the trial, on the small file's block, paid
            assert "stopped" not in caplog.text, caplog.text
            assert all(store.held_in_memory(p) for p in paths)
        finally:
            store.close()
