"""Sweeps that start apart still share one read of storage (issue 23, item 3): the server's
cache tier is the bounded sample cache a late job replays. A real gRPC server in-process, a
real FUSE mount (latencyfs, kernel defaults) counting every read that reaches it, and two
identical jobs (same dataset, seed and epoch; 2 ranks each) of which the second starts only
after the first finished its epoch: far past any shared epoch's window."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from croupier.bench import latencyfs
from croupier.client import Loader, RetryPolicy
from croupier.server.cache import CachedStore

_REASON = latencyfs.check_available()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"latencyfs unusable here: {_REASON}")

ROWS, ROW_BYTES, RANKS = 4000, 1000, 2


def _table(path: Path) -> None:
    table = pa.table({"id": np.arange(ROWS, dtype=np.int64),
                      "text": [f"{i:08d}" + "x" * (ROW_BYTES - 8) for i in range(ROWS)]})
    with pa.ipc.new_file(str(path), table.schema) as w:
        w.write_table(table, max_chunksize=500)


def _job(address: str) -> list[list[int]]:
    """One job of the sweep: each rank's epoch 0, as the ids in the order they were handed out."""
    out = []
    for rank in range(RANKS):
        loader = Loader("t", servers=address, rank=rank, world_size=RANKS, batch_size=64, seed=7,
                        retry=RetryPolicy(max_retries=0), format="numpy")
        loader.set_epoch(0)
        ids = []
        for batch in loader:
            assert all(str(t).startswith(f"{i:08d}") for i, t in zip(batch["id"].tolist(), batch["text"]))
            ids += batch["id"].tolist()
        out.append(ids)
    assert sorted(i for ids in out for i in ids) == list(range(ROWS))  # every sample once
    return out


def _metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
            if ln.startswith("croupier_") and not ln.startswith("#")}


def _sweep_of_two(tmp_path: Path, serve_inprocess, cache_memory: str):
    """Job A's epoch, then (page cache dropped: only the server can keep what A read) job B's.
    Returns both jobs' streams, the mount's read requests and bytes during B, the server."""
    src = tmp_path / "src"
    src.mkdir()
    _table(src / "t.arrow")
    with latencyfs.mounted(src, median_ms=1, distribution="fixed", max_background=latencyfs.KERNEL_DEFAULT) as fs:
        # the fill always (its rule times one block against small reads, which a loaded machine can tip):
        # what is pinned here is what a late job gets from what the cache holds
        srv = serve_inprocess(datasets=[f"t={fs.path / 't.arrow'}"], cache_memory=cache_memory, cache_fill="always",
                              metrics_port=0)
        first = _job(srv.address)
        [reader] = srv.running.catalog.readers()
        if isinstance(reader.store, CachedStore):
            assert reader.store.fill_done(60)
        fs.evict()
        before = fs.stats()
        second = _job(srv.address)
        after = fs.stats()
        return first, second, after["requests"] - before["requests"], after["bytes"] - before["bytes"], srv


def test_a_job_started_after_the_first_finished_its_epoch_reads_nothing_from_storage(tmp_path: Path,
                                                                                      serve_inprocess) -> None:
    first, second, requests, nbytes, srv = _sweep_of_two(tmp_path, serve_inprocess, "64M")
    assert second == first  # the same stream it would get alone, order included
    assert (requests, nbytes) == (0, 0)  # the whole second job served from the server's cache
    cache = srv.running.catalog.cache
    assert cache.memory.resident == os.path.getsize(tmp_path / "src" / "t.arrow")  # bounded: the file, once
    m = _metrics(srv.running.metrics_port)
    assert m['croupier_cache_lookups_total{result="hit"}'] == cache.stats.hits >= ROWS
    assert m['croupier_cache_lookups_total{result="miss"}'] == cache.stats.misses
    # the second job came long after the first's shared epochs ended: each of its ranks began one
    # of its own (4 started, none joined), and read it from the cache
    assert {k: v for k, v in m.items() if k.startswith("croupier_shared_joins_total")} == \
        {'croupier_shared_joins_total{outcome="started"}': 2 * RANKS}


def test_without_the_cache_a_late_job_reads_the_data_from_storage_again(tmp_path: Path, serve_inprocess) -> None:
    first, second, requests, nbytes, srv = _sweep_of_two(tmp_path, serve_inprocess, "0")
    assert second == first
    assert srv.running.catalog.cache is None
    # every sample's bytes came from the mount again: what shared epochs alone give a late job
    assert requests > 0 and nbytes >= ROWS * ROW_BYTES


def test_the_cache_that_holds_part_of_the_data_stays_in_its_budget_and_a_late_job_reads_the_rest(
        tmp_path: Path, serve_inprocess) -> None:
    first, second, requests, nbytes, srv = _sweep_of_two(tmp_path, serve_inprocess, "2M")
    assert second == first
    cache = srv.running.catalog.cache
    assert 0 < cache.memory.resident <= 2 * 2**20  # half the file at most: --cache-memory bounds it
    m = _metrics(srv.running.metrics_port)
    assert m['croupier_cache_lookups_total{result="hit"}'] > 0 and m['croupier_cache_lookups_total{result="miss"}'] > 0
    # what the cache holds is not read again; every other sample's bytes come from the mount
    assert requests > 0 and ROWS * ROW_BYTES - cache.memory.resident <= nbytes < ROWS * ROW_BYTES
