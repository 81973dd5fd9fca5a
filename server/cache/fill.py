"""Fill: read a dataset's files into the cache by large sequential reads, in the
background, where the storage rewards them.

Per mount, once: a local block or memory file system is not filled (the kernel's page
cache already is the cache; `fill: always` forces it). Elsewhere the first block is read
and timed, and the fill goes on when that read took fewer seconds than the random reads it
replaces: BLOCK_BYTES / REPLACED_READ_BYTES reads of L0 each, L0 being the small-read
latency the read-path probe measured on that mount (storage/readpath.py), or 4 reads timed
here when the probe did not run. Measured on latencyfs at 5 ms (kernel defaults): a 1 MiB
block in 20 ms against 16 x 5.7 ms = 91 ms of small reads.

Blocks are read by FILL_IN_FLIGHT sequential streams at once, on the cache's threads: a
stream is a file (or, with fewer files than streams, a contiguous part of one), read block
after block in order, one block in flight, through a descriptor of its own, O_DIRECT where
the file system takes it (`open_for_fill`; the dataset's pinned one is marked for random
access, and a mapped mount's faults are one page each),
opened by the dataset's confined store so the fill reads only what the dataset may. Files
start in the order the dataset opened them. Why streams and not several blocks of one file
in flight: a FUSE client of an object store serves an open file's reads one at a time and
streams a sequential one from a single GET, while reads at other offsets make it seek, a new
GET each: through a 20 ms rclone mount, 4 blocks in flight on one descriptor filled at
5.8 MB/s, a plain sequential read of a file made 217 MB/s, and 4 files at once 336 MB/s.
Reads go on meanwhile: a block in the cache is served from it, any other read goes to storage.
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import fcntl
import logging
import math
import mmap
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..storage.readpath import LOCAL_FILE_SYSTEMS, mount_of
from .block_cache import FILL_IN_FLIGHT, BlockCache
from .blocks import BLOCK_BYTES, FileKey

log = logging.getLogger("croupier.server.cache")

#: The rule counts one random read per this many bytes of a block: a sample of at most
#: 64 KiB (a text row is far less, a JPEG about this), so a fill never wins on paper only.
REPLACED_READ_BYTES = 64 << 10
FILL_MODES = ("auto", "always", "never")
#: A file is cut into parts read as streams of their own only down to this many blocks.
MIN_STREAM_BLOCKS = 8
#: And into this many parts at most, however many streams the server runs: one 100 MB file
#: through latencyfs (kernel defaults, cpu_per_sample's text case, alternating) made 93,282 /
#: 58,991 rows/s in 8 parts, 94,582 / 59,294 with 16 streams held to 8 parts, 70,629 / 34,331
#: cut into 12 (FILL_IN_FLIGHT 16 with no bound).
MAX_FILE_PARTS = 8
_PAGE = 4096
#: CROUPIER_FILL_DIRECT=0 keeps the fill's reads buffered (default: O_DIRECT where accepted).
DIRECT_ENV = "CROUPIER_FILL_DIRECT"


@dataclass
class FillFile:
    path: str
    key: FileKey


@dataclass
class FillSource:
    """What a fill needs from a dataset's store: its files, a checked open, its counters,
    the probe's small-read latency of a mount (0: not measured)."""

    name: str
    files: list[FillFile]
    open_fd: Callable[[str], int]
    stats: object  # storage.base.StoreStats
    latency_of: Callable[[int], float]
    closed: Callable[[], bool]


def pays(block_s: float, l0_s: float, block_len: int = BLOCK_BYTES) -> bool:
    """A block's sequential read costs fewer seconds than the random reads it replaces."""
    return block_s < max(1, block_len // REPLACED_READ_BYTES) * l0_s


def open_for_fill(open_fd: Callable[[str], int], path: str) -> int:
    """`path` opened for a fill's stream of large sequential reads: O_DIRECT where the file
    system takes it (a block is one request, no page-cache copy beside the cache's own),
    else buffered with sequential readahead. Why: on FUSE a buffered 1 MiB pread reaches the
    daemon as several readahead requests, background ones the kernel caps per mount (12 by
    default); an O_DIRECT one into an aligned buffer is a single 1 MiB request. Measured
    through latencyfs at 5 ms with the kernel's defaults, 400 MB of text: buffered, 4
    streams 302 MB/s and 8 streams 381 (1,610-1,658 requests, 0.2 s of the reader's CPU);
    O_DIRECT, 4 streams 614 MB/s and 8 streams 1,084 (403 requests, 0.07 s). Through 20 ms
    rclone and s3fs mounts of a bucket (4 streams) both ways made 270-330 MB/s."""
    fd = open_fd(path)
    if os.environ.get(DIRECT_ENV, "1") != "0" and hasattr(os, "O_DIRECT"):
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
            return fd
        except OSError:  # EINVAL: the file system has no O_DIRECT
            pass
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return fd


def _is_direct(fd: int) -> bool:
    return hasattr(os, "O_DIRECT") and bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def _buffered(fd: int) -> None:
    """Take O_DIRECT off `fd`: a file system that opened it so but refuses this read."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


_buffers = threading.local()


def _pread_direct(fd: int, offset: int, size: int) -> bytes:
    """An O_DIRECT read into this thread's page-aligned buffer, its length rounded up to a
    page (file systems that check alignment want both; FUSE sends an unaligned 1 MiB read
    as 2 requests, an aligned one as 1)."""
    span = -(-size // _PAGE) * _PAGE
    buf = getattr(_buffers, "buf", None)
    if buf is None or len(buf) < span:
        buf = _buffers.buf = mmap.mmap(-1, max(BLOCK_BYTES, span))
    view = memoryview(buf)
    try:
        got = 0
        while got < size:
            n = os.preadv(fd, [view[got:span]], offset + got)
            if not n:
                break
            got += n
        return bytes(view[:min(got, size)])
    finally:
        view.release()


def _pread(fd: int, offset: int, size: int) -> bytes:
    if _is_direct(fd):
        try:
            return _pread_direct(fd, offset, size)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            _buffered(fd)
    parts, got = [], 0
    while got < size:
        chunk = os.pread(fd, size - got, offset + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _small_read_latency(fd: int, size: int) -> float:
    """L0 where the probe did not run: 4 reads of 1 KiB one at a time, random pages."""
    pages = max(1, size // 4096)
    offsets = random.Random(size).sample(range(pages), min(4, pages))
    t = time.perf_counter()
    for p in offsets:
        _pread(fd, p * 4096, 1024)
    return (time.perf_counter() - t) / len(offsets)


class DatasetFill:
    """One dataset's fill, run on a thread of its own (it waits on the cache's threads)."""

    def __init__(self, cache: BlockCache, source: FillSource):
        self.cache, self.source = cache, source
        self.filled = 0
        self.full = False
        self.started_at = 0.0
        self.thread = threading.Thread(target=self.run, name=f"croupier-fill-{source.name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the fill to end; True when it has."""
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def run(self) -> None:
        try:
            self._read_streams(self._streams())
        except Exception as exc:  # a fill is an optimisation: reads go on without it
            log.warning("cache: fill of dataset %s stopped: %s", self.source.name, exc)
        if self.started_at:
            secs = time.perf_counter() - self.started_at
            log.info("cache: fill of dataset %s ended: %d bytes in %.2f s (%.1f MB/s)%s", self.source.name, self.filled,
                     secs, self.filled / max(secs, 1e-9) / 1e6, "; the cache is full" if self.full else "")

    def _stopped(self) -> bool:
        return self.full or self.cache.closed or self.source.closed()

    def _streams(self) -> Iterator[tuple[FillFile, list[int]]]:
        """The fill's streams, in the dataset's file order: (file, its blocks in order) for
        each file on a mount where fills pay, its first block read and timed on a mount not
        decided yet; a file is cut into parts when there are fewer files than streams."""
        files = self.source.files
        parts = max(1, min(MAX_FILE_PARTS, math.ceil(FILL_IN_FLIGHT / max(1, len(files)))))
        for f in files:
            if self._stopped():
                return
            blocks = [b for b in range(f.key.blocks()) if not self.cache.cached(f.key, b)]
            if not blocks or not self._pays(f, blocks):
                continue
            if not blocks:  # the trial read the only one
                continue
            n = max(1, min(parts, len(blocks) // MIN_STREAM_BLOCKS))
            step = math.ceil(len(blocks) / n)
            for i in range(0, len(blocks), step):
                yield f, blocks[i:i + step]

    def _pays(self, f: FillFile, blocks: list[int]) -> bool:
        """Whether fills pay on `f`'s mount: decided once per mount, by `_decide` or by
        reading `blocks`' first (taken from the list) and timing it."""
        dev = self._device(f)
        decision = self.cache.fill_pays.get(dev)
        if decision is None:
            decision = self._decide(f, dev)
        if decision is None:
            fd = open_for_fill(self.source.open_fd, f.path)
            try:
                decision = self._trial(fd, f, blocks.pop(0), dev)
            finally:
                os.close(fd)
        self.cache.fill_pays.setdefault(dev, decision)
        return decision

    def _device(self, f: FillFile) -> int:
        """st_dev of `f`'s mount: a lookup of its real path (no open on the file system), else
        (no /proc to name it) the dataset's descriptor's."""
        try:
            return os.stat(f.key.real_path).st_dev
        except OSError:
            fd = self.source.open_fd(f.path)
            try:
                return os.fstat(fd).st_dev
            finally:
                os.close(fd)

    def _read_streams(self, streams: Iterator[tuple[FillFile, list[int]]]) -> None:
        """FILL_IN_FLIGHT streams at once, each one block in flight on a descriptor of its
        own, the next stream started as one ends."""
        pending: dict[concurrent.futures.Future, tuple[FillFile, int, collections.deque[int]]] = {}

        def start() -> bool:
            nxt = next(streams, None)
            if nxt is None:
                return False
            f, blocks = nxt
            fd = open_for_fill(self.source.open_fd, f.path)
            submit(f, fd, collections.deque(blocks))
            return True

        def submit(f: FillFile, fd: int, queue: collections.deque[int]) -> None:
            """The stream's next block on the cache's threads (its descriptor closed if it cannot go)."""
            try:
                pending[self.cache.io.submit(self._read_one, fd, f, queue.popleft())] = (f, fd, queue)
            except BaseException:
                os.close(fd)
                raise

        try:
            while len(pending) < FILL_IN_FLIGHT and start():
                pass
            while pending:
                done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                for fut in done:
                    f, fd, queue = pending.pop(fut)
                    try:
                        fut.result()  # a read error ends the fill (run logs it)
                    except BaseException:
                        os.close(fd)
                        raise
                    if queue and not self._stopped():
                        submit(f, fd, queue)
                        continue
                    os.close(fd)
                    if not self._stopped():
                        start()
        finally:
            concurrent.futures.wait(pending)
            for _f, fd, _q in pending.values():
                os.close(fd)

    def _decide(self, f: FillFile, dev: int) -> bool | None:
        """Whether fills pay on mount `dev`: known, decided here without reading, or
        None when the first block must be read and timed (the caller does it)."""
        mode = self.cache.sizes.fill
        if mode != "auto":
            return mode == "always"
        mount = mount_of(dev, f.path)
        if mount.fs_type in LOCAL_FILE_SYSTEMS:
            log.info("cache: no fill on %s (%s): a local file system, the kernel's page cache serves its reads",
                     mount.point, mount.fs_type)
            return False
        return None

    def _trial(self, fd: int, f: FillFile, block: int, dev: int) -> bool:
        """Read and time the first block of a mount; decide by `pays`."""
        t = time.perf_counter()
        self._read_one(fd, f, block)
        block_s = time.perf_counter() - t
        l0 = self.source.latency_of(dev) or _small_read_latency(fd, f.key.size)
        ok = pays(block_s, l0, f.key.block_length(block) or BLOCK_BYTES)
        mount = mount_of(dev, f.path)
        log.info("cache: %s fill on %s (%s): a %d KiB block read in %.1f ms against %d small reads of %.2f ms",
                 "a" if ok else "no", mount.point, mount.fs_type, BLOCK_BYTES >> 10, block_s * 1e3,
                 max(1, BLOCK_BYTES // REPLACED_READ_BYTES), l0 * 1e3)
        return ok

    def _read_one(self, fd: int, f: FillFile, block: int) -> None:
        if self.full or self.cache.cached(f.key, block):
            return
        if not self.started_at:
            self.started_at = time.perf_counter()
            log.info("cache: fill of dataset %s started (%d file(s), %d bytes)", self.source.name,
                     len(self.source.files), sum(x.key.size for x in self.source.files))
        length = f.key.block_length(block)
        stats = self.source.stats
        stats.blocking_started()  # type: ignore[attr-defined]
        data, ok = b"", False
        try:
            data = _pread(fd, block * BLOCK_BYTES, length)
            ok = True
        finally:
            stats.blocking_finished(len(data), ok)  # type: ignore[attr-defined]
        if len(data) != length:  # the file shrank since it was opened: its key is stale
            raise OSError(f"{f.path} changed during the fill ({len(data)} of {length} bytes at block {block})")
        if self.cache.store_block(f.key, block, data):
            self.filled += length
        else:
            self.full = True
