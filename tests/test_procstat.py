"""The benchmarks' per-thread CPU accounting: exact for threads that run in short bursts,
and the native read threads named so a report can tell them apart."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from croupier.bench.procstat import thread_cpu
from croupier.server.storage import native


def _burn(seconds: float, started: threading.Event, done: threading.Event) -> None:
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass
    started.set()
    done.wait(30)


def test_threads_that_ran_under_a_tick_each_are_still_counted() -> None:
    # 20 threads of 4 ms CPU each: /proc's tick counts (10 ms) show each as 0, so a tick
    # based sum finds almost none of their 80 ms; the scheduler's ns count finds all of it.
    done = threading.Event()
    threads = []
    for _ in range(20):
        started = threading.Event()
        t = threading.Thread(target=_burn, args=(0.004, started, done))
        t.start()
        started.wait(30)
        threads.append(t)
    try:
        ids = {t.native_id for t in threads}
        per_thread = {tid: cpu for tid, (_, _, _, cpu) in thread_cpu().items() if tid in ids}
        assert len(per_thread) == 20
        assert sum(per_thread.values()) >= 0.06
        assert all(v >= 0.003 for v in per_thread.values())
    finally:
        done.set()
        for t in threads:
            t.join()


@pytest.mark.skipif(not native.available(), reason="croupier's native read pool is not built (no C compiler)")
def test_native_read_threads_carry_their_own_name(tmp_path: Path) -> None:
    f = tmp_path / "x.bin"
    f.write_bytes(b"0123456789")

    async def read_and_look() -> tuple[bytes, list[str]]:
        pool = native.NativeReadPool(4)
        try:
            data = await pool.pread_path(str(f), 2, 3)
            return data, [name for name, *_ in thread_cpu().values()]
        finally:
            pool.close()

    data, names = asyncio.run(read_and_look())
    assert data == b"234"
    assert "croupier-read" in names
