"""A table's warm rows cross into storage once per group of rows, not once per sample.

Where reads land at once (a local file system, or a file the server's cache holds whole in
memory) a group lands as one (`submit_ranges`). Elsewhere (a FUSE mount) a group's rows are
started in one call too, but each is handed over as soon as its own read lands
(`submit_rows`), so the group's slowest read holds back no other row. Real Arrow IPC files
read by range through a real LocalStore (the native read pool where it is built); the
store's calls are counted, on a stream alone and on a shared epoch (the server's default
path), and every sample still arrives exactly once, in its batch and position, with its
own bytes. How the rows of one call are handed over (`native._Rows`) is driven by hand.
"""

from __future__ import annotations

import asyncio
import math
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import pyarrow.ipc as ipc

from croupier.bench import latencyfs
from croupier.protocol.epoch_plan import EpochPlan
from croupier.server.cache.block_cache import BlockCache
from croupier.server.cache.cached_store import CachedStore
from croupier.server.cache.sizing import CacheSizes
from croupier.server.readers.arrow_ipc import ArrowIPCReader
from croupier.server.storage.base import Store
from croupier.server.storage import native
from croupier.server.storage.gate import ReadGate
from croupier.server.storage.local import LocalStore
from croupier.server.stream.dealer import Dealer
from croupier.server.stream.fetch_limits import FetchLimits
from croupier.server.stream.rank_batches import StreamRange
from croupier.server.stream.read_groups import READ_GROUP
from croupier.server.stream.shared_epochs import SharedEpochs

ROWS, BATCH_SIZE, RECORD_BATCH = 640, 64, 100


def _table(path: Path) -> None:
    """`id` (dense: read by cached page) and `text` (100 bytes a row: one range read each)."""
    t = pa.table({"id": pa.array(range(ROWS), pa.int64()), "text": [f"{i:0100d}" for i in range(ROWS)]})
    with ipc.new_file(str(path), t.schema) as w:
        w.write_table(t, max_chunksize=RECORD_BATCH)


class Crossings:
    """Counts the calls into the store's batched read paths, the ranges they carry, and
    (`submit_rows`) the calls handing rows back and the rows in them."""

    def __init__(self, store: Store):
        self.calls = self.ranges = 0  # submit_ranges
        self.row_calls = self.row_ranges = self.handovers = self.rows_back = 0  # submit_rows
        self.held_calls = self.held_ranges = 0  # held_ranges that answered
        ranges_inner, rows_inner, held_inner = store.submit_ranges, store.submit_rows, store.held_ranges

        def held(path: str, ranges: Any) -> Any:
            parts = held_inner(path, ranges)
            if parts is not None:
                self.held_calls += 1
                self.held_ranges += len(ranges)
            return parts

        def counted(path: str, ranges: Any, callback: Any) -> bool:
            self.calls += 1
            self.ranges += len(ranges)
            return ranges_inner(path, ranges, callback)

        def by_rows(path: str, rows: Any, callback: Any) -> bool:
            def back(done: list) -> None:
                self.handovers += 1
                self.rows_back += len(done)
                callback(done)

            self.row_calls += 1
            self.row_ranges += sum(map(len, rows))
            return rows_inner(path, rows, back)

        store.submit_ranges = counted  # type: ignore[method-assign]
        store.submit_rows = by_rows  # type: ignore[method-assign]
        store.held_ranges = held  # type: ignore[method-assign]


async def _stream(path: Path, shared: bool, store: Store | None = None, cold: dict | None = None) -> tuple[list, Crossings]:
    """An epoch of the table through a Dealer (`shared`: a shared epoch), every record batch's
    structural pages cached first, unless `cold` is given: then none are, and `cold` gets
    the reader's awaited reads ('reads'), its `warm` calls ('warms') and the page loads'
    store calls ('page_loads')."""
    store = store if store is not None else LocalStore(io_threads=16)
    reader = ArrowIPCReader("t", str(path), store=store)
    if cold is None:
        for first in range(0, ROWS, RECORD_BATCH):  # every record batch's structural pages cached: all rows warm
            await reader.read(first)
    else:
        cold.update(reads=0, warms=0, page_loads=0)
        read, warm, read_ranges = reader.read, reader.warm, store.read_ranges

        async def counted_read(*a: Any) -> Any:
            cold["reads"] += 1
            return await read(*a)

        async def counted_warm(*a: Any) -> None:
            cold["warms"] += 1
            await warm(*a)

        async def counted_ranges(*a: Any) -> Any:
            cold["page_loads"] += 1  # the reader awaits read_ranges for structural pages only
            return await read_ranges(*a)

        reader.read, reader.warm, store.read_ranges = counted_read, counted_warm, counted_ranges  # type: ignore[method-assign]
    if isinstance(store, CachedStore):  # the fill the first read started (if any), to its end
        assert await asyncio.to_thread(store.fill_done, 30)
        store.cache.stats.misses = 0  # the warming reads' misses: the stream's are counted
    crossings = Crossings(store)
    plan = EpochPlan(ROWS, seed=3, epoch=0, batch_size=BATCH_SIZE)
    # The in-flight bound (256) never cuts a group: at most 3 batches of 64 are read at once.
    dealer = Dealer(reader, plan, StreamRange.of(plan, 0), prefetch=2, limits=FetchLimits())
    chunks = dealer if not shared else SharedEpochs().stream(dealer)
    got = [(ref, row) async for chunk in chunks
           for ref, row in zip(chunk.refs, ipc.open_stream(chunk.payload.arrow_ipc).read_all().to_pylist())]
    reader.close()
    store.close()
    return got, crossings


def _check_exactly_once(got: list) -> None:
    plan = EpochPlan(ROWS, seed=3, epoch=0, batch_size=BATCH_SIZE)
    assert sorted(ref.index for ref, _ in got) == list(range(ROWS))
    for ref, row in got:
        assert int(plan.rank_batch(0, ref.batch).indices[ref.position]) == ref.index
        assert row == {"id": ref.index, "text": f"{ref.index:0100d}"}


def test_warm_rows_cross_into_storage_once_per_group_not_per_sample(tmp_path: Path) -> None:
    _table(tmp_path / "t.arrow")
    got, crossings = asyncio.run(_stream(tmp_path / "t.arrow", shared=False))
    _check_exactly_once(got)
    groups = (ROWS // BATCH_SIZE) * math.ceil(BATCH_SIZE / READ_GROUP)
    assert crossings.ranges == ROWS  # one value range per row, no row read twice
    assert crossings.calls == groups  # 20 calls for 640 rows, where one per sample made 640


def test_a_shared_epoch_reads_its_rows_in_groups_too(tmp_path: Path) -> None:
    _table(tmp_path / "t.arrow")
    got, crossings = asyncio.run(_stream(tmp_path / "t.arrow", shared=True))
    _check_exactly_once(got)
    assert crossings.ranges == ROWS
    assert crossings.calls == (ROWS // BATCH_SIZE) * math.ceil(BATCH_SIZE / READ_GROUP)


GROUPS = (ROWS // BATCH_SIZE) * math.ceil(BATCH_SIZE / READ_GROUP)


def test_rows_whose_pages_are_not_cached_are_warmed_together_and_read_as_a_group(tmp_path: Path) -> None:
    # Nothing cached at the start: a group's cold rows have their batches' structural pages
    # loaded by one task (`Reader.warm`), each batch's once, and are then read as a group:
    # no row takes the one-by-one path (its own task and `read`).
    _table(tmp_path / "t.arrow")
    for shared in (False, True):
        cold: dict = {}
        got, crossings = asyncio.run(_stream(tmp_path / "t.arrow", shared=shared, store=LocalStore(io_threads=16),
                                             cold=cold))
        _check_exactly_once(got)
        assert cold["reads"] == 0, cold
        assert 1 <= cold["warms"] <= GROUPS, cold
        batches = math.ceil(ROWS / RECORD_BATCH)
        assert cold["page_loads"] == batches, cold  # each record batch's pages loaded once, in one store call
        assert crossings.ranges == ROWS and crossings.calls <= GROUPS + cold["warms"], (crossings.calls, cold)


def _on_fuse(tmp_path: Path, make_store: Any = None, inside: Any = None, **mount: Any) -> tuple[list, Crossings]:
    """The table on a latencyfs mount (`mount`: its options, fixed 0 ms by default) streamed
    by a shared epoch through `make_store(path)` (a LocalStore by default); `inside(store,
    path)` runs before the store closes."""
    (tmp_path / "src").mkdir()
    _table(tmp_path / "src" / "t.arrow")
    with latencyfs.mounted(tmp_path / "src", **(mount or {"median_ms": 0, "distribution": "fixed"})) as fs:
        path = fs.path / "t.arrow"
        store = make_store(str(path)) if make_store is not None else None
        try:
            got, crossings = asyncio.run(_stream(path, shared=True, store=store))
            if inside is not None:
                inside(store, str(path))
        finally:
            if store is not None:
                store.close()
    _check_exactly_once(got)
    return got, crossings


def _cached(fill: str) -> Any:
    caches: list[BlockCache] = []

    def make(_path: str) -> CachedStore:
        caches.append(BlockCache(CacheSizes(memory_bytes=64 << 20, fill=fill)))
        return CachedStore(LocalStore(io_threads=16), caches[-1], "t")

    make.caches = caches  # type: ignore[attr-defined]
    return make


def test_a_table_on_a_fuse_mount_is_read_in_groups_whose_rows_are_handed_over_as_they_land(tmp_path: Path) -> None:
    # Reads of 2-15 ms each (lognormal): a group's 32 land over several wake-ups of the loop,
    # even on a busy machine (with 1 ms a loaded loop once took whole groups in one). By
    # O_DIRECT, so each row's read reaches the daemon: by preads the 64 KB table's pages are
    # in the page cache after a group or two, the later groups land at once (24 hand-overs
    # for 20 groups in one run), and a loaded CI machine once made it 20.
    _, crossings = _on_fuse(tmp_path, lambda _path: LocalStore(io_threads=16, read_path="direct"), median_ms=5, sigma=0.5)
    assert crossings.calls == 0  # never as one group landing at once
    assert crossings.row_calls == GROUPS and crossings.row_ranges == ROWS  # one call per group, no row twice
    assert crossings.rows_back == ROWS  # every row handed over once...
    assert crossings.handovers > GROUPS  # ...as they landed, not each group when its slowest did


def test_a_table_the_server_cache_holds_whole_is_read_in_groups_even_on_a_fuse_mount(tmp_path: Path) -> None:
    # Later epochs of data that fits the cache: every read is in memory, so a group's rows
    # are taken from it at once, with no completion to wait for (bench/results/cpu_per_sample.md).
    make = _cached("always")  # the whole file, filled
    _, crossings = _on_fuse(tmp_path, make)
    # Each group's ranges taken from memory in one call, nothing submitted to wait for
    assert crossings.held_ranges == ROWS and crossings.held_calls == GROUPS
    assert crossings.calls == crossings.row_calls == 0
    (cache,) = make.caches
    assert cache.stats.misses == 0 and cache.stats.hits >= ROWS  # and every row from memory


def test_rows_the_cache_holds_come_from_memory_and_the_rest_from_storage_in_the_same_groups(tmp_path: Path) -> None:
    make = _cached("never")  # blocks admitted only as rows are read

    def not_held(store: Any, path: str) -> None:
        assert not store.held_in_memory(path)

    _, crossings = _on_fuse(tmp_path, make, not_held)
    assert crossings.calls == 0 and crossings.row_calls == GROUPS and crossings.rows_back == ROWS
    (cache,) = make.caches
    assert cache.stats.hits + cache.stats.misses == ROWS  # each row's one range, counted once


def _rows(rows: list[list[tuple[int, int]]]) -> tuple[Any, list]:
    calls: list = []
    group = native._Rows(None, lambda *args: calls.append(args), rows)  # type: ignore[arg-type]  # no loop: by hand
    return group, calls


def test_the_rows_of_one_call_are_handed_over_as_each_completes_once_per_wake_up() -> None:
    group, calls = _rows([[(0, 1)], [(10, 1), (20, 1)], [(30, 1)], [(40, 1)]])
    # The pool gets the ranges in row order, one call for them all; range i lands as i.
    assert group.flat == [(0, 1), (10, 1), (20, 1), (30, 1), (40, 1)]
    # One wake-up: row 2 lands whole, row 1 half: only row 2 is handed over; both ranges counted.
    assert group.land(3, b"c") is True
    assert group.land(2, b"B2") is False  # already to be flushed
    group.flush()
    assert calls == [([(2, [b"c"], None)], 2, 0, 3)]  # (rows done, ranges landed, failed, bytes)
    # The next: row 1's other range, and a failed read of row 3; row 0 still out.
    assert group.land(1, b"B1") is True
    assert group.land(4, -5) is False
    group.flush()
    done, ok, bad, nbytes = calls[1]
    assert done[0] == (1, [b"B1", b"B2"], None) and (ok, bad, nbytes) == (1, 1, 2)  # its parts in the order asked
    row, parts, err = done[1]
    assert (row, parts, type(err), err.errno) == (3, None, OSError, 5)
    assert group.land(0, b"a") is True
    group.flush()
    assert calls[2] == ([(0, [b"a"], None)], 1, 0, 1)
    assert sorted(r for call in calls for r, _, _ in call[0]) == [0, 1, 2, 3]  # each row exactly once
    assert sum(c[1] + c[2] for c in calls) == 5  # and each range counted once


def test_a_row_whose_first_range_failed_is_not_handed_over_again_when_its_others_land() -> None:
    group, calls = _rows([[(0, 1), (1, 1), (2, 1)]])
    assert group.land(1, -5) is True
    group.flush()
    assert group.land(0, b"x") is True and group.land(2, b"y") is False
    group.flush()
    # The row once, failed; its other ranges still counted as they land (the store's in-flight count)
    assert [(len(c[0]), c[1], c[2]) for c in calls] == [(1, 0, 1), (0, 2, 0)] and calls[0][0][0][0] == 0


def test_a_gated_mount_starts_a_groups_rows_one_by_one_at_its_gate(tmp_path: Path) -> None:
    # A group would pass the gate as one call of 32 reads, past a limit of 2 or 4: each of
    # its rows waits its turn instead, and all are still handed over, each once.
    gates: list[ReadGate] = []

    def gated(path: str) -> LocalStore:
        store = LocalStore(io_threads=16)
        store.pin(path)
        gates.append(ReadGate(2))
        store._gates[os.stat(path).st_dev] = gates[-1]
        return store

    _, crossings = _on_fuse(tmp_path, gated)
    (gate,) = gates
    assert crossings.row_calls == GROUPS and crossings.rows_back == ROWS
    assert gate.peak == 2 and gate.in_flight == 0 and gate.queued >= ROWS - GROUPS * 2


class _CountingPool:
    """The native pool's C object, its submit calls counted by name."""

    def __init__(self, inner: Any):
        self.inner, self.calls = inner, {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not name.startswith("submit"):
            return attr

        def counted(*args: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args)
        return counted


@pytest.mark.skipif(not native.available(), reason="the native read pool is not built (no C compiler)")
def test_the_native_pool_takes_a_groups_ranges_in_one_call_and_each_lands_as_its_own(tmp_path: Path) -> None:
    # Issue 21 item 4: one crossing of the native boundary per group, not one per range; a
    # preads fd, a mapping and (where the file system takes it) O_DIRECT, on a real file.
    data = os.urandom(1 << 20)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    rows = [[(i * 997 % 900_000, 1000)] for i in range(32)] + [[(5, 10), (70_000, 3), (999_990, 100)]]
    want = [[data[o:o + s] for o, s in r] for r in rows]
    fd = os.open(path, os.O_RDONLY)
    mapping = native.Mapping(fd)
    try:
        direct = native.open_direct(str(path))
    except OSError:
        direct = None
    pool = native.NativeReadPool(64)
    counting = pool._pool = _CountingPool(pool._pool)

    async def read(**how: Any) -> list:
        got: list = [None] * len(rows)
        done = asyncio.Event()
        left = [len(rows)]

        def back(rows_done: list, ok: int, bad: int, nbytes: int) -> None:
            for row, parts, err in rows_done:
                assert err is None, err
                got[row] = parts
                left[0] -= 1
            if not left[0]:
                done.set()
        pool.pread_rows(how.get("fd"), str(path), rows, back, mapping=how.get("mapping"), direct=how.get("direct"))
        await asyncio.wait_for(done.wait(), 30)
        return got

    try:
        for how in ({"fd": fd}, {"mapping": mapping}, *([{"direct": direct}] if direct else [])):
            counting.calls.clear()
            assert asyncio.run(read(**how)) == want, how
            assert counting.calls == {"submit_ranges": 1}, (how, counting.calls)
        counting.calls.clear()
        assert asyncio.run(read()) == want  # by path: each range opened on its own thread, one call each
        assert counting.calls == {"submit_path": sum(map(len, rows))}
        # A bad range queues nothing: every range is checked before any is handed to a thread.
        before = pool._pool.pending
        with pytest.raises(TypeError, match="range 1 is not an"):
            pool._pool.submit_ranges(10**9, fd, [(0, 1), [2, 3]])
        with pytest.raises(ValueError, match="range 0: offset must not be negative"):
            pool._pool.submit_ranges(10**9, fd, [(-1, 1)])
        assert pool._pool.pending == before
    finally:
        pool.close()
        mapping.close()
        os.close(fd)
        if direct:
            os.close(direct.fd)


def test_a_groups_rows_from_several_files_complete_in_one_call_where_reads_land_at_once(tmp_path: Path) -> None:
    # A batch's rows span most of a dataset's files; where reads land at once (a local file
    # system) the group's files complete as one call, not one per file, every row in it once;
    # a file whose store call refuses leaves its rows cold and the others still complete.
    from croupier.server.readers import open_dataset

    (tmp_path / "parts").mkdir()
    for k in range(4):  # ids run on across the files: row r is id r; text 100 bytes a row, read by range
        t = pa.table({"id": pa.array(range(40 * k, 40 * k + 40), pa.int64()),
                      "text": [f"{i:0100d}" for i in range(40 * k, 40 * k + 40)]})
        with ipc.new_file(str(tmp_path / "parts" / f"part-{k:04d}.arrow"), t.schema) as w:
            w.write_table(t, max_chunksize=20)

    reads = [0]

    async def go(refuse: str | None) -> tuple[list, list[int], list[int]]:
        store = LocalStore(io_threads=4)
        reader = open_dataset(tmp_path / "parts", name="parts", store=store)
        try:
            for i in range(0, len(reader), 20):  # every batch's structural pages cached: rows warm
                await reader.read(i)
            inner = reader.store.submit_ranges
            reads[0] = 0

            def submit(path: str, ranges: Any, cb: Any) -> bool:
                reads[0] += 1
                return False if refuse is not None and path.endswith(refuse) else inner(path, ranges, cb)
            reader.store.submit_ranges = submit  # type: ignore[method-assign]
            calls: list = []
            landed = asyncio.Event()

            def done(results: list) -> None:
                calls.append(results)
                landed.set()
            rows = [3, 45, 87, 129, 10, 50, 90, 130]  # two rows of each of the four files
            cold = list(reader.start_reads(rows, (), done))
            await asyncio.wait_for(landed.wait(), 10)
            await asyncio.sleep(0.05)  # a second call, were there one, would have come by now
            return calls, [rows[p] for p in cold], rows
        finally:
            reader.close()
            store.close()

    calls, cold, rows = asyncio.run(go(None))
    assert len(calls) == 1 and not cold, calls
    got = sorted((rows[pos], item.index) for pos, item, err in calls[0] if err is None)
    assert got == [(r, r) for r in sorted(rows)] and len(calls[0]) == len(rows)
    assert reads[0] == 4  # one store call per file, and every row needed one
    calls, cold, rows = asyncio.run(go("part-0001.arrow"))
    assert len(calls) == 1 and sorted(cold) == [45, 50], (calls, cold)
    assert sorted(rows[pos] for pos, _, _ in calls[0]) == sorted(r for r in rows if r not in (45, 50))
