"""`croupier probe`: it finds a FUSE mount's cap and names the option that lifts it, picks the
read path the server would, reads no more than it says (counted by the storage itself), writes
nothing, and measures GETs of an object store through the server's ObjectStore.

The FUSE cases use latencyfs at 20 ms (sigma 0.25): slow enough that the machine's CPU
does not blur a cap of 12 against 64 reads asked for.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from s3_fixtures import CREDENTIALS, S3Backend

from croupier import cli
from croupier.bench import latencyfs
from croupier.bench.s3server import Latency, running
from croupier.server.storage import native

_REASON = latencyfs.check_available()
needs_fuse = pytest.mark.skipif(_REASON is not None, reason=f"latencyfs unusable here: {_REASON}")
needs_native = pytest.mark.skipif(native.measure is None, reason="croupier's native read pool is not built")

FILE_BYTES = 24 << 20


def _probe(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict | None, str]:
    rc = cli.main(["probe", *args, "--json"])
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if rc == 0 else None), err


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("probe-src")
    (src / "data-00000.arrow").write_bytes(os.urandom(FILE_BYTES))
    (src / "data-00001.arrow").write_bytes(os.urandom(FILE_BYTES // 4))
    return src


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(folder.rglob("*"))}


def _mounted_probe(source: Path, capsys, max_background: int | None, *args: str) -> tuple[dict, dict]:
    before = _snapshot(source)
    with latencyfs.mounted(source, median_ms=20, sigma=0.25, max_background=max_background) as fs:
        fs.reset_stats()
        rc, report, err = _probe(capsys, str(fs.path), "--max-concurrency", "128", *args)
        stats = fs.stats()
        assert rc == 0, err
    assert _snapshot(source) == before, "the probe changed the files it read"
    return report, stats


@needs_fuse
@needs_native
def test_kernel_default_cap_is_found_and_the_mapping_chosen(source: Path, capsys) -> None:
    report, stats = _mounted_probe(source, capsys, latencyfs.KERNEL_DEFAULT)
    pread, mmap = report["paths"]["pread"], report["paths"]["mmap"]
    assert 6 <= pread["ceiling_in_flight"] <= 16, pread  # the kernel's max_background of 12
    assert pread["knee_concurrency"] <= 32 and pread["stopped"].startswith("flat"), pread
    assert report["chosen"] == "mmap", report["reason"]
    assert any("max_background" in r for r in report["remedies"]), report["remedies"]
    assert mmap["ceiling_in_flight"] > 2 * pread["ceiling_in_flight"], (mmap, pread)
    # what it says it read is what reached the storage, one 4 KiB page a read (O_DIRECT:
    # the row's own 1,024 bytes, as FUSE wants no alignment, found by one 1-byte read;
    # capped like preads here, libfuse asking for async direct I/O)
    direct = report["paths"]["direct"]
    assert direct["bytes"] == (direct["reads"] - 1) * 1024 + 1 and direct["ceiling_in_flight"] <= 16, direct
    assert stats["bytes"] == report["bytes_read"] <= report["max_bytes"]
    assert stats["requests"] == pread["reads"] + mmap["reads"] + direct["reads"]
    assert stats["max_request_bytes"] <= 4096


@needs_fuse
@needs_native
def test_a_daemon_that_serves_one_read_at_a_time_is_named_as_the_cap_not_max_background(source: Path, capsys) -> None:
    # One libfuse worker: every request, page faults included, waits its turn in the
    # daemon (as rclone mount serves a file's reads): max_background is not the cap.
    before = _snapshot(source)
    with latencyfs.mounted(source, median_ms=5, distribution="fixed", max_threads=1,
                           max_background=latencyfs.KERNEL_DEFAULT) as fs:
        rc, report, err = _probe(capsys, str(fs.path), "--max-concurrency", "64")
        assert rc == 0, err
    assert _snapshot(source) == before
    pread, mmap = report["paths"]["pread"], report["paths"]["mmap"]
    # one worker measures 1.3-1.7 in flight (Little's law on a lone read's latency), so "about 1" or "about 2"
    assert pread["ceiling_in_flight"] < 2.5 and mmap["ceiling_in_flight"] < 2.5, (pread, mmap)
    said = [re.search(r"the FUSE daemon itself completes only about (\d+) reads at once", r) for r in report["remedies"]]
    assert [int(m[1]) for m in said if m] in ([1], [2]), (pread, mmap, report["remedies"])
    assert not any("echo 64" in r for r in report["remedies"]), report["remedies"]
    # as the server does on such a mount: preads spread over descriptors of a file timed, and not
    # used here (one worker thread serves every handle in turn), counted with the preads
    spread = report["spread"]
    assert spread["descriptors"] == 8 and spread["reads_per_s"] > 0 and not spread["used"], spread
    assert pread["reads"] >= 4 * 8


@needs_fuse
@needs_native
def test_raised_mount_keeps_preads(source: Path, capsys) -> None:
    report, stats = _mounted_probe(source, capsys, None)
    pread = report["paths"]["pread"]
    assert report["chosen"] == "pread", report["reason"]
    assert pread["ceiling_in_flight"] > 32, pread
    assert not any("max_background" in r for r in report["remedies"]), report["remedies"]
    assert stats["bytes"] == report["bytes_read"] <= report["max_bytes"]


@needs_fuse
@needs_native
def test_reads_stay_under_the_byte_bound(source: Path, capsys) -> None:
    bound = 1 << 20
    report, stats = _mounted_probe(source, capsys, None, "--max-bytes", "1MiB")
    assert report["max_bytes"] == bound
    assert stats["bytes"] == report["bytes_read"] <= bound
    assert any("--max-bytes" in p["stopped"] for p in report["paths"].values()), report["paths"]


def test_object_store_gets_scale_and_are_counted(capsys) -> None:
    row = 1024
    with running(None, latency=Latency.fixed(10), process=True) as srv:
        s3 = S3Backend("s3server", srv.endpoint, srv)
        bucket = s3.make_bucket({f"ds/part-{i}.arrow": os.urandom(256 << 10) for i in range(3)}
                                | {"other/x.bin": os.urandom(4096)})
        srv.reset_stats()
        options = [f"--storage-option={k}={v}" for k, v in {**CREDENTIALS, "endpoint": srv.endpoint}.items()]
        rc, report, err = _probe(capsys, f"s3://{bucket}/ds", "--max-concurrency", "64", *options)
        stats = srv.stats()
    assert rc == 0, err
    get = report["paths"]["get"]
    assert report["chosen"] == "get" and report["objects"] == 3
    # one listing (an S3 GET of the bucket) and one GET of `row` bytes a read, nothing else
    assert stats["by_method"] == {"GET": get["reads"] + 1} and stats["requests"] == get["reads"] + 1
    assert report["bytes_read"] == get["reads"] * row <= report["max_bytes"]
    assert get["reads"] * row < stats["bytes"] < get["reads"] * row + 64 * 1024
    sweep = {s["concurrency"]: s["reads_per_s"] for s in get["sweep"]}
    assert get["knee_concurrency"] >= 16 and sweep[16] > 4 * sweep[1], get  # GETs scale with concurrency
    assert stats["max_in_flight"] >= 16


@pytest.mark.parametrize("make, message", [
    (lambda tmp: str(tmp / "missing"), "no such file or folder"),
    (lambda tmp: str(tmp), "not a dataset's files: no files"),
    (lambda tmp: (tmp / ".hidden").write_bytes(b"x" * 8192) and str(tmp), "not a dataset's files: no files"),
    (lambda tmp: (tmp / "tiny").write_bytes(b"x" * 10) and str(tmp), "none with 1088 bytes or more"),
    (lambda tmp: "s3:///prefix", "no bucket"),
    (lambda tmp: "ftp://host/x", "unsupported storage scheme"),
])
def test_bad_targets_are_named_with_exit_code_2(tmp_path: Path, capsys, make, message: str) -> None:
    target = make(tmp_path)
    rc, _, err = _probe(capsys, target)
    assert rc == 2
    assert target in err and message in err, err


def test_missing_bucket_is_named(capsys) -> None:
    with running(None) as srv:
        options = [f"--storage-option={k}={v}" for k, v in {**CREDENTIALS, "endpoint": srv.endpoint}.items()]
        rc, _, err = _probe(capsys, "s3://no-such-bucket/ds", *options)
    assert rc == 2
    assert "s3://no-such-bucket" in err and "does not exist" in err, err


# ---- an ImageFolder: one file a sample, read whole ---------------------------------------


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("probe-images")
    for i in range(1_200):
        folder = src / f"class{i % 10}"
        folder.mkdir(exist_ok=True)
        (folder / f"{i:05d}.jpg").write_bytes(bytes([i % 251]) * (400 + i % 200))
    (src / "labels.txt").write_text("not an image: counted, never read\n")
    return src


@needs_fuse
@needs_native
def test_an_image_folder_is_probed_by_whole_file_reads_each_file_once_as_the_server_reads_it(image_folder: Path,
                                                                                             capsys) -> None:
    # Before: the range probe found no file large enough and printed 0 samples/s.
    report, stats = _mounted_probe(image_folder, capsys, latencyfs.KERNEL_DEFAULT)
    whole = report["paths"]["whole"]
    assert report["chosen"] == "whole" and list(report["paths"]) == ["whole"], report
    assert report["objects"] == 1_200 and report["reads_per_sample"] in (1, 2)  # the images, not labels.txt
    # what it says it read reached the storage: each file opened once and read whole
    assert stats["opens"] == whole["reads"] and stats["bytes"] == report["bytes_read"] <= report["max_bytes"]
    assert whole["latency_reads"] == 32 and whole["latency_ms"]["p50"] >= 10, whole  # 20 ms a read
    assert whole["sweep"][-1]["concurrency"] >= 64 and whole["ceiling_in_flight"] > 24, whole  # past the cap of 12
    assert report["samples_per_s"] == pytest.approx(whole["peak_reads_per_s"], rel=0.01)
    assert not any("max_background" in r for r in report["remedies"]), report["remedies"]


@needs_fuse
@needs_native
def test_an_image_folders_probe_stays_under_the_byte_bound(image_folder: Path, capsys) -> None:
    report, stats = _mounted_probe(image_folder, capsys, None, "--max-bytes", "100KiB")
    whole = report["paths"]["whole"]
    assert stats["bytes"] == report["bytes_read"] <= 100 << 10
    assert stats["opens"] >= whole["reads"] and "--max-bytes" in whole["stopped"], whole


@needs_native
def test_an_unreadable_image_is_named(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "imgs" / "cls"
    folder.mkdir(parents=True)
    for i in range(40):
        (folder / f"{i:03d}.jpg").write_bytes(b"x" * 500)
    (folder / "010.jpg").unlink()
    (folder / "010.jpg").symlink_to(tmp_path / "nowhere.jpg")  # listed, cannot be opened
    rc, _, err = _probe(capsys, str(tmp_path / "imgs"))
    assert rc == 2 and "010.jpg: cannot read it (No such file or directory)" in err, err
