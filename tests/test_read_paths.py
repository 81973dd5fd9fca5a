"""The read paths for files, preads, page faults of a mapping and O_DIRECT reads, and the
choice between them per mount by measurement (server/storage/readpath.py; O_DIRECT's own
guarantees: tests/test_direct_reads.py).

Real FUSE mounts (bench/latencyfs.py) count the requests each path issues and the
threads that issued them; skipped, with the reason, where FUSE cannot be mounted.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pytest

from croupier.bench import latencyfs
from croupier.client import ImageDecoding, Loader, LoaderError, RetryPolicy
from croupier.server.storage import native, readpath
from croupier.server.storage.local import LocalStore

from readers_data import write_arrow_file, write_hf_dataset, write_parquet, write_webdataset

_REASON = latencyfs.check_available()
needs_fuse = pytest.mark.skipif(_REASON is not None, reason=f"latencyfs unusable here: {_REASON}")
needs_native = pytest.mark.skipif(not native.available(), reason="the native read pool is not built (no C compiler)")

PAGE = 4096
FILE_BYTES = 4 << 20  # 1,024 pages: room for the probe's 520 and the tests' reads


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("readpaths-src")
    (root / "data.bin").write_bytes(random.Random(3).randbytes(FILE_BYTES))
    return root


def _read_pages(store: LocalStore, path: str, pages: list[int], size: int = 1000) -> tuple[list[bytes], int]:
    """Read `size` bytes at 100 into each page, all at once, on a fresh event loop;
    returns the parts and the loop thread's id."""

    async def go() -> tuple[list[bytes], int]:
        parts = await asyncio.gather(*(store.read(path, p * PAGE + 100, size) for p in pages))
        return list(parts), threading.get_native_id()

    return asyncio.run(go())


@needs_fuse
@needs_native
@pytest.mark.parametrize("max_background", [latencyfs.KERNEL_DEFAULT, None], ids=["kernel-default", "raised"])
def test_a_mount_that_caps_concurrent_preads_is_read_by_page_faults_and_a_raised_one_by_preads(source: Path, max_background,
                                                                                              caplog) -> None:
    # 20 ms fixed: the cap (12 in flight) against 64 asked is a 5x difference in rate,
    # far from the rule's thresholds whatever else the CPUs are doing.
    with latencyfs.mounted(source, median_ms=20, distribution="fixed", max_background=max_background) as fs:
        store = LocalStore(io_threads=256, read_path="auto")
        try:
            fs.reset_stats()
            with caplog.at_level("WARNING", logger="croupier.storage"):
                store.pin(str(fs.path / "data.bin"))
            [choice] = store.read_paths()
            peak = fs.stats()["max_in_flight"]
        finally:
            store.close()
    assert choice.mount.point == str(fs.path) and choice.mount.fs_type == "fuse.latencyfs"
    assert choice.reason == "measured" and choice.probe_concurrency == 64
    if max_background == latencyfs.KERNEL_DEFAULT:
        assert choice.capped() and choice.ceilings["pread"] <= 13, choice  # the kernel's 12, not the 64 asked
        assert choice.path == "mmap" and choice.rates["mmap"] >= 1.25 * choice.rates["pread"], choice
        assert peak == 64  # the daemon saw the page faults all at once, past the cap
        # one line names the mount, its ceiling, the path taken and what would raise the cap
        [line] = [r.getMessage() for r in caplog.records if "reads at once with preads" in r.getMessage()]
        assert line.startswith(f"storage: {fs.path} (fuse.latencyfs) completes only about ")
        assert f"about {choice.ceilings['pread']:.0f} reads at once" in line and "croupier asks for up to 256" in line
        assert "reading it by page faults of a mapping" in line and "-o max_background=256" in line, line
    else:
        assert not choice.capped() and choice.path == "pread" and "mmap" not in choice.rates, choice
        assert peak == 64
        assert not [r for r in caplog.records if "reads at once" in r.getMessage()]


@needs_fuse
@needs_native
def test_a_probe_beside_a_busy_server_still_finds_the_cap_counting_only_its_own_threads_cpu(source: Path) -> None:
    # A probe again runs inside a serving process whose other threads keep its CPUs busy.
    # Their CPU must not pass for the probe's own: preads that wait on a capped mount are
    # not CPU-bound, whatever the process's CPU clock says.
    stop = threading.Event()
    block = bytes(1 << 20)

    def spin() -> None:  # hashing 1 MiB releases the GIL: a core busy, whatever the probe's threads do
        while not stop.is_set():
            hashlib.sha256(block).digest()

    with latencyfs.mounted(source, median_ms=20, distribution="fixed", max_background=latencyfs.KERNEL_DEFAULT) as fs:
        store = LocalStore(io_threads=256, read_path="auto")
        burners = [threading.Thread(target=spin, daemon=True)]  # one: the other core for the daemon
        try:
            for busy in burners:
                busy.start()
            cpu0, t0 = time.process_time(), time.monotonic()
            store.pin(str(fs.path / "data.bin"))
            process_cores = (time.process_time() - cpu0) / (time.monotonic() - t0)
            [choice] = store.read_paths()
        finally:
            stop.set()
            for busy in burners:
                busy.join()
            store.close()
    assert process_cores >= 0.5, process_cores  # the process was busy: its CPU clock alone would say CPU-bound
    assert choice.cpu_cores["pread"] < 0.5, choice  # the probe's reading threads waited on the mount
    assert choice.capped(), choice  # and so read by another path where one does better (load decides which)


@needs_native
def test_a_page_cached_local_file_keeps_preads_and_warns_of_no_cap(source: Path, caplog) -> None:
    (source / "data.bin").read_bytes()  # in the page cache: the probe's reads are CPU-bound
    store = LocalStore(io_threads=256, read_path="auto")
    try:
        with caplog.at_level("WARNING", logger="croupier.storage"):
            store.pin(str(source / "data.bin"))
        [choice] = store.read_paths()
    finally:
        store.close()
    assert choice.path == "pread" and not choice.capped(), choice
    # a local block or memory file system is not probed (a busy CPU could pass for a cap)
    assert choice.reason.startswith("a local file system") == choice.mount.is_local, choice
    assert not [r for r in caplog.records if "reads at once" in r.getMessage()]


@needs_fuse
@needs_native
@pytest.mark.parametrize("path", readpath.READ_PATHS)
def test_each_read_path_issues_one_page_request_per_row_counted_by_the_storage_and_the_store(source: Path, path: str) -> None:
    pages = random.Random(5).sample(range(FILE_BYTES // PAGE), 200)
    data = (source / "data.bin").read_bytes()
    with latencyfs.mounted(source, median_ms=1, distribution="fixed") as fs:
        store = LocalStore(io_threads=64, read_path=path)
        try:
            f = str(fs.path / "data.bin")
            store.pin(f)
            fs.reset_stats()
            parts, _ = _read_pages(store, f, pages)
            stats = fs.stats()
        finally:
            store.close()
    assert parts == [data[p * PAGE + 100 : p * PAGE + 1100] for p in pages]
    assert store.path_reads == {p: 200 if p == path else 0 for p in readpath.READ_PATHS}
    # One request of at most 4 KiB per row on every path: no read-ahead, nothing read twice
    # (O_DIRECT on FUSE: the row's own 1,000 bytes, tests/test_direct_reads.py).
    assert stats["requests"] == 200 and stats["request_sizes"]["le_4k"] == 200, stats
    assert store.read_paths()[0].path == path and store.read_paths()[0].reason.startswith("forced")


@needs_fuse
@needs_native
def test_page_faults_of_a_mapping_are_taken_on_read_threads_never_on_the_event_loop(source: Path) -> None:
    pages = random.Random(9).sample(range(FILE_BYTES // PAGE), 100)
    with latencyfs.mounted(source, median_ms=1, distribution="fixed") as fs:
        store = LocalStore(io_threads=32, read_path="mmap")
        try:
            f = str(fs.path / "data.bin")
            store.pin(f)
            fs.reset_stats()
            _, loop_tid = _read_pages(store, f, pages)
            callers = fs.stats()["caller_tids"]
            names = {tid: Path(f"/proc/self/task/{tid}/comm").read_text().strip() for tid in callers}
        finally:
            store.close()
    assert store.path_reads["mmap"] == 100
    assert callers and loop_tid not in callers and threading.get_native_id() not in callers
    assert set(names.values()) == {"croupier-read"}, names  # the native pool's threads, by name


def _text_table(path: Path, rows: int, row_bytes: int = 3000) -> None:
    table = pa.table({"id": np.arange(rows, dtype=np.int64), "text": ["x" * row_bytes] * rows})
    with pa.ipc.new_file(path, table.schema) as w:
        w.write_table(table, max_chunksize=100)


@needs_native
@pytest.mark.parametrize("path", ["mmap", "direct"])
def test_a_file_truncated_under_its_mapping_or_a_direct_read_is_data_loss_naming_the_file_and_the_server_lives(serve_process, tmp_path: Path, path: str) -> None:
    # mmap: the copying thread faults past the new end (SIGBUS, caught); direct: the
    # O_DIRECT read ends short. Either way the row is truncated, as with a pread.
    root = tmp_path / "data"
    (root / "cut").mkdir(parents=True)
    (root / "kept").mkdir()
    _text_table(root / "cut" / "t.arrow", 10000)
    _text_table(root / "kept" / "t.arrow", 200)
    srv = serve_process(["--data-root", str(root), "--metrics-port", "0"], env={readpath.ENV: path})

    def loader(name: str) -> Loader:
        return Loader(name, servers=srv.address, batch_size=50, retry=RetryPolicy(max_retries=0))

    batches = loader("cut").batches()
    next(batches)  # the dataset is open and its file mapped
    with open(root / "cut" / "t.arrow", "r+b") as f:
        f.truncate(64 << 10)  # rows past the first ~20 now lie past the end of the file
    with pytest.raises(LoaderError) as info:
        for _ in batches:
            pass
    assert info.value.code == grpc.StatusCode.DATA_LOSS, str(info.value)
    assert "cut/t.arrow" in str(info.value) and "truncated" in str(info.value), str(info.value)
    assert srv.proc.poll() is None, srv.output()  # no SIGBUS took the server down
    assert sum(len(b.indices) for b in loader("kept").batches()) == 200
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics").read().decode()
    used = [ln for ln in text.splitlines() if ln.startswith(f'croupier_storage_path_reads_total{{path="{path}"}}')]
    assert used and float(used[0].split()[-1]) > 0, text  # the reads went by that path
    assert 'croupier_storage_read_path{fs_type=' in text and f'path="{path}"' in text


FORMATS = {
    "arrow-file": lambda d: write_arrow_file(d / "t.arrow", 300, batch_rows=16),
    "arrow-stream": lambda d: write_arrow_file(d / "t.arrows", 300, stream=True, batch_rows=16),
    "hf": lambda d: write_hf_dataset(d, 300),
    "parquet": lambda d: write_parquet(d / "t.parquet", 300, row_group_size=32),
    "webdataset": lambda d: write_webdataset(d, 60, shard_size=16),
}


@needs_native
@pytest.mark.parametrize("path", ["mmap", "direct"])
@pytest.mark.parametrize("kind", list(FORMATS))
def test_every_format_delivers_each_sample_exactly_once_per_epoch_on_the_mapped_and_direct_paths(serve_inprocess, tmp_path: Path, monkeypatch, kind: str, path: str) -> None:
    monkeypatch.setenv(readpath.ENV, path)
    root = tmp_path / "data"
    (root / kind).mkdir(parents=True)
    FORMATS[kind](root / kind)
    srv = serve_inprocess(data_roots=[str(root)])
    n = 60 if kind == "webdataset" else 300
    for epoch in range(2):
        seen: list[int] = []
        for rank in range(2):
            loader = Loader(kind, servers=srv.address, batch_size=8, rank=rank, world_size=2, seed=1,
                            decoding=ImageDecoding(output="none"), retry=RetryPolicy(max_retries=0))
            loader.set_epoch(epoch)
            seen.extend(int(i) for b in loader.batches() for i in b.indices)
        assert sorted(seen) == list(range(n)), (kind, epoch)
    [reader] = [r for r in srv.running.catalog.readers()]
    assert reader.store.path_reads[path] > 0 and reader.store.path_reads["pread"] == 0, reader.store.path_reads


@needs_native
def test_a_mapping_a_path_change_replaces_stays_readable_until_the_file_is_unpinned(source: Path) -> None:
    # A path change (a mount probed again) runs on its own thread while the loop may be
    # submitting a read on the mapping it just looked up: that mapping must stay open until
    # the file is unpinned, or the read fails ("the mapping is closed").
    path = str(source / "data.bin")
    store = LocalStore(io_threads=8, read_path="mmap")
    try:
        store.pin(path)
        held = store._maps[path]  # what a read on the loop has just looked up
        [choice] = store.read_paths()
        changed = threading.Thread(target=store._switch,
                                   args=(os.stat(path).st_dev, readpath.Choice(choice.mount, "pread", "probed again")))
        changed.start()
        changed.join()
        assert path not in store._maps  # new reads go by preads

        async def read_held() -> bytes:
            return await store.native.map_read(held, 4096 * 3 + 100, 1000)

        assert asyncio.run(read_held()) == (source / "data.bin").read_bytes()[4096 * 3 + 100:4096 * 3 + 1100]
        assert _read_pages(store, path, [5, 9])[0] == [(source / "data.bin").read_bytes()[p * PAGE + 100:p * PAGE + 1100]
                                                       for p in (5, 9)]
        store.unpin(path)
        with pytest.raises(ValueError, match="closed"):
            asyncio.run(read_held())  # closed with the pin
    finally:
        store.close()
