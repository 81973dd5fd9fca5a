"""The read-pool and S3 GET benchmarks run and count what they read (the read pool on local
files here; the benchmark itself runs it on the latency FS)."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from croupier.bench import readpool


@pytest.fixture
def blobs(tmp_path: Path) -> list[Path]:
    out = []
    for i in range(2):
        p = tmp_path / f"blob-{i}.bin"
        p.write_bytes(bytes(range(256)) * 1024)
        out.append(p)
    return out


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_the_raw_reader_does_every_read_on_its_threads(tmp_path: Path, blobs: list[Path]) -> None:
    binaries = readpool.build_raw(tmp_path)
    r = subprocess.run([str(binaries["threads"]), "threads", "500", "8", "100", "0", *map(str, blobs)],
                       capture_output=True, text=True, timeout=60, check=True)
    out = json.loads(r.stdout)
    assert out["reads"] == 500 and out["seconds"] > 0 and out["user_s"] >= 0 and out["system_s"] >= 0
    bad = subprocess.run([str(binaries["threads"]), "threads", "5", "0", "100", "0", str(blobs[0])],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "INFLIGHT" in bad.stderr


def test_the_pool_child_reads_through_croupiers_pool_and_splits_its_cpu(blobs: list[Path]) -> None:
    from croupier.server.storage import native

    if not native.available():
        pytest.skip("the native read pool is not built")
    r = subprocess.run([sys.executable, "-m", "croupier.bench.readpool", "--child", "--reads", "300", "--in-flight", "16",
                        "--size", "100", *map(str, blobs)], capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["reads"] == 300 and out["cpu_s"] >= out["loop_s"] >= 0 and out["read_threads_s"] >= 0


def test_the_report_gives_medians_per_read_and_says_what_did_not_run() -> None:
    runs = [{"reads": 1000, "seconds": s, "cpu_s": c, "loop_s": 0.01, "read_threads_s": 0.02, "daemon_s": 0.03}
            for s, c in [(1.0, 0.030), (0.5, 0.040), (2.0, 0.050)]]
    a = argparse.Namespace(reads=1000, size=100, in_flight=8, files=2, median_ms=5.0, rounds=3, against=["abc"], out=None)
    rep = readpool.summarize({"pool": runs}, {"io_uring": "liburing is not installed"}, a, 0.0, (0, 0, 0), (0, 0, 0))
    row = rep["rows"]["pool"]
    assert row["reads_per_s"] == 1000 and row["cpu_us"] == pytest.approx(40.0) and row["daemon_us"] == pytest.approx(30.0)
    assert "| pool | 1,000 | 40.0 | 10.0 | 20.0 | 30.0 |" in rep["markdown"]
    assert "io_uring | not run: liburing is not installed" in rep["markdown"]
    assert "--against abc" in rep["command"]


def test_the_s3_get_benchmark_measures_both_ways_on_a_real_server(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from croupier.bench import s3get

    out = tmp_path / "s3get.md"
    assert s3get.main(["--reads", "60", "--in-flight", "8", "--rounds", "1", "--latency-ms", "2", "--out", str(out)]) == 0
    md = out.read_text()
    assert "| through obstore | 8 |" in md and "| on the loop (s3http) | 8 |" in md
    runs = json.loads(out.with_suffix(".json").read_text())["results"]
    assert runs["direct | 8"][0]["direct_gets"] >= 60 and runs["obstore | 8"][0]["direct_gets"] == 0
    assert runs["obstore | 8"][0]["tokio_s"] > 0


def test_the_image_floor_reads_each_file_whole_through_the_storage_at_the_concurrency_asked(tmp_path: Path) -> None:
    # bench/cpu_per_sample.py's floor for one file a sample: bare C threads open, fstat, read
    # whole and close the same files; the FUSE daemon counts what reached it.
    from croupier.bench import latencyfs
    from croupier.bench.cpu_per_sample import floor_files
    from croupier.server.storage import native

    if not native.available():
        pytest.skip("the native read pool is not built (no C compiler)")
    why = latencyfs.check_available()
    if why:
        pytest.skip(f"latencyfs not available: {why}")
    src = tmp_path / "src"
    src.mkdir()
    sizes = [1000 + 37 * i for i in range(40)]
    for i, size in enumerate(sizes):
        (src / f"{i:03d}.jpg").write_bytes(bytes([i]) * size)
    with latencyfs.mounted(src, median_ms=2, sigma=0.5, max_background=latencyfs.KERNEL_DEFAULT) as fs:
        files = sorted(Path(fs.path).iterdir())
        fs.evict()
        fs.reset_stats()
        got = floor_files(files, 8)
        stats = fs.stats()
        assert got["errors"] == 0 and got["bytes"] == sum(sizes) and got["threads"] == 8
        assert stats["opens"] == len(files) and stats["bytes"] == sum(sizes)  # each file read whole, once
        assert 1 < len(stats["caller_tids"]) <= 8
        assert got["us_per_sample"] > 0 and got["path"] == "open+read+close"
    seconds, errors, threads, nbytes, cpu, skipped = native.measure_files([str(tmp_path / "missing")], 1)
    assert (errors, nbytes, skipped) == (1, 0, 0)
    # a byte bound: files that would pass it are opened and closed unread
    seconds, errors, threads, nbytes, cpu, skipped = native.measure_files([str(p) for p in sorted(src.iterdir())], 4,
                                                                          sum(sizes[:10]))
    assert errors == 0 and nbytes <= sum(sizes[:10]) and skipped > 0 and nbytes > 0


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_a_pool_of_a_revision_before_submit_ranges_is_still_driven_by_the_child(tmp_path: Path, blobs: list[Path]) -> None:
    # `--against REV` compiles REV's pool: one from before Pool.submit_ranges (6d9c863) takes
    # its ranges one call each, as its own revision's Python did.
    try:
        so = readpool.build_pool("6d9c863", tmp_path)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"revision 6d9c863 is not in this clone's history: {exc}")
    r = subprocess.run([sys.executable, "-m", "croupier.bench.readpool", "--child", "--reads", "300", "--in-flight", "16",
                        "--size", "100", "--pool-so", str(so), *map(str, blobs)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["reads"] == 300 and out["read_threads_s"] >= 0
