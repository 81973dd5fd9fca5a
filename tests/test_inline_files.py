"""Small cached files read whole on the event loop (server/storage/inline_files.py, issue 21
item 4): the values and errors the native pool's reads give, each file handed over once,
never a file the page cache does not hold nor one on a FUSE mount, and a cold disk sent
to the pool after one try. Real files, a real ConfinedStore over the server's LocalStore,
a real latencyfs mount."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import mmap
import os
import random
from pathlib import Path
from typing import Any

import pytest

from croupier.bench import latencyfs
from croupier.client import ImageDecoding, Loader
from croupier.server.storage import inline_files, native
from croupier.server.storage.confined import ConfinedStore
from croupier.server.storage.local import LocalStore
from executor_counts import encodes_in_executor
from readers_data import write_imagefolder

pytestmark = pytest.mark.skipif(native.files_nowait is None, reason="the native read pool is not built")


def _write(root: Path, n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    paths = []
    for i in range(n):
        p = root / f"c{i % 3}" / f"f{i:03d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rng.randbytes(rng.randrange(1, 9000)))
        paths.append(str(p))
    return paths


def _confined(root: Path, inline: bool) -> ConfinedStore:
    # As the catalog makes it: the dataset's folder as given besides its resolved roots.
    return ConfinedStore(LocalStore(io_threads=2, inline_reads=inline), [str(root)], folders=[str(root)])


async def _group(store: ConfinedStore, paths: list[str], versioned: bool) -> dict[int, tuple[Any, Any]]:
    """One `submit_files` call: each position's (value, error), each handed over exactly once."""
    got: dict[int, tuple[Any, Any]] = {}
    finished = asyncio.get_running_loop().create_future()

    def done(landed: list[tuple[int, Any, BaseException | None]]) -> None:
        for i, value, err in landed:
            assert i not in got, f"position {i} handed over twice"
            got[i] = (value, err)
        if len(got) == len(paths) and not finished.done():
            finished.set_result(None)

    assert store.submit_files(paths, versioned, done)
    await asyncio.wait_for(finished, 30)
    await asyncio.sleep(0.05)  # nothing more may come
    assert sorted(got) == list(range(len(paths)))
    return got


def _run(store: ConfinedStore, paths: list[str], versioned: bool) -> dict[int, tuple[Any, Any]]:
    try:
        return asyncio.run(_group(store, paths, versioned))
    finally:
        store.close()


@pytest.mark.parametrize("versioned", [False, True])
def test_cached_files_are_read_on_the_loop_with_the_values_the_pool_gives(tmp_path: Path, versioned: bool) -> None:
    paths = _write(tmp_path, 40)  # just written: in the page cache
    inline, pooled = _confined(tmp_path, True), _confined(tmp_path, False)
    mine, theirs = _run(inline, paths, versioned), _run(pooled, paths, versioned)
    assert mine == theirs
    for i, path in enumerate(paths):
        value, err = mine[i]
        assert err is None and (value[0] if versioned else value) == Path(path).read_bytes()
        if versioned:
            assert value[1].real == os.path.realpath(path) and value[1].size == os.path.getsize(path)
    assert (inline.inner.inline_reads, pooled.inner.inline_reads) == (40, 0)
    assert inline.inner.native._token == 0  # the pool was given no file
    assert pooled.inner.native._token == 40


def test_files_the_loop_does_not_read_go_to_the_pool_each_once_with_the_pools_error(tmp_path: Path) -> None:
    root = tmp_path / "root"
    good = _write(root, 6)
    (tmp_path / "secret.bin").write_bytes(b"outside")
    os.symlink(tmp_path / "secret.bin", root / "link.bin")  # resolves outside the roots
    (root / "folder.bin").mkdir()
    (root / "large.bin").write_bytes(os.urandom(inline_files.MAX_FILE_BYTES + 1))
    os.mkfifo(root / "fifo.bin")
    odd = [str(root / n) for n in ("missing.bin", "link.bin", "folder.bin", "large.bin", "fifo.bin")]
    paths = [good[0], *odd[:2], *good[1:4], *odd[2:], *good[4:]]
    mine = _run(_confined(root, True), paths, False)
    theirs = _run(_confined(root, False), paths, False)
    for i, path in enumerate(paths):
        (value, err), (value2, err2) = mine[i], theirs[i]
        assert value == value2 and type(err) is type(err2) and str(err) == str(err2), path
    assert sorted(i for i in mine if mine[i][1] is not None) == [1, 2, 6, 8]  # missing, link out, folder, fifo
    assert mine[7][0] == Path(odd[3]).read_bytes()  # the large file, read whole by the pool
    store = _confined(root, True)
    _run(store, paths, False)
    assert store.inner.inline_reads == len(good)


def test_names_through_links_and_dots_beneath_the_folder_give_the_pools_real_paths(tmp_path: Path) -> None:
    """A name resolved without links is the folder's real path and the name (no readlink on
    the loop); a `.`, `..` or `//` in it, or a folder reached by a link, is read on the loop
    with the real path the pool's check reads (the file's own); a link beneath the folder is
    left to the pool (RESOLVE_CACHED does not follow one), with the same values."""
    real = tmp_path / "real"
    good = _write(real, 6)
    os.symlink(real, tmp_path / "via")  # the dataset's folder reached through a link
    os.symlink(real / "c1", real / "alias")  # a link beneath the folder, to a folder within it
    os.symlink(good[0], real / "c2" / "file-link.bin")  # a link to a file within it
    root = tmp_path / "via"
    names = ["c0/f000.bin", "alias/f001.bin", "c2/file-link.bin", "c1/../c2/f002.bin", "c0/./f003.bin", "c1//f004.bin"]
    paths = [f"{root}/{n}" for n in names]
    store = _confined(root, True)
    mine = _run(store, paths, True)
    theirs = _run(_confined(root, False), paths, True)
    assert mine == theirs
    want = [good[0], good[1], good[0], good[2], good[3], good[4]]
    assert [mine[i][0][1].real for i in range(len(paths))] == [os.path.realpath(w) for w in want]
    assert store.inner.inline_reads == 4  # all but the two through links beneath the folder


def _cached_pages(path: str) -> int:
    """Pages of the file the page cache holds, by mincore(2) on a mapping (reading would
    bring them back: an RWF_NOWAIT read that misses starts readahead)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size = os.path.getsize(path)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec)


def _evict(paths: list[str]) -> bool:
    """Drop the files' pages from the page cache; False where the kernel kept one."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return all(_cached_pages(p) == 0 for p in paths)


def test_a_cold_disk_goes_to_the_pool_and_the_next_groups_skip_the_try(tmp_path: Path) -> None:
    paths = _write(tmp_path, 24)
    if not _evict(paths):
        pytest.skip("the kernel kept the files' pages after POSIX_FADV_DONTNEED")
    inline = inline_files.InlineFiles([str(tmp_path)])
    groups = [paths[k:k + 4] for k in range(0, 24, 4)]
    tried = []
    for group in groups:
        got = inline.read_now(group, native.FILE_BYTES, None)
        tried.append(got is not None)
        assert got is None or got == ([], [0, 1, 2, 3], 0)  # nothing cached: all left to the pool
    # tried, then 1 group skipped, tried, 2 skipped, tried: the skips double after each cold try
    assert tried == [True, False, True, False, False, True]
    for path in paths:
        Path(path).read_bytes()  # cached again
    assert inline.read_now(paths[:4], native.FILE_BYTES, None) is None  # still backing off: 4 skipped
    inline.close()


def test_cold_files_read_by_the_pool_come_whole_and_once(tmp_path: Path) -> None:
    paths = _write(tmp_path, 12)
    if not _evict(paths[:6]):
        pytest.skip("the kernel kept the files' pages after POSIX_FADV_DONTNEED")
    store = _confined(tmp_path, True)
    got = _run(store, paths, True)
    assert all(got[i][1] is None and got[i][0][0] == Path(p).read_bytes() for i, p in enumerate(paths))
    assert store.inner.inline_reads == 6 and store.inner.native._token == 6


@pytest.mark.skipif(latencyfs.check_available() is not None, reason=f"latencyfs: {latencyfs.check_available()}")
def test_files_on_a_fuse_mount_are_never_read_on_the_loop(tmp_path: Path) -> None:
    src = tmp_path / "src"
    names = [os.path.relpath(p, src) for p in _write(src, 8)]
    with latencyfs.mounted(src, median_ms=1, distribution="fixed") as fs:
        paths = [os.path.join(fs.path, n) for n in names]
        for p in paths:
            Path(p).read_bytes()  # in the page cache, through the mount
        store = _confined(Path(fs.path), True)
        daemon = fs.stats()
        got = _run(store, paths, False)
        assert all(got[i] == (Path(src / n).read_bytes(), None) for i, n in enumerate(names))
        assert store.inner.inline_reads == 0 and store.inner.native._token == 8
        assert fs.stats()["opens"] - daemon["opens"] >= 8  # every file opened on the pool's threads
        assert store._inline.off  # a FUSE folder is not asked at all


def test_a_group_read_partly_on_the_loop_when_the_pool_is_closed_fails_the_rest_once(tmp_path: Path) -> None:
    """The cached files are handed over; the others, which the closed pool cannot take, each
    fail once (ECANCELED), never twice and never lost."""
    paths = _write(tmp_path, 10)
    if not _evict(paths[5:]):
        pytest.skip("the kernel kept the files' pages after POSIX_FADV_DONTNEED")
    store = _confined(tmp_path, True)
    store.inner.native.close()
    got = _run(store, paths, False)
    assert all(got[i] == (Path(p).read_bytes(), None) for i, p in enumerate(paths[:5]))
    for i in range(5, 10):
        value, err = got[i]
        assert value is None and isinstance(err, OSError) and err.errno == errno.ECANCELED
    assert (store.stats.in_flight, store.stats.errors) == (0, 5)  # every file counted as finished, once


def test_a_server_reads_the_images_of_a_dataset_given_through_a_link_on_the_loop(serve_inprocess, tmp_path: Path) -> None:
    """The user's path to the dataset is a link (/data -> a disk's folder, say): its images,
    page-cached, are still read on the loop, and every one arrives as written."""
    written = write_imagefolder(tmp_path / "disk" / "imgs", 8)
    os.symlink(tmp_path / "disk", tmp_path / "data")
    srv = serve_inprocess(datasets=[f"imgs={tmp_path / 'data' / 'imgs'}"])
    loader = Loader("imgs", servers=srv.address, batch_size=4, seed=0, epoch=0, format="numpy",
                    decoding=ImageDecoding(output="none"))
    got = {}
    try:
        for batch in loader.batches():
            for index, data in zip(batch.indices.tolist(), batch.data["image"]):
                got[index] = bytes(data)
    finally:
        loader.close()
    assert got == {i: (tmp_path / "disk" / "imgs" / rel).read_bytes() for i, (rel, _) in enumerate(written)}
    (reader,) = srv.running.catalog.readers()
    store = reader.store
    while not isinstance(store, ConfinedStore):
        store = store.inner
    assert store.inner.inline_reads == len(written)  # each image once, none through the pool's threads


def test_images_sent_as_read_are_encoded_on_the_loop_and_decoded_ones_in_the_cpu_pool(serve_inprocess,
                                                                                      tmp_path: Path) -> None:
    """A chunk of images sent as read is a record per file: no hop to the CPU pool and back
    (`Reader.encodes_on_loop`); decoding on the server, or --verify-images, still runs there."""
    write_imagefolder(tmp_path / "imgs", 8)
    srv = serve_inprocess(datasets=[f"imgs={tmp_path / 'imgs'}"])
    assert encodes_in_executor(srv, "imgs", 4, output="none") == (24, 0)
    n, encodes = encodes_in_executor(srv, "imgs", 4, output="numpy", on_server=True)
    assert n == 24 and encodes >= 1  # each chunk decoded in the pool
    verifying = serve_inprocess(datasets=[f"imgs={tmp_path / 'imgs'}"], verify_images=True)
    n, encodes = encodes_in_executor(verifying, "imgs", 4, output="none")
    assert n == 24 and encodes >= 1
