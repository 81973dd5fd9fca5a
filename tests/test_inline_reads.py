"""Ranges the page cache holds, read on the loop (LocalStore, `native.read_nowait`: preadv2
with RWF_NOWAIT): on a local file system a group whose pages are all cached is read at once,
with no read thread started, and handed over on a later turn of the loop; a group with a
page missing, over the byte bound, or past the end of the file goes to the threads; FUSE
refuses RWF_NOWAIT, and its files are not asked again. Real files, a real FUSE mount."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from croupier.bench import latencyfs
from croupier.server.storage import local, native
from croupier.server.storage.local import LocalStore

needs_native = pytest.mark.skipif(native.read_nowait is None or not native.available(),
                                  reason="the native read pool is not built (no C compiler)")
_REASON = latencyfs.check_available()
needs_fuse = pytest.mark.skipif(_REASON is not None, reason=f"latencyfs unusable here: {_REASON}")

FILE_BYTES = 1 << 20


@pytest.fixture()
def data_file(tmp_path: Path) -> tuple[str, bytes]:
    payload = random.Random(3).randbytes(FILE_BYTES)
    f = tmp_path / "data.bin"
    f.write_bytes(payload)
    return str(f), payload


@contextlib.contextmanager
def _pinned(path: str) -> Iterator[LocalStore]:
    """A store (its defaults) with `path` pinned, closed after."""
    store = LocalStore(io_threads=8)
    try:
        store.pin(path)
        yield store
    finally:
        store.close()


def _submit(store: LocalStore, path: str, groups: list[list[tuple[int, int]]]) -> tuple[list[list[bytes]], list[str]]:
    """Each group in one `submit_ranges` call on a fresh loop; the parts of each, and the
    order of events: 'returned' after each call, 'landed' as each callback runs."""
    events: list[str] = []

    async def go() -> list[list[bytes]]:
        loop = asyncio.get_running_loop()
        futs = []
        for ranges in groups:
            fut: asyncio.Future[list[bytes]] = loop.create_future()

            def landed(parts, err, fut=fut) -> None:
                events.append("landed")
                fut.set_exception(err) if err is not None else fut.set_result(parts)

            assert store.submit_ranges(path, ranges, landed)
            events.append("returned")
            futs.append(fut)
        return list(await asyncio.gather(*futs))

    return asyncio.run(go()), events


@needs_native
def test_cached_groups_are_read_on_the_loop_with_no_thread(data_file: tuple[str, bytes]) -> None:
    path, payload = data_file
    rng = random.Random(1)
    groups = [[(o, rng.randrange(1, 5000)) for o in rng.sample(range(FILE_BYTES - 5000), 32)] for _ in range(10)]
    with _pinned(path) as store:
        got, events = _submit(store, path, groups)
        assert got == [[payload[o:o + s] for o, s in g] for g in groups]
        # never inside the call: each callback on a later turn, after every call returned
        assert events == ["returned"] * 10 + ["landed"] * 10, events
        assert store.inline_reads == 320 and store.path_reads["pread"] == 320
        assert store.threads == 0  # no read thread was ever started
        assert store.stats.reads == 320 and store.stats.in_flight == 0
        assert store.stats.bytes == sum(s for g in groups for _, s in g)


@needs_native
def test_groups_over_the_bound_or_past_the_end_go_to_the_threads(data_file: tuple[str, bytes]) -> None:
    path, payload = data_file
    big = [(0, local.INLINE_MAX_BYTES), (FILE_BYTES // 2, 1)]  # one byte over the bound in all
    end = [(10, 100), (FILE_BYTES - 50, 100), (FILE_BYTES + 10, 5)]  # a short read, one past the end
    with _pinned(path) as store:
        got, _ = _submit(store, path, [big, end])
        assert got == [[payload[:local.INLINE_MAX_BYTES], payload[FILE_BYTES // 2:FILE_BYTES // 2 + 1]],
                       [payload[10:110], payload[FILE_BYTES - 50:], b""]]
        assert store.inline_reads == 0 and store.path_reads["pread"] == 5 and store.threads >= 1


@needs_native
def test_a_group_with_a_page_out_of_the_cache_goes_to_the_threads(data_file: tuple[str, bytes]) -> None:
    path, payload = data_file
    cold, probe = FILE_BYTES - 8192, 256 << 10  # far apart: the probe's miss may read its own page in
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages leave the cache (ext4, xfs; not tmpfs)
        try:
            os.preadv(fd, [bytearray(10)], probe, os.RWF_NOWAIT)
            pytest.skip("this file system keeps the pages (tmpfs?): nothing to show")
        except BlockingIOError:
            pass
    finally:
        os.close(fd)
    with _pinned(path) as store:
        warm = [(0, 100)]
        _submit(store, path, [warm])  # its page is read into the cache (by the threads, it was out)
        inline_before, pread_before = store.inline_reads, store.path_reads["pread"]
        got, _ = _submit(store, path, [warm, [(0, 100), (cold, 10)]])
        assert got == [[payload[:100]], [payload[:100], payload[cold:cold + 10]]]
        # the cached group inline; the one with a cold page all on the threads, none read twice
        assert store.inline_reads - inline_before == 1 and store.path_reads["pread"] - pread_before == 3
        assert store.threads >= 1


@needs_native
def test_turned_off_every_read_goes_to_the_threads(data_file: tuple[str, bytes], monkeypatch) -> None:
    path, payload = data_file
    monkeypatch.setenv(local.INLINE_ENV, "0")
    with _pinned(path) as store:
        got, _ = _submit(store, path, [[(5, 10), (70_000, 3)]])
        assert got == [[payload[5:15], payload[70_000:70_003]]]
        assert store.inline_reads == 0 and store.threads >= 1


@needs_native
@needs_fuse
def test_fuse_refuses_and_its_file_is_not_asked_again(tmp_path: Path) -> None:
    payload = random.Random(5).randbytes(64 << 10)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "data.bin").write_bytes(payload)
    with latencyfs.mounted(tmp_path / "src", median_ms=1, distribution="fixed") as fs:
        path = str(fs.path / "data.bin")
        store = LocalStore(io_threads=8, read_path="pread")  # forced: a FUSE mount's preads, unprobed
        try:
            store.pin(path)
            # a FUSE mount is not a local file system: never tried
            assert path not in store._inline
            got, _ = _submit(store, path, [[(0, 10)], [(100, 10)]])
            assert got == [[payload[:10]], [payload[100:110]]] and store.inline_reads == 0
        finally:
            store.close()
    # asked directly, FUSE says no (the store would drop the file at the first refusal)
    with latencyfs.mounted(tmp_path / "src", median_ms=1, distribution="fixed") as fs:
        fd = os.open(fs.path / "data.bin", os.O_RDONLY)
        try:
            os.pread(fd, 10, 0)
            with pytest.raises(OSError) as err:
                native.read_nowait(fd, [(0, 10)], 1 << 20)
            assert err.value.errno == 95  # EOPNOTSUPP
        finally:
            os.close(fd)


@needs_native
def test_read_nowait_reads_what_pread_reads_or_says_none(data_file: tuple[str, bytes]) -> None:
    path, payload = data_file
    fd = os.open(path, os.O_RDONLY)
    try:
        ranges = [(0, 1), (4095, 2), (FILE_BYTES - 1, 1), (12345, 65536)]
        assert native.read_nowait(fd, ranges, 1 << 20) == [os.pread(fd, s, o) for o, s in ranges]
        assert native.read_nowait(fd, [], 1 << 20) == []
        assert native.read_nowait(fd, [(0, 10), (10, 10)], 19) is None  # over the bound: nothing read
        assert native.read_nowait(fd, [(FILE_BYTES - 5, 10)], 1 << 20) is None  # short: the pool's read says so
        assert native.read_nowait(fd, [(0, -1)], 1 << 20) is None  # to the end: a size the pool finds
        with pytest.raises(TypeError):
            native.read_nowait(fd, [(0,)], 1 << 20)
    finally:
        os.close(fd)


@needs_native
@pytest.mark.parametrize("inline", ["1", "0"])
def test_a_server_delivers_every_row_as_written_with_reads_inline_or_not(serve_process, tmp_path: Path,
                                                                        inline: str) -> None:
    import urllib.request

    import numpy as np
    import pyarrow as pa

    from croupier.client import Loader, RetryPolicy

    root = tmp_path / "data"
    (root / "t").mkdir(parents=True)
    rng = random.Random(11)
    texts = [rng.randbytes(rng.randrange(1, 3000)).hex() for _ in range(700)]
    table = pa.table({"id": np.arange(700, dtype=np.int64), "text": texts})
    with pa.ipc.new_file(root / "t" / "t.arrow", table.schema) as w:
        w.write_table(table, max_chunksize=64)
    srv = serve_process(["--data-root", str(root), "--metrics-port", "0"], env={local.INLINE_ENV: inline})
    for epoch in range(2):
        got: dict[int, str] = {}
        for rank in range(2):
            loader = Loader("t", servers=srv.address, batch_size=32, rank=rank, world_size=2, seed=3, format="numpy",
                            retry=RetryPolicy(max_retries=0))
            loader.set_epoch(epoch)
            for b in loader.batches():
                for i, row_id, text in zip(b.indices, b.data["id"], b.data["text"]):
                    assert int(i) == int(row_id) and int(i) not in got
                    got[int(i)] = text.decode() if isinstance(text, bytes) else str(text)
        assert got == dict(enumerate(texts)), epoch
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics").read().decode()
    [count] = [float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith("croupier_storage_inline_reads_total")]
    assert (count > 0) if inline == "1" else (count == 0), count
