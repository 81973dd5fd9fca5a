"""latencyfs: the FUSE file system that makes storage really slow for the benchmarks.

Skipped, with the reason, where it cannot be built or mounted (no /dev/fuse, no
libfuse3-dev: see bench/native/install-deps.sh). Concurrency is proven by the
daemon's own counters, not by wall-clock seconds.
"""

from __future__ import annotations

import errno
import json
import os
import random
import statistics
import subprocess
import sys
import threading

import pytest

from croupier.bench import latencyfs

_REASON = latencyfs.check_available()
needs_fuse = pytest.mark.skipif(_REASON is not None, reason=f"latencyfs unusable here: {_REASON}")

BIG = 5 * 1024 * 1024 + 123  # a multi-MB file with a ragged tail
SIZES = {"empty": 0, "one": 1, "page-1": 4095, "page": 4096, "page+1": 4097, "meg+3": (1 << 20) + 3}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("latencyfs-src")
    rng = random.Random(7)
    files = {}
    for name, size in SIZES.items():
        files[name] = rng.randbytes(size)
        (root / name).write_bytes(files[name])
    files["big"] = rng.randbytes(BIG)
    (root / "big").write_bytes(files["big"])
    (root / "sub").mkdir()
    (root / "sub" / "inner.txt").write_bytes(b"inner\n")
    (root / "link").symlink_to("one")
    conc = root / "conc"
    conc.mkdir()
    for i in range(64):
        (conc / f"f{i:02d}").write_bytes(bytes([i]) * 8192)
    return {"root": root, "files": files}


def _pread_all(fd: int, size: int) -> bytes:
    return os.pread(fd, size + 10, 0)


# ---- no mount needed -------------------------------------------------------------

def test_reasons_name_what_to_install(monkeypatch):
    src = latencyfs._NATIVE / "latencyfs.c"
    real_which = latencyfs.shutil.which
    cc = latencyfs._compiler()
    monkeypatch.setattr(latencyfs.shutil, "which", lambda cmd: None if cmd == cc else real_which(cmd))
    with pytest.raises(RuntimeError, match="gcc"):
        latencyfs.build(src)
    monkeypatch.setattr(latencyfs.shutil, "which", lambda cmd: f"/usr/bin/{cmd}")

    def no_fuse3():
        raise subprocess.CalledProcessError(1, "pkg-config", stderr="Package fuse3 was not found")
    monkeypatch.setattr(latencyfs, "_pkg_config_fuse3", no_fuse3)
    with pytest.raises(RuntimeError, match="apt-get install fuse3 libfuse3-dev pkg-config"):
        latencyfs.build(src)


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="distribution"):
        with latencyfs.mounted(tmp_path, median_ms=1, distribution="pareto"):
            pass
    with pytest.raises(ValueError):
        latencyfs.daemon_args(median_ms=-1)


@needs_fuse
def test_print_delays_deterministic_and_seeded():
    a = latencyfs.print_delays(20_000, median_ms=5, sigma=0.5, seed=1)
    b = latencyfs.print_delays(20_000, median_ms=5, sigma=0.5, seed=1)
    c = latencyfs.print_delays(20_000, median_ms=5, sigma=0.5, seed=2)
    assert len(a) == 20_000 and a == b
    assert a != c and sum(x == y for x, y in zip(a, c)) < 10
    for delays in (a, c):
        assert abs(statistics.median(delays) - 5) < 0.5
        assert min(delays) > 0
    # lognormal: ln(delay) ~ N(ln 5, 0.5^2)
    import math
    logs = [math.log(x) for x in a]
    assert abs(statistics.pstdev(logs) - 0.5) < 0.025
    # a prefix is the same whatever K: delay k depends on (seed, k) only
    assert latencyfs.print_delays(100, median_ms=5, sigma=0.5, seed=1) == a[:100]

    u = latencyfs.print_delays(20_000, median_ms=8, distribution="uniform", seed=3)
    assert abs(statistics.median(u) - 8) < 0.8 and 0 <= min(u) and max(u) <= 16
    assert set(latencyfs.print_delays(50, median_ms=2.5, distribution="fixed", seed=9)) == {2.5}


# ---- through a mount -------------------------------------------------------------

@needs_fuse
def test_bytes_through_the_mount_equal_the_source(source, tmp_path):
    files = source["files"]
    with latencyfs.mounted(source["root"], tmp_path / "mnt", median_ms=0.05, sigma=0.5, seed=1) as fs:
        assert fs.path == (tmp_path / "mnt").resolve()
        names = sorted(os.listdir(fs.path))
        assert names == sorted([*files, "sub", "link", "conc"])  # the virtual files are not listed
        for name, data in files.items():
            assert (fs.path / name).read_bytes() == data, name
            assert os.stat(fs.path / name).st_size == len(data)
        assert (fs.path / "sub" / "inner.txt").read_bytes() == b"inner\n"
        assert os.readlink(fs.path / "link") == "one"
        assert (fs.path / "link").read_bytes() == files["one"]

        big = files["big"]
        rng = random.Random(0)
        fd = os.open(fs.path / "big", os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            for _ in range(300):
                off = rng.randrange(0, BIG + 100)
                n = rng.choice([1, 100, 1024, 4096, 5000, 70_000, 300_000])
                assert os.pread(fd, n, off) == big[off:off + n]
        finally:
            os.close(fd)

        with pytest.raises(OSError) as e:
            (fs.path / "new").write_bytes(b"x")
        assert e.value.errno in (errno.EROFS, errno.EACCES)
        with pytest.raises(OSError):
            open(fs.path / "one", "r+b")


@needs_fuse
def test_stats_count_requests_and_bytes(source):
    with latencyfs.mounted(source["root"], median_ms=1, distribution="fixed", seed=0) as fs:
        fd = os.open(fs.path / "big", os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: one page, one request
            fs.reset_stats()
            s0 = fs.stats()
            assert s0["requests"] == 0 and s0["bytes"] == 0 and s0["in_flight"] == 0
            for page in (3, 100, 900):
                assert len(os.pread(fd, 512, page * 4096 + 8)) == 512
            s1 = fs.stats()
            s2 = fs.stats()  # reading the stats is neither delayed nor counted
        finally:
            os.close(fd)
        assert s1["requests"] == s2["requests"] == 3
        assert s1["bytes"] == 3 * 4096  # what the daemon returned: whole pages
        assert s1["request_sizes"]["le_4k"] == 3
        assert s1["delay_ms_total"] == pytest.approx(3.0)
        assert s1["slept_ms_total"] >= 3.0
        assert s1["max_in_flight"] == 1 and s1["errors"] == 0
        assert s1["config"] == {**s1["config"], "distribution": "fixed", "median_ms": 1, "seed": 0}
        assert s1["pid"] == fs.pid and s1["libfuse"].startswith("3.")

        # a whole-file read: bytes returned = the file's size, in readahead-sized requests
        fs.reset_stats()
        assert (fs.path / "meg+3").read_bytes() == source["files"]["meg+3"]
        s = fs.stats()
        assert s["bytes"] == SIZES["meg+3"]
        assert 1 <= s["requests"] <= SIZES["meg+3"] // 4096 + 1
        assert s["max_request_bytes"] <= s["kernel"]["max_readahead"]

        # the CLI reads the same file
        out = subprocess.run([sys.executable, "-m", "croupier.bench.latencyfs", "stats", str(fs.path)],
                             capture_output=True, text=True, check=True).stdout
        assert json.loads(out)["bytes"] == SIZES["meg+3"]


@needs_fuse
def test_64_reads_sleep_at_once(source):
    n = 64
    with latencyfs.mounted(source["root"], median_ms=300, distribution="fixed", seed=0) as fs:
        fds = [os.open(fs.path / "conc" / f"f{i:02d}", os.O_RDONLY) for i in range(n)]
        try:
            fs.reset_stats()
            start = threading.Barrier(n)
            got: list[bytes] = [b""] * n

            def one(i: int) -> None:
                start.wait()
                got[i] = os.pread(fds[i], 1024, 4096)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            s = fs.stats()
        finally:
            for fd in fds:
                os.close(fd)
        assert got == [bytes([i]) * 1024 for i in range(n)]
        assert s["requests"] == n
        assert s["max_in_flight"] == n, s
        assert s["in_flight"] == 0
        assert s["delay_ms_total"] == pytest.approx(300.0 * n)


@needs_fuse
def test_evict_makes_cached_pages_cold_again(source):
    import mmap
    with latencyfs.mounted(source["root"], median_ms=0) as fs:
        fd = os.open(fs.path / "big", os.O_RDONLY)
        m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        try:
            m.madvise(mmap.MADV_RANDOM)
            pages = [p * 4096 for p in range(0, BIG // 4096, 97)]

            def touch() -> int:
                fs.reset_stats()
                assert bytes(m[o] for o in pages) == bytes(source["files"]["big"][o] for o in pages)
                return fs.stats()["requests"]

            assert touch() == len(pages)
            assert touch() == 0  # cached, and mapped
            assert fs.evict() == len(source["files"]) + 1 + 64  # + sub/inner.txt + conc/*
            assert touch() == len(pages)
            assert fs.evict([fs.path / "big"]) == 1
            assert touch() == len(pages)
        finally:
            m.close()
            os.close(fd)


@needs_fuse
def test_reset_restarts_the_delay_sequence(source):
    with latencyfs.mounted(source["root"], median_ms=0.2, sigma=1.0, seed=5) as fs:
        expected = latencyfs.print_delays(1, median_ms=0.2, sigma=1.0, seed=5)[0]
        fd = os.open(fs.path / "big", os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            os.pread(fd, 10, 0)
            fs.reset_stats()
            os.pread(fd, 10, 40960)  # request k = 0 again
        finally:
            os.close(fd)
        s = fs.stats()
        assert s["requests"] == 1 and s["resets"] == 1
        assert s["delay_ms_total"] == pytest.approx(expected, abs=2e-6)


@needs_fuse
def test_unmounted_after_the_block_even_when_it_raised(source, tmp_path):
    with latencyfs.mounted(source["root"], median_ms=0) as fs:
        path, proc = fs.path, fs.process
        assert latencyfs.is_mounted(path)
    assert not latencyfs.is_mounted(path) and proc.returncode == 0
    assert not path.exists()  # the temporary mount point is removed

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with pytest.raises(RuntimeError, match="boom"):
        with latencyfs.mounted(source["root"], mnt, median_ms=0) as fs:
            proc = fs.process
            busy = open(fs.path / "big", "rb")  # keeps the mount busy: a lazy unmount
            busy.read(10)
            raise RuntimeError("boom")
    try:
        assert not latencyfs.is_mounted(mnt)
        assert proc.returncode is not None  # reaped
        assert mnt.is_dir() and os.listdir(mnt) == []  # the caller's folder stays, empty
    finally:
        busy.close()
