"""The loop drains the native pool's completions at a pace set by the reads' own latency.

Reads of milliseconds land a few at a time, and each wake-up of the loop costs its Python
however few it hands over; so where the pool's moving mean latency (measured by the pool
itself, queued to done) makes a pace worth a timer, completions signalled within a pace of
the last drain wait for one timed drain, and nothing is lost. Reads faster than that (a
local disk) are drained as each is signalled. Real native pools on real files, and on a
real latencyfs mount for the latency the pool measures.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from croupier.bench import latencyfs
from croupier.server.storage import native

pytestmark = pytest.mark.skipif(not native.available(), reason="the native read pool is not built (no C compiler)")


class _Latency:
    """The pool's C object with its measured latency set by the test (all else the real pool's)."""

    def __init__(self, inner: Any, latency: float):
        self.inner, self.latency = inner, latency

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _counted(pool: native.NativeReadPool) -> list[int]:
    """How many completions each drain of `pool` handed over, in order."""
    drains: list[int] = []
    real = pool._pool

    class Counting(_Latency):
        def drain(self) -> list:
            got = real.drain()
            drains.append(len(got))
            return got

    pool._pool = Counting(real, real.latency)  # latency: set by each test
    return drains


def _file(tmp_path: Path) -> tuple[int, bytes]:
    data = os.urandom(1 << 16)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY), data


def _paced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
           threads: int) -> tuple[int, bytes, native.NativeReadPool, list[int]]:
    """A file, and a pool whose pace is half a second (PACE_SHARE of its latency, at most
    PACE_MAX_S): long enough for page-cached reads to land inside it on any machine."""
    fd, data = _file(tmp_path)
    pool = native.NativeReadPool(threads)
    drains = _counted(pool)
    monkeypatch.setattr(native, "PACE_MAX_S", 0.5)
    pool._pool.latency = 0.5 / native.PACE_SHARE
    return fd, data, pool, drains


def test_completions_within_a_pace_of_the_last_drain_land_together_in_one_timed_drain(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fd, data, pool, drains = _paced(tmp_path, monkeypatch, 8)

    async def main() -> None:
        assert await pool.pread(fd, 0, 100) == data[:100]  # the first drain: at once, nothing before it
        assert drains == [1]
        pacer = pool._pacers[asyncio.get_running_loop()]
        futures = [pool.pread(fd, i * 1000, 1000) for i in range(20)]
        while pacer.handle is None:  # signalled within the pace: the eventfd cleared, one drain timed
            assert not any(f.done() for f in futures)
            await asyncio.sleep(0)
        assert drains == [1] and not any(f.done() for f in futures)
        got = await asyncio.gather(*futures)
        assert got == [data[i * 1000:(i + 1) * 1000] for i in range(20)]

    try:
        asyncio.run(main())
    finally:
        os.close(fd)
        pool.close()
    # The 20 landed long before the pace ended (page-cached reads, at most 8 threads): all in
    # the one timed drain, none lost, none twice.
    assert drains == [1, 20]


def test_reads_faster_than_a_pace_worth_a_timer_are_drained_as_each_is_signalled(tmp_path: Path) -> None:
    fd, data = _file(tmp_path)
    pool = native.NativeReadPool(8)
    drains = _counted(pool)
    pool._pool.latency = native.PACE_MIN_S / native.PACE_SHARE / 2  # a pace under the least worth a timer

    async def main() -> None:
        for i in range(10):
            assert await pool.pread(fd, i * 100, 100) == data[i * 100:(i + 1) * 100]
            assert drains == [1] * (i + 1)  # drained at once, each
            assert pool._pacers[asyncio.get_running_loop()].handle is None

    try:
        asyncio.run(main())
    finally:
        os.close(fd)
        pool.close()


def test_a_closed_pool_cancels_its_timed_drain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fd, _, pool, drains = _paced(tmp_path, monkeypatch, 4)

    async def main() -> None:
        await pool.pread(fd, 0, 10)
        pacer = pool._pacers[asyncio.get_running_loop()]
        pool.pread(fd, 10, 10)
        while pacer.handle is None:
            await asyncio.sleep(0)
        handle = pacer.handle
        pool.close()
        assert pacer.handle is None and handle.cancelled()

    try:
        asyncio.run(main())
    finally:
        os.close(fd)
    assert drains == [1]


def test_the_pool_measures_its_reads_latency_queued_to_done(tmp_path: Path) -> None:
    reason = latencyfs.check_available()
    if reason:
        pytest.skip(reason)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"{i}.bin").write_bytes(os.urandom(4096))
    pool = native.NativeReadPool(16)
    assert pool.latency == 0.0  # no read yet
    with latencyfs.mounted(src, median_ms=20, distribution="fixed", max_background=latencyfs.KERNEL_DEFAULT) as fs:
        fs.evict()

        async def main() -> list[bytes | None]:
            got: list[bytes | None] = [None] * 8
            done = asyncio.Event()

            def landed(i: int, data: bytes | None, err: OSError | None) -> None:
                assert err is None, err
                got[i] = data
                if all(g is not None for g in got):
                    done.set()
            for i in range(8):
                pool.read_path_then(str(Path(fs.path) / f"{i}.bin"), None, lambda d, e, i=i: landed(i, d, e))
            await asyncio.wait_for(done.wait(), 60)
            return got

        try:
            got = asyncio.run(main())
        finally:
            latency = pool.latency
            pool.close()
    assert got == [(src / f"{i}.bin").read_bytes() for i in range(8)]
    # Every read waited for the daemon's 20 ms at least: so did their mean, and with it the
    # pace (the whole of PACE_MAX_S at this latency).
    assert latency >= 0.020
    assert native.pace_for(latency) == native.PACE_MAX_S
