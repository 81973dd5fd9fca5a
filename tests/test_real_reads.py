"""Real reads, really in flight: counted at the storage, never timed.

* A stream keeps its whole read budget in flight as real reads on the store, for
  tables and images alike, and the file-system store's I/O pool holds that many
  blocking preads at once, however few CPU workers the server has.
* A row of a large table costs about its own bytes: not its record batch, not the file.
"""

from __future__ import annotations

import asyncio
import os
import concurrent.futures
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from stores import WrappedStore

from croupier.protocol.epoch_plan import EpochPlan
from croupier.server.readers import open_dataset
from croupier.server.stream.dealer import Dealer
from croupier.server.stream.fetch_limits import FetchLimits
from croupier.server.stream.rank_batches import StreamRange
from croupier.server.storage import LocalStore
from croupier.server.storage.base import Range
from readers_data import write_imagefolder


class GatedStore(WrappedStore):
    """A LocalStore whose async reads wait on a gate: counts calls in flight at once."""

    def __init__(self, inner: LocalStore):
        super().__init__(inner)
        self.gate: asyncio.Event | None = None
        self.reached: asyncio.Event | None = None
        self.in_flight = self.max_in_flight = self.target = 0

    def arm(self, target: int) -> None:
        """From now on, reads wait at the gate until `open()`; `reached` fires at `target`."""
        self.gate, self.reached, self.target = asyncio.Event(), asyncio.Event(), target
        self.in_flight = self.max_in_flight = 0

    async def _gated(self, coro):
        if self.gate is None:  # not armed: a plain read
            return await coro
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if self.in_flight >= self.target:
            self.reached.set()
        try:
            await self.gate.wait()
            return await coro
        finally:
            self.in_flight -= 1

    async def _read(self, path: str, offset: int, size: int) -> bytes:
        return await self._gated(self.inner.read(path, offset, size))

    async def _read_ranges(self, path: str, ranges: Sequence[Range]) -> list[bytes]:
        return await self._gated(self.inner.read_ranges(path, ranges))


def _write_text_table(path: Path, rows: int, batch_rows: int, row_bytes: int = 1000) -> pa.Table:
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    text = [rng.choice(letters, row_bytes).tobytes().decode() for _ in range(rows)]
    table = pa.table({"id": np.arange(rows, dtype=np.int64), "text": text})
    with pa.ipc.new_file(str(path), table.schema) as w:
        for b in table.to_batches(max_chunksize=batch_rows):
            w.write_batch(b)
    return table


async def _drain_until_in_flight(dealer: Dealer, store: GatedStore, target: int) -> list[int]:
    """Start the stream, wait until `target` reads sit at the gate, open it, collect all."""
    store.arm(target)
    got: list[int] = []

    async def consume() -> None:
        async for chunk in dealer:
            got.extend(r.index for r in chunk.refs)

    task = asyncio.create_task(consume())
    for _ in range(2000):  # bounded: the stream must reach the target with no read done
        await asyncio.sleep(0.001)
        if store.reached is not None and store.reached.is_set():
            break
    reached = store.max_in_flight
    assert store.gate is not None
    store.gate.set()
    await asyncio.wait_for(task, 60)
    assert reached >= target, f"only {reached} reads were in flight at once, wanted {target}"
    return got


@pytest.mark.parametrize("kind", ["arrow", "imagefolder"])
def test_a_stream_keeps_its_read_budget_in_flight_as_real_store_reads(tmp_path: Path, kind: str) -> None:
    if kind == "arrow":
        _write_text_table(tmp_path / "t.arrow", 2000, batch_rows=50)
        location, n = tmp_path / "t.arrow", 2000
    else:
        write_imagefolder(tmp_path / "imgs", 100, ("a", "b"))
        location, n = tmp_path / "imgs", 200
    store = GatedStore(LocalStore(io_threads=8))
    reader = open_dataset(location, store=store)
    reader.bind_executor(concurrent.futures.ThreadPoolExecutor(2))  # CPU work: 2 threads only
    plan = EpochPlan(n, seed=3, epoch=0, batch_size=16)
    budget = 96
    dealer = Dealer(
        reader,
        plan,
        StreamRange.of(plan, 0),
        prefetch=16,
        limits=FetchLimits(max_reads_per_stream=budget),
        executor=reader.executor,
    )

    async def go() -> list[int]:
        if kind == "arrow":  # structural pages first: a warm reader, so every read is a row's own
            for i in range(0, n, 50):
                await reader.read(i)
        return await _drain_until_in_flight(dealer, store, budget)

    got = asyncio.run(go())
    assert sorted(got) == list(range(n)), "every sample exactly once"
    assert store.max_in_flight <= budget, "never more than the stream's budget"


def test_the_io_pool_holds_that_many_blocking_preads_at_once_beside_a_small_cpu_pool(tmp_path: Path) -> None:
    """Preads that block (a slow file system) each hold a pool thread; 4 CPU workers do not cap them."""
    data = tmp_path / "blob"
    data.write_bytes(bytes(range(256)) * 64)
    n = 200
    entered = threading.Semaphore(0)
    release = threading.Event()
    inside = {"now": 0, "max": 0}
    lock = threading.Lock()

    class SlowLocalStore(LocalStore):
        def _pread(self, path: str, offset: int, size: int) -> bytes:
            with lock:
                inside["now"] += 1
                inside["max"] = max(inside["max"], inside["now"])
            entered.release()
            release.wait(30)
            with lock:
                inside["now"] -= 1
            return super()._pread(path, offset, size)

    store = SlowLocalStore(io_threads=n, native_pool=False)
    cpu = concurrent.futures.ThreadPoolExecutor(4)

    async def go() -> list[bytes]:
        reads = [asyncio.ensure_future(store.read(str(data), 64 * i, 64)) for i in range(n)]
        for _ in range(n):  # every read is inside a pread at the same time
            await asyncio.get_running_loop().run_in_executor(cpu, entered.acquire, True, 30)
        assert inside["now"] == n
        assert store.stats.in_flight == n
        release.set()
        return await asyncio.gather(*reads)

    parts = asyncio.run(go())
    assert inside["max"] == n and store.pool.threads == n
    assert parts == [(bytes(range(256)) * 64)[64 * i : 64 * i + 64] for i in range(n)]
    store.close()


def test_the_native_pool_holds_that_many_slow_preads_at_once(tmp_path: Path) -> None:
    """Through the latency file system (a fixed 1 s per read), 200 reads of 200 files sit
    in the storage at once: one native thread each, and the loop never waits."""
    from croupier.bench.latencyfs import check_available, mounted
    from croupier.server.storage import native

    if not native.available():
        pytest.skip("the native read pool is not built (no C compiler at install time)")
    reason = check_available()
    if reason:
        pytest.skip(f"latency file system unavailable: {reason}")
    n = 200
    src = tmp_path / "src"
    src.mkdir()
    for i in range(n):
        (src / f"{i}.bin").write_bytes(bytes([i % 256]) * 100)
    # 1 s: long enough that all 200 meet in the storage even on a loaded machine.
    with mounted(src, median_ms=1000, distribution="fixed") as fs:
        store = LocalStore(io_threads=n)
        assert store.native is not None

        async def go() -> list[bytes]:
            return await asyncio.gather(*(store.read(f"{fs.path}/{i}.bin", 0, -1) for i in range(n)))

        parts = asyncio.run(go())
        assert parts == [bytes([i % 256]) * 100 for i in range(n)]
        assert fs.stats()["max_in_flight"] >= n and store.stats.max_in_flight == n
        assert store.threads == n
        store.close()


def test_the_native_pool_queues_past_its_threads_reuses_idle_ones_and_lets_them_go_on_close(tmp_path: Path) -> None:
    """More reads than threads wait in the queue and all land, right; threads asleep take
    the next reads instead of new threads starting; close() ends every thread.

    Each read takes a fixed 2 ms in the latency file system, so the 500 reads are all
    queued before the first lands and the pool reaches its 4 threads however busy the
    machine is (page-cache reads could finish between two submissions and leave it at 2)."""
    import contextlib
    import time

    from croupier.bench.latencyfs import check_available, mounted
    from croupier.server.storage import native

    if not native.available():
        pytest.skip("the native read pool is not built (no C compiler at install time)")
    reason = check_available()
    if reason:
        pytest.skip(f"latency file system unavailable: {reason}")
    data = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
    src = tmp_path / "src"
    src.mkdir()
    (src / "blob.bin").write_bytes(data)
    stack = contextlib.ExitStack()
    fs = stack.enter_context(mounted(src, median_ms=2, distribution="fixed"))
    fd = os.open(fs.path / "blob.bin", os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: every read reaches the daemon
    pool = native.NativeReadPool(4)
    offsets = [(i * 97) % (len(data) - 100) for i in range(500)]

    async def go(offs: list[int]) -> list[bytes]:
        return await asyncio.gather(*(pool.pread(fd, o, 100) for o in offs))

    try:
        assert asyncio.run(go(offsets)) == [data[o : o + 100] for o in offsets]
        assert pool.threads == 4
        assert asyncio.run(go(offsets[:3])) == [data[o : o + 100] for o in offsets[:3]]
        assert pool.threads == 4  # the sleeping threads took them: none started
    finally:
        pool.close()
        os.close(fd)
        stack.close()
    for _ in range(500):  # bounded: 5 s
        if pool.threads == 0:
            break
        time.sleep(0.01)
    assert pool.threads == 0
    with pytest.raises(RuntimeError, match="closed"):
        pool.pread(fd, 0, 1)


def test_a_row_of_a_large_table_costs_about_its_own_bytes(tmp_path: Path) -> None:
    rows, batch_rows, row_bytes = 40_000, 1000, 1000
    table = _write_text_table(tmp_path / "big.arrow", rows, batch_rows, row_bytes)
    file_bytes = (tmp_path / "big.arrow").stat().st_size
    batch_bytes = file_bytes // (rows // batch_rows)
    store = LocalStore(io_threads=4)
    reader = open_dataset(tmp_path / "big.arrow", store=store)
    opened = store.stats.snapshot()
    assert opened["bytes"] < 20_000, "opening reads the footer and the batches' metadata only"

    def cost(index: int, columns=()) -> tuple[int, int]:
        before = store.stats.snapshot()
        item = asyncio.run(reader.read(index, columns))
        after = store.stats.snapshot()
        row = reader.encode([item], columns)
        got = pa.ipc.open_stream(pa.py_buffer(row.arrow_ipc)).read_all()
        want = table.slice(index, 1)
        assert got.equals(want.select(list(columns)) if columns else want)
        return after["bytes"] - before["bytes"], after["reads"] - before["reads"]

    # Cold batch: the row's bytes plus its batch's small structural buffers (offsets,
    # ids), never the batch's megabyte of text.
    cold, _ = cost(12_345)
    structural = 4 * (batch_rows + 1) + 8 * batch_rows
    assert row_bytes <= cold <= row_bytes + structural + 64
    assert cold < batch_bytes / 50
    # Warm batch: exactly the row's own bytes, in one read.
    warm, reads = cost(12_346)
    assert (warm, reads) == (row_bytes, 1)
    # A stream of the id column alone reads no text at all.
    ids, _ = cost(12_347, ("id",))
    assert ids == 0
    total = store.stats.bytes - opened["bytes"]
    assert total < 2 * row_bytes + structural + 64


def test_hf_save_to_disk_rows_are_read_by_range_too(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    n = 5000
    ds = datasets.Dataset.from_dict({"text": [f"{i:06d}" + "x" * 994 for i in range(n)], "label": list(range(n))})
    ds.save_to_disk(str(tmp_path / "hf"))
    store = LocalStore(io_threads=4)
    reader = open_dataset(tmp_path / "hf", store=store)
    assert reader.format == "hf" and len(reader) == n
    before = store.stats.bytes
    async def two() -> list:
        return await asyncio.gather(*(reader.read(i) for i in (4321, 4322)))

    items = asyncio.run(two())
    spent = store.stats.bytes - before
    assert spent < 2 * 1000 + 16 * 1024, "two rows and one batch's offsets, not the batch"
    got = pa.ipc.open_stream(pa.py_buffer(reader.encode(items).arrow_ipc)).read_all().to_pylist()
    assert got == [ds[4321], ds[4322]]


def test_a_table_truncated_while_served_fails_the_row_naming_the_file_not_the_process(tmp_path: Path) -> None:
    from croupier.server.readers.base import SampleError

    path = tmp_path / "t.arrow"
    _write_text_table(path, 4000, batch_rows=100)
    reader = open_dataset(path, store=LocalStore(io_threads=4))
    assert asyncio.run(reader.read(10)).index == 10
    with open(path, "r+b") as f:  # cut the file in half under the open reader
        f.truncate(path.stat().st_size // 2)
    with pytest.raises(SampleError, match=r"t\.arrow.*truncated"):
        asyncio.run(reader.read(3990))
    assert asyncio.run(reader.read(11)).index == 11  # rows still there are still served


def test_a_stream_files_layout_is_cached_and_read_again_when_the_file_changes(tmp_path: Path) -> None:
    """The stream format has no footer: its metadata costs a read per record batch, in
    turn. A restarted server finds the layout in the cache instead; a changed file is re-read."""
    path, cache = tmp_path / "s.arrows", tmp_path / "cache"
    table = pa.table({"i": np.arange(500, dtype=np.int64), "s": [f"r{i}" for i in range(500)]})

    def write(t: pa.Table) -> None:
        with pa.ipc.new_stream(str(path), t.schema) as w:
            for b in t.to_batches(max_chunksize=20):
                w.write_batch(b)

    def open_counted():
        store = LocalStore(io_threads=2)
        reader = open_dataset(path, store=store, cache_dir=str(cache))
        return reader, store.stats.reads

    write(table)
    first, reads = open_counted()
    assert reads >= 25, "one read per record batch the first time"
    again, reads = open_counted()
    assert reads == 0, "the cached layout needs no read"
    assert asyncio.run(again.read(487)).index == 487
    got = pa.ipc.open_stream(pa.py_buffer(again.encode([asyncio.run(again.read(487))]).arrow_ipc)).read_all()
    assert got.to_pylist() == [{"i": 487, "s": "r487"}]
    write(pa.concat_tables([table, table]))  # a new file under the same name
    changed, reads = open_counted()
    assert reads > 0 and len(changed) == 1000


@pytest.mark.parametrize("pool", ["native", "python"])
def test_a_whole_read_says_which_file_it_read_and_a_lookup_which_file_a_name_leads_to_now(
    tmp_path: Path, monkeypatch, pool: str
) -> None:
    from croupier.server.storage import native
    from croupier.server.storage.confined import ConfinedStore

    if pool == "native" and native._NativePool is None:
        pytest.skip("the native read pool is not built (no C compiler)")
    monkeypatch.setenv("CROUPIER_READ_POOL", pool)
    inside, outside = tmp_path / "in", tmp_path / "out"
    inside.mkdir(), outside.mkdir()
    (inside / "a.bin").write_bytes(b"a" * 5000)
    (inside / "link.bin").symlink_to(inside / "a.bin")
    (inside / "away.bin").symlink_to(outside / "b.bin")
    (outside / "b.bin").write_bytes(b"b" * 10)
    local = LocalStore(io_threads=4)
    store = ConfinedStore(local, [str(inside)])
    assert (local.native is not None) == (pool == "native")
    st = os.stat(inside / "a.bin")

    async def go() -> None:
        data, version = await store.read_whole_versioned(str(inside / "link.bin"))
        assert data == b"a" * 5000
        assert version == (str(inside / "a.bin"), st.st_dev, st.st_ino, 5000, st.st_mtime_ns)
        assert await store.version(str(inside / "link.bin")) == version  # unread, the same file
        assert await store.version(str(inside / "away.bin")) is None  # outside the roots: no version to serve
        assert await store.version(str(inside)) is None  # a folder is no file
        assert await store.version(str(inside / "gone.bin")) is None
        with pytest.raises(Exception, match="outside the dataset's roots"):
            await store.read_whole_versioned(str(inside / "away.bin"))
        (inside / "a.bin").write_bytes(b"A" * 6000)
        now = await local.version(str(inside / "link.bin"))
        assert now is not None and now.size == 6000 and not now.same_file(version)

    try:
        asyncio.run(go())
        assert store.stats.reads == 2  # the whole reads are reads (the refused one too); the lookups are not
    finally:
        local.close()
