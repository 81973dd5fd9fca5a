"""A daemon-bound mount's reads are held at a gate (server/storage/gate.py): at most its
limit in flight at the storage, the rest started in the order asked as reads land; a
mount with no such cap has no gate.

The gate's own accounting is driven by hand-made futures (no clock: order and counts);
the store's by a latencyfs daemon with one worker thread, which serves one request at a
time whatever the read path, as rclone mount serves a file's reads.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from croupier.bench import latencyfs
from croupier.server.metrics import StorageStats
from croupier.server.storage import native, readpath
from croupier.server.storage.gate import ReadGate
from croupier.server.storage.local import LocalStore

_REASON = latencyfs.check_available()
needs_fuse = pytest.mark.skipif(_REASON is not None, reason=f"latencyfs unusable here: {_REASON}")
needs_native = pytest.mark.skipif(native.measure is None, reason="croupier's native read pool is not built")


def test_a_gate_starts_reads_in_order_as_earlier_ones_land_and_never_more_than_its_limit() -> None:
    async def main() -> None:
        gate = ReadGate(3)
        started: list[int] = []
        inner: dict[int, asyncio.Future[int]] = {}
        loop = asyncio.get_running_loop()

        def start(i: int):
            def go() -> asyncio.Future[int]:
                started.append(i)
                inner[i] = loop.create_future()
                return inner[i]
            return go

        outer = [gate.run(start(i)) for i in range(8)]
        assert started == [0, 1, 2] and gate.in_flight == 3 and gate.waiting == 5 and gate.queued == 5
        outer[4].cancel()  # a stream gone while its read waits: the read is never issued
        inner[1].set_result(1)
        await asyncio.sleep(0)
        assert started == [0, 1, 2, 3] and gate.in_flight == 3
        for i in (0, 2, 3):
            inner[i].set_result(i)
        await asyncio.sleep(0)
        assert started == [0, 1, 2, 3, 5, 6, 7], "the cancelled read was started"
        inner[5].set_exception(OSError("EIO"))
        inner[6].set_result(6)
        inner[7].set_result(7)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert [await outer[i] for i in (0, 1, 2, 3, 6, 7)] == [0, 1, 2, 3, 6, 7]
        with pytest.raises(OSError, match="EIO"):
            await outer[5]
        assert outer[4].cancelled()
        assert gate.in_flight == 0 and gate.peak == 3 and gate.waiting == 0

    asyncio.run(main())


def test_a_group_larger_than_the_limit_goes_alone_and_a_raised_limit_starts_what_waits() -> None:
    async def main() -> None:
        gate = ReadGate(4)
        log: list[str] = []
        gate.submit(2, lambda: log.append("a2"))
        gate.submit(8, lambda: log.append("b8"))  # waits for the 2 in flight, then goes alone
        gate.submit(1, lambda: log.append("c1"))  # behind it: order is kept
        assert log == ["a2"] and gate.waiting == 9
        gate.release(2)
        assert log == ["a2", "b8"] and gate.in_flight == 8 and gate.peak == 8
        gate.release(8)
        assert log == ["a2", "b8", "c1"]
        gate.submit(4, lambda: log.append("d4"))
        assert log[-1] == "c1" and gate.waiting == 4
        gate.set_limit_threadsafe(5)
        assert log[-1] == "d4" and gate.in_flight == 5

    asyncio.run(main())


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    src = tmp_path_factory.mktemp("gate-src")
    data = os.urandom(4 << 20)
    (src / "data.arrow").write_bytes(data)
    return src, data


async def _read_many(store: LocalStore, path: str, offsets: list[int]) -> list[bytes]:
    return list(await asyncio.gather(*(store.read(path, o, 1024) for o in offsets)))


@needs_fuse
@needs_native
def test_a_daemon_that_serves_one_read_at_a_time_gets_a_gate_its_reads_wait_at(table: tuple[Path, bytes]) -> None:
    src, data = table
    offsets = [i * 61_441 % (len(data) - 1024) for i in range(48)]
    with latencyfs.mounted(src, median_ms=2, distribution="fixed", max_threads=1,
                           max_background=latencyfs.KERNEL_DEFAULT) as fs:
        store = LocalStore(io_threads=64)
        try:
            path = str(fs.path / "data.arrow")
            store.pin(path)
            (choice,) = store.read_paths()
            assert readpath.daemon_bound(choice), choice
            (gate,) = store.gates().values()
            assert gate.limit == readpath.read_limit(choice) and 2 <= gate.limit <= 4, (gate.limit, choice.ceilings)
            got = asyncio.run(_read_many(store, path, offsets))
            assert got == [data[o:o + 1024] for o in offsets]
            # 48 asked at once: the storage saw at most the limit, the rest waited here
            assert gate.peak == gate.limit and gate.queued == 48 - gate.limit and gate.in_flight == 0
            assert store.path_reads[choice.path] == 48
            stats = StorageStats()
            stats.add(store)
            metrics = {(m.name, tuple(s.labels.values())): s.value for m in stats.collect() for s in m.samples}
            point = choice.mount.point
            assert metrics[("croupier_storage_read_limit", (point,))] == gate.limit
            assert metrics[("croupier_storage_reads_waiting", (point,))] == 0
            # measured again uncapped (its daemon given more threads, say): the gate goes
            store._gate(os.stat(path).st_dev,
                        readpath.Choice(choice.mount, "pread", "measured", ceilings={"pread": 60.0}))
            assert store.gates() == {} and gate.limit == 1 << 30
            store.unpin(path)
        finally:
            store.close()


@needs_fuse
@needs_native
def test_a_mount_whose_cap_is_the_kernels_has_no_gate(table: tuple[Path, bytes]) -> None:
    src, data = table
    with latencyfs.mounted(src, median_ms=20, sigma=0.25, max_background=latencyfs.KERNEL_DEFAULT) as fs:
        store = LocalStore(io_threads=64)
        try:
            path = str(fs.path / "data.arrow")
            store.pin(path)
            (choice,) = store.read_paths()
            assert choice.capped() and not readpath.daemon_bound(choice), choice
            assert store.gates() == {}
            assert asyncio.run(_read_many(store, path, [0, 4096]))[1] == data[4096:5120]
            store.unpin(path)
        finally:
            store.close()


@needs_native
def test_a_mount_whose_daemon_serves_files_apart_in_parallel_has_its_preads_spread_over_descriptors(
    table: tuple[Path, bytes],
) -> None:
    # rclone mount serves an open file's reads one at a time but separate opens of it in
    # parallel: the probe times reads over HANDLES descriptors against one, and the store
    # spreads its preads over them; the bucket sees more than one GET at once.
    from croupier.bench import bucket_mount, s3server

    if bucket_mount.rclone_unusable() is not None:
        pytest.skip(f"no rclone mount here: {bucket_mount.rclone_unusable()}")
    _, data = table
    offsets = [i * 61_441 % (len(data) - 1024) for i in range(48)]
    with s3server.running(None, latency=s3server.Latency.fixed(20), process=True) as s3:
        s3.create_bucket("gated")
        s3.put("gated", "data.arrow", data)
        with bucket_mount.rclone_mounted(s3.endpoint, "gated") as mnt:
            store = LocalStore(io_threads=64)
            try:
                path = str(mnt / "data.arrow")
                store.pin(path)
                (choice,) = store.read_paths()
                assert readpath.daemon_bound(choice) and choice.path == "pread", choice
                assert choice.handles == readpath.HANDLES, (choice.rates, choice.spread)
                assert choice.spread is not None and choice.spread[1] >= readpath.MARGIN * choice.rates["pread"]
                assert f"pread over {readpath.HANDLES} descriptors" in readpath.rates_line(choice)
                (gate,) = store.gates().values()
                assert gate.limit == readpath.read_limit(choice) > readpath.READ_LIMIT_MIN
                s3.reset_stats()
                assert asyncio.run(_read_many(store, path, offsets)) == [data[o:o + 1024] for o in offsets]
                assert s3.stats()["max_in_flight"] > 1  # GETs at once: one descriptor gave one at a time
                store.unpin(path)
                assert store._extra_fds == {} and store._spread == {}
            finally:
                store.close()


def test_a_probe_again_keeps_a_daemon_bound_mounts_preads_spread_unless_a_path_beats_the_spread_rate() -> None:
    # Figures from a 20 ms rclone mount: through one descriptor every path made 29-46 reads/s
    # (about one at a time), preads spread over 8 descriptors 168. A probe again once took
    # O_DIRECT on that noise and dropped the spread: the gate fell from 9 reads to 2.
    mount = readpath.Mount(7, "/mnt/bucket", "fuse.rclone", "remote:bucket")

    def choice(path: str, rates: dict[str, float], ceilings: dict[str, float]) -> readpath.Choice:
        return readpath.Choice(mount, path, "measured", asked=1024, latency_s=0.025, rates=rates, ceilings=ceilings,
                               probe_concurrency=64)

    old = choice("pread", {"pread": 38, "direct": 36, "mmap": 44}, {"pread": 0.95, "direct": 0.9, "mmap": 1.1})
    old.handles, old.spread = 8, (8, 168.0)
    noisy = choice("direct", {"pread": 32, "direct": 46, "mmap": 29}, {"pread": 0.8, "direct": 1.15, "mmap": 0.73})
    assert readpath.daemon_bound(noisy) and readpath.keeps_spread(old, noisy)
    noisy.path, noisy.handles, noisy.spread = "pread", old.handles, old.spread  # what the store then does
    assert readpath.read_limit(noisy) == readpath.read_limit(old) == 9
    faster = choice("direct", {"pread": 32, "direct": 300, "mmap": 29}, {"pread": 0.8, "direct": 7.5, "mmap": 0.73})
    assert not readpath.keeps_spread(old, faster)  # beats 1.25 x 168: the new path wins
    freed = choice("mmap", {"pread": 32, "mmap": 2000}, {"pread": 0.8, "mmap": 50.0})
    assert not readpath.daemon_bound(freed) and not readpath.keeps_spread(old, freed)  # the daemon no longer the cap
    single = choice("pread", dict(old.rates), dict(old.ceilings))
    assert not readpath.keeps_spread(single, noisy)  # nothing was spread before


def test_a_daemon_bound_bucket_mount_is_told_its_clients_own_limit_and_the_option_that_lifts_it() -> None:
    # bench/results/mount-files.md: rclone held 12 requests at once with max_background raised to
    # 256 (--checkers + --transfers); the remedy names those options, not the kernel's knob.
    def bound(fs_type: str) -> tuple[readpath.Mount, readpath.Choice]:
        mount = readpath.Mount(7, "/mnt/bucket", fs_type, "remote:bucket")
        return mount, readpath.Choice(mount, "pread", "measured", asked=1024, latency_s=0.025,
                                      rates={"pread": 38, "mmap": 44}, ceilings={"pread": 0.95, "mmap": 1.1},
                                      probe_concurrency=64)
    mount, choice = bound("fuse.rclone")
    assert readpath.daemon_bound(choice)
    said = readpath.remedy(mount, 1024, choice)
    assert "--checkers" in said and "--use-server-modtime" in said and "its worker threads" not in said
    mount, choice = bound("fuse.latencyfs")  # a daemon nothing was measured for: the general advice
    said = readpath.remedy(mount, 1024, choice)
    assert "its worker threads" in said and "--checkers" not in said
