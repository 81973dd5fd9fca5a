"""A table's warm rows cross into storage once per group of rows, not once per sample.

Only where reads land at once: on a local file system, or where the server's cache holds
the whole file in memory. Elsewhere (a FUSE mount) a group's slowest read would hold the
rest, so rows there are read one at a time. Real Arrow IPC files read by range through a real
LocalStore (the native read pool where it is built); the store's `submit_ranges` calls are
counted, on a stream alone and on a shared epoch (the server's default path), and every
sample still arrives exactly once, in its batch and position, with its own bytes.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from croupier.bench import latencyfs
from croupier.protocol.epoch_plan import EpochPlan
from croupier.server.cache.block_cache import BlockCache
from croupier.server.cache.cached_store import CachedStore
from croupier.server.cache.sizing import CacheSizes
from croupier.server.readers.arrow_ipc import ArrowIPCReader
from croupier.server.storage.base import Store
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
    """Counts the calls into the store's batched read path and the ranges they carry."""

    def __init__(self, store: Store):
        self.calls = 0
        self.ranges = 0
        inner = store.submit_ranges

        def counted(path: str, ranges: Any, callback: Any) -> bool:
            self.calls += 1
            self.ranges += len(ranges)
            return inner(path, ranges, callback)

        store.submit_ranges = counted  # type: ignore[method-assign]


async def _stream(path: Path, shared: bool, store: Store | None = None) -> tuple[list, Crossings]:
    store = store if store is not None else LocalStore(io_threads=16)
    reader = ArrowIPCReader("t", str(path), store=store)
    for first in range(0, ROWS, RECORD_BATCH):  # every record batch's structural pages cached: all rows warm
        await reader.read(first)
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


def test_a_table_on_a_fuse_mount_is_read_one_row_at_a_time(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    _table(tmp_path / "src" / "t.arrow")
    with latencyfs.mounted(tmp_path / "src", median_ms=0, distribution="fixed") as fs:
        got, crossings = asyncio.run(_stream(fs.path / "t.arrow", shared=True))
    _check_exactly_once(got)
    assert crossings.ranges == ROWS
    assert crossings.calls == ROWS  # one storage call per row, as before groups


def test_a_table_the_server_cache_holds_whole_is_read_in_groups_even_on_a_fuse_mount(tmp_path: Path) -> None:
    # Later epochs of data that fits the cache: every read lands from memory at once, so the
    # per-row Python a group saves is worth saving there too (bench/results/cpu_per_sample.md).
    (tmp_path / "src").mkdir()
    _table(tmp_path / "src" / "t.arrow")
    with latencyfs.mounted(tmp_path / "src", median_ms=0, distribution="fixed") as fs:
        cache = BlockCache(CacheSizes(memory_bytes=64 << 20, fill="always"))  # the whole file, filled
        store = CachedStore(LocalStore(io_threads=16), cache, "t")
        try:
            got, crossings = asyncio.run(_stream(fs.path / "t.arrow", shared=True, store=store))
        finally:
            store.close()
    _check_exactly_once(got)
    assert crossings.ranges == ROWS
    assert crossings.calls == (ROWS // BATCH_SIZE) * math.ceil(BATCH_SIZE / READ_GROUP)
    assert cache.stats.misses == 0 and cache.stats.hits >= ROWS  # and every row from memory


def test_a_file_the_cache_holds_in_part_is_still_read_one_row_at_a_time(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    _table(tmp_path / "src" / "t.arrow")
    with latencyfs.mounted(tmp_path / "src", median_ms=0, distribution="fixed") as fs:
        cache = BlockCache(CacheSizes(memory_bytes=64 << 20, fill="never"))  # blocks admitted only as rows are read
        store = CachedStore(LocalStore(io_threads=16), cache, "t")
        try:
            got, crossings = asyncio.run(_stream(fs.path / "t.arrow", shared=True, store=store))
            assert not store.held_in_memory(str(fs.path / "t.arrow"))
        finally:
            store.close()
    _check_exactly_once(got)
    assert crossings.calls == ROWS
