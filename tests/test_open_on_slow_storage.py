"""Opening a dataset on slow storage: the mount is known, the open lists folders only.

* a real `rclone mount` of the loopback S3 server is recognised, and the one log line
  names the s3:// URL (and endpoint) to serve instead;
* opening an ImageFolder through it costs one listing per folder, counted by the S3
  server itself: no request per file (a stat per file was a HEAD per image);
* a slow open logs its progress; the clock here is the count of folders listed, so the
  lines and their content are deterministic;
* the folder listing is cached under --cache-dir: the next open lists nothing, and a
  folder added, a file added or removed makes it list afresh.

The rclone tests skip, with the reason, where rclone or FUSE is missing.
"""

from __future__ import annotations

import itertools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from croupier.bench import s3server
from croupier.server.readers import open_dataset
from croupier.server.readers.imagefolder import ImageFolderReader
from croupier.server.readers import listing
from croupier.server.readers.listing import FilesProgress, Progress
from croupier.server.storage.local import LocalStore
from croupier.server.storage.mounts import CLIENT_LIMITS, mount_of, object_store_mount, parse_mountinfo

from croupier.bench.bucket_mount import rclone_mounted, rclone_unusable, s3fs_mounted, s3fs_unusable
from readers_data import png_bytes, write_arrow_folder, write_imagefolder, write_parquet, write_webdataset

_RCLONE = rclone_unusable()
needs_rclone = pytest.mark.skipif(_RCLONE is not None, reason=f"no rclone mount here: {_RCLONE}")
_S3FS = s3fs_unusable()

CLASSES = ("ant", "bee", "cat", "dog", "eel", "fox")
PER_CLASS = 40


class CountingStore(LocalStore):
    """A LocalStore that counts the folders it lists."""

    def __init__(self) -> None:
        super().__init__(io_threads=4, native_pool=False)
        self.listed: list[str] = []

    def list_names(self, path: str) -> tuple[list[str], list[str]]:
        self.listed.append(path)
        return super().list_names(path)


def _age(root: Path, seconds: float = 60.0) -> None:
    """Set every folder's mtime into the past: a listing of folders changed within the
    last two seconds is never cached (coarse mtimes could hide a change)."""
    for folder, _, _ in os.walk(root):
        st = os.stat(folder)
        os.utime(folder, ns=(st.st_atime_ns, st.st_mtime_ns - int(seconds * 1e9)))


# ---- recognising the mount -------------------------------------------------------------


@pytest.mark.parametrize(
    "client, mounted, unusable, source",
    [("rclone", rclone_mounted, _RCLONE, "bench:data"), ("s3fs", s3fs_mounted, _S3FS, "s3fs")],
    ids=["rclone", "s3fs"],
)
def test_a_bucket_mount_is_recognised_and_the_log_names_its_s3_url(caplog, client, mounted, unusable, source) -> None:
    # rclone: from its remote's section of rclone.conf; s3fs: from its command line
    if unusable is not None:
        pytest.skip(f"no {client} mount here: {unusable}")
    with s3server.running(None, latency=2) as s3:
        s3.create_bucket("data")
        for i in range(3):
            s3.put("data", f"imgs/cls{i}/{i}.png", png_bytes(i))
        with mounted(s3.endpoint, "data") as mnt:
            found = object_store_mount(mnt / "imgs")
            assert found is not None and found.client == client, found
            assert (found.mount.fs_type, found.mount.source) == (f"fuse.{client}", source), found
            assert found.url == "s3://data/imgs"
            with caplog.at_level(logging.WARNING, logger="croupier.server.open"):
                reader = open_dataset(mnt / "imgs", name="imgs", store=LocalStore(io_threads=4, native_pool=False))
    lines = [r.getMessage() for r in caplog.records if r.name == "croupier.server.open"]
    assert len(lines) == 1, lines
    assert f"serve s3://data/imgs instead (with AWS_ENDPOINT_URL={s3.endpoint})" in lines[0]
    assert f"client {client}" in lines[0] and str(mnt) in lines[0]
    assert f"to keep the mount: {CLIENT_LIMITS[client]}" in lines[0]  # what the client's own options change
    assert reader.object_store_mount == found
    assert len(reader) == 3


def test_mountinfo_gives_the_innermost_mount_and_each_clients_bucket(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
        "40 22 0:40 / /mnt/gcs rw,nosuid - fuse.gcsfuse my-bucket rw,user_id=0\n"
        "41 22 0:41 / /mnt/with\\040space rw - fuse.goofys bkt:some/prefix rw\n"
        "42 22 0:42 / /mnt/r rw - fuse.rclone :s3,endpoint=x:bkt rw\n"
        "43 22 0:43 / /mnt/b rw - fuse blobfuse2 rw\n"
    )
    assert mount_of("/mnt/gcs/a/b", str(info)).mount_point == "/mnt/gcs"  # type: ignore[union-attr]
    assert mount_of("/mnt/gcsx", str(info)).fs_type == "ext4"  # type: ignore[union-attr]
    assert object_store_mount("/mnt/gcs/train/x", str(info)).url == "gs://my-bucket/train/x"  # type: ignore[union-attr]
    assert object_store_mount("/mnt/with space/d", str(info)).url == "s3://bkt/some/prefix/d"  # type: ignore[union-attr]
    on_the_fly = object_store_mount("/mnt/r/d", str(info))
    assert on_the_fly is not None and on_the_fly.url is None and "not a named remote" in on_the_fly.note
    said = on_the_fly.message("d", "/mnt/r/d")
    assert "could not derive" in said and "--checkers" in said  # the client's own limit, all the same
    assert "to keep the mount" not in object_store_mount("/mnt/gcs/x", str(info)).message("d", "x")  # nothing measured
    blob = object_store_mount("/mnt/b/d", str(info))
    assert blob is not None and blob.client == "blobfuse2" and blob.url is None
    assert object_store_mount("/home/x", str(info)) is None
    assert [m.device for m in parse_mountinfo(info.read_text())] == ["254:0", "0:40", "0:41", "0:42", "0:43"]


@needs_rclone
def test_rclone_itself_holds_requests_to_checkers_plus_transfers_and_heads_each_file_it_opens() -> None:
    # What CLIENT_LIMITS tells a user, checked against the rclone installed, the store counting:
    # with its defaults at most 12 requests reach the store at once from 32 threads, a HEAD and
    # a GET a file; --checkers 32 lets more through; --use-server-modtime drops the HEAD.
    files, size = 96, 2200
    with s3server.running(None, latency=30) as s3:
        s3.create_bucket("data")
        for i in range(files):
            s3.put("data", f"f/c{i % 16}/{i}.bin", bytes([i]) * size)

        def read_all(options: tuple[str, ...]) -> dict:
            with rclone_mounted(s3.endpoint, "data", options=options) as mnt:
                for c in range(16):
                    os.listdir(mnt / "f" / f"c{c}")
                s3.reset_stats()
                paths = [mnt / "f" / f"c{i % 16}" / f"{i}.bin" for i in range(files)]
                with ThreadPoolExecutor(32) as pool:
                    got = list(pool.map(Path.read_bytes, paths))
                assert got == [bytes([i]) * size for i in range(files)]
                return s3.stats()

        defaults = read_all(())
        assert defaults["by_method"] == {"HEAD": files, "GET": files}, defaults
        assert 1 < defaults["max_in_flight"] <= 12, defaults
        assert read_all(("--checkers", "32"))["max_in_flight"] > 12
        assert read_all(("--use-server-modtime",))["by_method"] == {"GET": files}


@needs_rclone
def test_probing_an_image_folder_through_rclone_names_its_url_and_rclones_own_limit_not_max_background(capsys) -> None:
    import json

    from croupier import cli

    with s3server.running(None, latency=20) as s3:
        s3.create_bucket("data")
        for i in range(200):
            s3.put("data", f"imgs/c{i % 10}/{i}.jpg", bytes([i]) * 2200)
        with rclone_mounted(s3.endpoint, "data") as mnt:
            s3.reset_stats()
            rc = cli.main(["probe", str(mnt / "imgs"), "--max-concurrency", "16", "--json"])
            out, err = capsys.readouterr()
            assert rc == 0, err
            counts = s3.stats()
    report = json.loads(out)
    whole = report["paths"]["whole"]
    assert report["chosen"] == "whole" and report["objects"] == 200
    assert counts["by_method"]["HEAD"] == whole["reads"] and counts["max_in_flight"] <= 12  # a HEAD a file, rclone's 12
    said = " | ".join(report["remedies"])
    assert "serve s3://data/imgs instead" in said and "--checkers" in said and "max_background" not in said, said


# ---- no request per file -------------------------------------------------------------


@needs_rclone
def test_an_imagefolder_open_through_a_bucket_mount_lists_folders_and_requests_nothing_per_file() -> None:
    with s3server.running(None, latency=2) as s3:
        s3.create_bucket("data")
        expected = write_imagefolder(Path(s3.root) / "data" / "imgs", PER_CLASS, CLASSES)
        with rclone_mounted(s3.endpoint, "data") as mnt:
            store = LocalStore(io_threads=4, native_pool=False)
            for attempt in range(2):  # the second open lists again: no cache on a bucket mount
                s3.reset_stats()
                reader = open_dataset(mnt / "imgs", name="imgs", store=store)
                counts = s3.stats()
                assert isinstance(reader, ImageFolderReader) and not reader.index_cached
                assert list(zip(reader.keys, reader.labels)) == expected
                # one ListObjects (a GET) per folder, plus the bucket's root at the first open
                assert counts["by_method"].get("HEAD", 0) == 0, counts
                assert counts["requests"] <= len(CLASSES) + 3, counts
            store.close()


def test_an_open_lists_each_folder_once_and_never_stats_a_file(tmp_path: Path) -> None:
    expected = write_imagefolder(tmp_path / "imgs", 5, CLASSES)
    (tmp_path / "imgs" / "cat" / "deeper").mkdir()
    (tmp_path / "imgs" / "cat" / "deeper" / "x.png").write_bytes(png_bytes(0))
    store = CountingStore()
    reader = ImageFolderReader("imgs", str(tmp_path / "imgs"), store=store, cache_dir=tmp_path / "cache")
    assert sorted(store.listed) == sorted(
        [str(tmp_path / "imgs"), *(str(tmp_path / "imgs" / c) for c in CLASSES), str(tmp_path / "imgs" / "cat" / "deeper")]
    )
    cat = [k for k in reader.keys if k.startswith("cat/")]
    assert cat == [k for k, _ in expected if k.startswith("cat/")] + ["cat/deeper/x.png"]  # torchvision's order
    assert store.stats.reads == 0  # not one byte of any image read at open


# ---- progress ------------------------------------------------------------------------


def test_a_slow_open_logs_its_progress_every_interval(tmp_path: Path, caplog) -> None:
    classes = [f"c{i:02d}" for i in range(22)]
    write_imagefolder(tmp_path / "imgs", 3, classes)
    ticks = itertools.count()  # the clock advances one "second" per look: per folder listed
    progress = Progress("dataset imgs", interval_s=5.0, clock=lambda: float(next(ticks)))
    with caplog.at_level(logging.INFO, logger="croupier.server.open"):
        reader = ImageFolderReader("imgs", str(tmp_path / "imgs"), store=CountingStore(), progress=progress)
    assert len(reader) == 66
    logged = [r.getMessage() for r in caplog.records if r.name == "croupier.server.open"]
    assert logged == progress.lines
    # the root is listed first (no files), then the 22 class folders (3 files each), all
    # queued at once: after k folders, 3(k-1) files and 23-k folders are left
    assert [line.split(": ", 1)[1].rsplit(",", 1)[0] for line in logged[:-1]] == [
        f"{3 * (k - 1)} files in {k} folders listed, {23 - k} folders left" for k in (5, 10, 15, 20)
    ]
    assert all(line.startswith("opening dataset imgs: ") and line.endswith(" files/s") for line in logged[:-1])
    assert logged[-1].startswith("opened dataset imgs: 66 files in 23 folders listed in ")


def test_a_quick_open_logs_nothing(tmp_path: Path, caplog) -> None:
    write_imagefolder(tmp_path / "imgs", 2, CLASSES)
    with caplog.at_level(logging.INFO, logger="croupier.server.open"):
        ImageFolderReader("imgs", str(tmp_path / "imgs"), store=CountingStore(), progress=Progress("x", clock=lambda: 0.0))
    assert [r for r in caplog.records if r.name == "croupier.server.open"] == []


def test_an_open_that_reads_each_file_logs_its_progress_rate_and_time_left(caplog) -> None:
    ticks = itertools.count()  # one "second" per look at the clock: per file read
    progress = FilesProgress("dataset d", 12, "shard indexes", interval_s=5.0, clock=lambda: float(next(ticks)))
    with caplog.at_level(logging.INFO, logger="croupier.server.open"):
        for _ in range(12):
            progress.step()
        progress.finish()
    assert [r.getMessage() for r in caplog.records if r.name == "croupier.server.open"] == progress.lines == [
        "opening dataset d: 5 of 12 shard indexes read, 1.0 a second, about 7 s left",
        "opening dataset d: 10 of 12 shard indexes read, 1.0 a second, about 2 s left",
        "opened dataset d: 12 shard indexes read in 13.0 s",
    ]
    quiet = FilesProgress("dataset q", 3, clock=lambda: 0.0)
    for _ in range(3):
        quiet.step()
    quiet.finish()
    assert quiet.lines == []  # an open quicker than the interval says nothing


@pytest.mark.parametrize("fmt, kind", [("webdataset", "shard indexes"), ("parquet", "footers"), ("arrow", "file layouts")])
def test_a_webdataset_parquet_or_arrow_open_reports_its_files_as_it_reads_them(tmp_path: Path, caplog, monkeypatch,
                                                                               fmt: str, kind: str) -> None:
    # Interval 0: a line after each file but the last, then the end: what a slow open logs.
    monkeypatch.setattr(listing, "PROGRESS_S", 0.0)
    root = tmp_path / "d"
    if fmt == "webdataset":
        write_webdataset(root, 30, shard_size=10)
    elif fmt == "parquet":
        for k in range(3):
            write_parquet(root / f"part-{k}.parquet", 10, start=10 * k)
    else:
        write_arrow_folder(root, [10, 10, 10])
    with caplog.at_level(logging.INFO, logger="croupier.server.open"):
        reader = open_dataset(str(root), name="d", format=fmt, cache_dir=str(tmp_path / "cache"))
    try:
        assert len(reader) == 30
    finally:
        reader.close()
    logged = [r.getMessage() for r in caplog.records if r.name == "croupier.server.open"]
    assert [line.split(", ", 1)[0] for line in logged[:-1]] == [
        f"opening dataset d ({root}): {k} of 3 {kind} read" for k in (1, 2)]
    assert logged[-1].startswith(f"opened dataset d ({root}): 3 {kind} read in ")


# ---- the cached index ------------------------------------------------------------------


def _open(root: Path, cache: Path) -> tuple[ImageFolderReader, CountingStore]:
    store = CountingStore()
    return ImageFolderReader("imgs", str(root), store=store, cache_dir=cache), store


def test_the_next_open_reads_the_cached_listing_and_lists_nothing(tmp_path: Path) -> None:
    root, cache = tmp_path / "imgs", tmp_path / "cache"
    expected = write_imagefolder(root, 4, CLASSES)
    _age(root)
    first, store = _open(root, cache)
    assert not first.index_cached and len(store.listed) == len(CLASSES) + 1
    assert len(list(cache.iterdir())) == 1
    second, store = _open(root, cache)
    assert second.index_cached and store.listed == []
    assert list(zip(second.keys, second.labels)) == list(zip(first.keys, first.labels)) == expected


@pytest.mark.parametrize("change", ["file added", "file removed", "folder added", "class removed"])
def test_the_cached_listing_is_ignored_when_the_tree_changed(tmp_path: Path, change: str) -> None:
    root, cache = tmp_path / "imgs", tmp_path / "cache"
    write_imagefolder(root, 4, CLASSES)
    _age(root, 120)
    _open(root, cache)
    if change == "file added":
        (root / "bee" / "new.png").write_bytes(png_bytes(1))
    elif change == "file removed":
        (root / "bee" / "00001.png").unlink()
    elif change == "folder added":
        (root / "bee" / "sub").mkdir()
        (root / "bee" / "sub" / "x.png").write_bytes(png_bytes(1))
    else:
        for f in (root / "eel").iterdir():
            f.unlink()
        (root / "eel").rmdir()
    reader, store = _open(root, cache)
    assert not reader.index_cached and store.listed
    walked = sorted(str(Path(d, f).relative_to(root)) for d, _, fs in os.walk(root) for f in fs)
    assert sorted(reader.keys) == walked


def test_a_listing_of_folders_changed_just_now_is_not_cached(tmp_path: Path) -> None:
    root, cache = tmp_path / "imgs", tmp_path / "cache"
    write_imagefolder(root, 2, CLASSES)  # mtimes: now
    _open(root, cache)
    reader, store = _open(root, cache)
    assert not reader.index_cached and store.listed
