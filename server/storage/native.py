"""The native read pool (_preadpool.c) seen from asyncio: preads that return futures.

Each read is one C call to submit and, per wake-up of the loop, one C call drains every
completion; the native threads never take the GIL. The hot path takes a callback instead of
a future (`pread_ranges`, `read_path_then`, `read_whole_then`, `identify_then`): no future,
task or coroutine per read. Without the compiled extension (an
install without a C compiler) `available()` is False and the store uses the Python
pool (iopool.py) instead, or when CROUPIER_READ_POOL=python asks for it.

Ranges the page cache holds may be read at once on the calling thread instead
(`read_nowait`: RWF_NOWAIT, never waiting for storage; LocalStore does so on local file
systems, where a hop to a thread and back costs several times the read).

Three read paths on the same threads: a pread on an open file, a copy out of a
read-only mapping of it (`Mapping`, `map_read`), whose page faults the thread takes
(on FUSE a fault is a synchronous request, outside the mount's cap on background ones),
or a read of the file opened again with O_DIRECT (`open_direct`, `direct_read`: no page
cache, one request of the asked size); readpath.py measures which path a mount wants.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .base import FileVersion, StoreStats

try:
    from ._preadpool import Mapping, Pool as _NativePool, direct_alignment, measure, measure_files, read_nowait
except ImportError:  # built without a compiler: the Python pool serves instead
    _NativePool = Mapping = measure = measure_files = direct_alignment = read_nowait = None  # type: ignore[assignment,misc]
try:  # a module built before files_nowait (readpool --against REV loads older pools' modules)
    from ._preadpool import files_nowait
except ImportError:
    files_nowait = None  # type: ignore[assignment]


class DirectFile(NamedTuple):
    """A file opened with O_DIRECT, and the offset and size alignment it accepts (1: none)."""

    fd: int
    align: int


def open_direct(path: str, align: int | None = None) -> DirectFile:
    """`path` opened (again) with O_DIRECT. `align`: the mount's alignment when known, else
    found by test reads (1, 512 or 4096). OSError where the file system refuses O_DIRECT
    (EINVAL: ramfs, tmpfs before Linux 6.6, FUSE daemons that refuse it) or the extension
    is not built."""
    if direct_alignment is None or not hasattr(os, "O_DIRECT"):
        raise OSError(errno.ENOTSUP, "O_DIRECT reads need croupier's native read pool on Linux")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
    try:
        return DirectFile(fd, align or direct_alignment(fd, os.fstat(fd).st_size))
    except BaseException:
        os.close(fd)
        raise


def roots_blob(roots: Sequence[str]) -> bytes:
    """`roots` as `pread_path` takes them."""
    return b"\0".join(os.fsencode(r) for r in roots)


def available() -> bool:
    """The native pool is built, and not turned off by CROUPIER_READ_POOL=python."""
    return _NativePool is not None and os.environ.get("CROUPIER_READ_POOL", "native") != "python"


class NativeReadPool:
    def __init__(self, max_threads: int):
        if _NativePool is None:
            raise RuntimeError("croupier's native read pool is not built (no C compiler at install time)")
        self.max_threads = max_threads
        self._pool = _NativePool(max_threads)
        self._futures: dict[int, asyncio.Future[bytes]] = {}
        self._token = 0
        self._pacers: dict[asyncio.AbstractEventLoop, _Pacer] = {}  # each loop that reads, watching the eventfd
        self._closed = False

    @property
    def threads(self) -> int:
        return self._pool.threads

    def _watch(self) -> asyncio.AbstractEventLoop:
        """The running loop, watching the pool's eventfd (each loop that reads does)."""
        if self._closed:
            raise RuntimeError("the read pool is closed")
        loop = asyncio.get_running_loop()
        if loop not in self._pacers:
            self._pacers = {lp: p for lp, p in self._pacers.items() if not lp.is_closed()}
            pacer = self._pacers[loop] = _Pacer(self, loop)
            loop.add_reader(self._pool.fileno(), pacer.readable)
        return loop

    @property
    def latency(self) -> float:
        """A moving mean of the reads' seconds from submitted to done (0: none yet)."""
        return self._pool.latency

    def _future(self) -> tuple[int, asyncio.Future[bytes]]:
        loop = self._watch()
        self._token += 1
        fut = loop.create_future()
        self._futures[self._token] = fut
        return self._token, fut

    def pread(self, fd: int, offset: int, size: int) -> asyncio.Future[bytes]:
        """`size` bytes at `offset` of open file `fd` (-1: to the end); fewer at the end."""
        token, fut = self._future()
        self._pool.submit_ranges(token, fd, ((offset, size),))
        return fut

    def map_read(self, mapping: Any, offset: int, size: int) -> asyncio.Future[bytes]:
        """`size` bytes at `offset` copied out of `mapping` (a `Mapping`) on a pool thread,
        which takes the page faults; fewer at the end of the file (also one truncated
        under the mapping)."""
        token, fut = self._future()
        self._pool.submit_ranges(token, mapping, ((offset, size),))
        return fut

    def direct_read(self, direct: DirectFile, offset: int, size: int) -> asyncio.Future[bytes]:
        """`size` bytes at `offset` of a file opened with O_DIRECT (the aligned range around
        them read into an aligned buffer on a pool thread); fewer at the end of the file."""
        token, fut = self._future()
        self._pool.submit_ranges(token, direct.fd, ((offset, size),), direct.align)
        return fut

    def pread_path(self, path: str, offset: int, size: int, roots: bytes | None = None) -> asyncio.Future[bytes]:
        """The same on `path`, opened and closed by the native thread (no fd kept). With
        `roots` (NUL-separated resolved folders), the file opened must lie in one of them,
        else the read fails with EXDEV (see `roots_blob`)."""
        token, fut = self._future()
        if roots is None:
            self._pool.submit_path(token, path, offset, size)
        else:
            self._pool.submit_path(token, path, offset, size, roots)
        return fut

    def read_whole(self, path: str, roots: bytes | None = None) -> "asyncio.Future[tuple]":
        """`path` read whole by a native thread, and which file that was (from the fd it
        read: no second look that a swap could slip between); `roots` as `pread_path`.
        Its result: see `whole_result`."""
        token, fut = self._future()
        self._pool.submit_whole(token, path, *(() if roots is None else (roots,)))
        return fut

    def identify(self, path: str, roots: bytes | None = None) -> "asyncio.Future[tuple]":
        """Which file `path` names now (opened O_PATH on a native thread: a name resolved,
        no open or read on the file system); `roots` as `pread_path`. Its result: see
        `identify_result`."""
        token, fut = self._future()
        self._pool.submit_identify(token, path, *(() if roots is None else (roots,)))
        return fut

    def _call(self, callback: Callable[[Any, OSError | None], None]) -> int:
        """A token whose completion goes to `callback` on this loop (no future)."""
        loop = self._watch()
        self._token += 1
        self._futures[self._token] = (_Call(loop, callback), 0)  # type: ignore[assignment]
        return self._token

    def read_path_then(self, path: str, roots: bytes | None, callback: Callable[[bytes | None, OSError | None], None],
                       offset: int = 0, size: int = -1) -> None:
        """`pread_path` without a future: `callback(data, None)` or `callback(None, error)`
        on the loop (a file read whole without a task: images)."""
        token = self._call(callback)
        if roots is None:
            self._pool.submit_path(token, path, offset, size)
        else:
            self._pool.submit_path(token, path, offset, size, roots)

    def read_whole_then(self, path: str, roots: bytes | None, callback: Callable[[tuple | None, OSError | None], None]) -> None:
        """`read_whole` without a future: `callback(value, None)` (see `whole_result`) or
        `callback(None, error)` on the loop."""
        self._pool.submit_whole(self._call(callback), path, *(() if roots is None else (roots,)))

    def read_files_then(self, paths: Sequence[str], roots: bytes | None, kind: int,
                        callback: Callable[[list[tuple[int, Any, OSError | None]], int], None]) -> None:
        """Files, one call for them all: `callback(done, nbytes)` on the loop once per wake-up
        with the files landed since the last call, each (position in `paths`, value, None) or
        (position, None, error), value as `read_path_then`'s (kind FILE_BYTES),
        `read_whole_then`'s (FILE_WHOLE) or `identify_then`'s (FILE_IDENTIFY); nbytes: the
        bytes read. Each file is named exactly once over the calls."""
        loop = self._watch()
        group = _Files(loop, callback, kind == FILE_IDENTIFY)
        group.base = self._token + 1
        self._token += len(paths)
        futures = self._futures
        for i in range(len(paths)):
            futures[group.base + i] = group  # type: ignore[assignment]
        self._pool.submit_files(group.base, paths, kind, roots)

    def identify_then(self, path: str, roots: bytes | None, callback: Callable[[tuple | None, OSError | None], None]) -> None:
        """`identify` without a future: `callback(value, None)` (see `identify_result`) or
        `callback(None, error)` on the loop."""
        self._pool.submit_identify(self._call(callback), path, *(() if roots is None else (roots,)))

    def pread_ranges(
        self,
        fd: int | None,
        path: str,
        ranges: Sequence[tuple[int, int]],
        callback: Callable[[list[bytes] | None, OSError | None], None],
        mapping: Any = None,
        direct: DirectFile | None = None,
    ) -> None:
        """Read `ranges` of `mapping` when given (copies on the threads), else of `direct`
        (O_DIRECT), else of `fd` (or of `path`, opened per range when fd is None), all at
        once; `callback(parts, None)`
        when the last lands, or `callback(None, error)` at the first failure, called on the
        loop. No future per range: the hot path's cheapest."""
        group = _Group(self._watch(), callback, len(ranges))
        self._submit_batch(group, ranges, fd, path, mapping, direct)

    def pread_rows(
        self,
        fd: int | None,
        path: str,
        rows: Sequence[Sequence[tuple[int, int]]],
        callback: Callable[[list[tuple[int, list[bytes] | None, OSError | None]]], None],
        mapping: Any = None,
        direct: DirectFile | None = None,
    ) -> None:
        """Read every range of `rows` (each a row's list of ranges) as `pread_ranges` does,
        all at once, but hand rows over as they complete: at each wake-up of the loop where
        some of its ranges landed, `callback(done, ok, failed, nbytes)` once: `done`, the
        rows whose last range landed (or whose first failed) since the last call, each
        `(row, parts, None)` or `(row, None, error)`; then how many ranges landed, how many
        failed and their bytes (every range counted once, a failed row's later ones too).
        Why: where reads do not land together (slow storage), a group's rows each go on at
        their own read's pace, while the loop's Python is paid per wake-up, not per row
        (server/stream/read_groups.py)."""
        group = _Rows(self._watch(), callback, rows)
        self._submit_batch(group, group.flat, fd, path, mapping, direct)

    def _submit_batch(self, group: "_Group | _Rows", ranges: Sequence[tuple[int, int]], fd: int | None, path: str,
                      mapping: Any, direct: DirectFile | None) -> None:
        """`ranges` for `group`, range i as token `group.base + i`: one call into the pool for
        them all (a path's ranges, each opened on its thread, one call each)."""
        base = group.base = self._token + 1
        self._token += len(ranges)
        self._futures.update(dict.fromkeys(range(base, base + len(ranges)), group))  # type: ignore[arg-type]
        pool = self._pool
        if mapping is not None:
            pool.submit_ranges(base, mapping, ranges)
        elif direct is not None:
            pool.submit_ranges(base, direct.fd, ranges, direct.align)
        elif fd is not None:
            pool.submit_ranges(base, fd, ranges)
        else:
            for i, (offset, size) in enumerate(ranges):
                pool.submit_path(base + i, path, offset, size)

    def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        touched: list[_Rows | _Files] = []
        for token, value in self._pool.drain():
            entry = self._futures.pop(token, None)
            if entry is None:
                continue
            kind = type(entry)
            if kind is tuple or kind is _Rows or kind is _Group or kind is _Files:  # a _Call's, or one of a group
                group, i = entry if kind is tuple else (entry, token - entry.base)
                if group.loop is not loop:  # another loop's read (tests share a store)
                    group.loop.call_soon_threadsafe(_land_elsewhere, group, i, value)
                elif group.land(i, value):
                    touched.append(group)  # its first range since the last flush: flushed after this drain
            elif entry.get_loop() is not loop:
                entry.get_loop().call_soon_threadsafe(_settle, entry, value)
            else:
                _settle(entry, value)
        for group in touched:
            group.flush()

    def close(self) -> None:
        self._closed = True
        for loop, pacer in self._pacers.items():
            pacer.cancel()
            if not loop.is_closed():
                try:
                    loop.remove_reader(self._pool.fileno())
                except (RuntimeError, ValueError):
                    pass
        self._pool.close()


#: The loop drains the pool at most once per this share of the reads' mean latency, and at
#: least every PACE_MAX_S. Why: each wake-up costs the loop its Python (the drain, each
#: group's callback chain, the stream's settling and chunking) however few reads it hands
#: over, and reads of milliseconds land a few at a time: images on latencyfs at 5 ms came
#: 3 a group's flush, 8 a wake. Paced to 1 ms, the loop's CPU per image with the cache off
#: fell from 46.7-48.8 to 41.9-42.8 us at the same images/s (three alternating runs of
#: bench/cpu_per_sample.py; server/storage/README.md); each read waits half a pace more on
#: average, which the tuner's in-flight target absorbs (Little's law).
PACE_SHARE = 0.2
PACE_MAX_S = 0.001
#: Paces below this are none: the loop's timers count whole milliseconds (libuv), and reads
#: this fast (a local disk) would wait for the pace many times their own latency.
PACE_MIN_S = 0.0005


def pace_for(latency_s: float) -> float:
    """The least time between two drains for reads of this mean latency (under PACE_MIN_S:
    none, each completion drained as it is signalled)."""
    return min(PACE_MAX_S, PACE_SHARE * latency_s)


class _Pacer:
    """One loop's drains of the pool, paced: when completions are signalled within a pace of
    the last drain, the eventfd is cleared and one drain is timed for the pace's end (the
    threads signal again only once the done list has been emptied), so nothing is lost
    or delayed by more than a pace."""

    __slots__ = ("pool", "loop", "last", "handle", "paced")

    def __init__(self, pool: NativeReadPool, loop: asyncio.AbstractEventLoop):
        self.pool, self.loop = pool, loop
        self.last = float("-inf")
        self.handle: asyncio.TimerHandle | None = None
        # A pool built before it measured its latency (`croupier.bench.readpool --against REV`
        # loads older revisions' pools): drained as each completion is signalled, unpaced.
        self.paced = hasattr(pool._pool, "latency")

    def readable(self) -> None:
        if not self.paced:
            self.drain()
            return
        pace = pace_for(self.pool._pool.latency)
        if pace < PACE_MIN_S or self.loop.time() - self.last >= pace:
            self.drain()
            return
        try:
            os.read(self.pool._pool.fileno(), 8)
        except BlockingIOError:
            pass
        if self.handle is None:
            self.handle = self.loop.call_at(self.last + pace, self.drain)

    def drain(self) -> None:
        self.cancel()
        self.last = self.loop.time()
        if not self.pool._closed:
            self.pool._drain()

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


class _Group:
    """The ranges of one `pread_ranges` call: parts as they land, one callback at the end."""

    __slots__ = ("loop", "callback", "parts", "left", "base")

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable, n: int):
        self.base = 0  # the token of range 0 (the pool's tokens for the group run on from it)
        self.loop = loop
        self.callback = callback
        self.parts: list[bytes | None] = [None] * n
        self.left = n

    def land(self, i: int, value: bytes | int) -> None:
        if self.left <= 0:
            return  # an earlier part failed: the callback was told
        if isinstance(value, int):
            self.left = -1
            self.callback(None, OSError(-value, os.strerror(-value)))
            return
        self.parts[i] = value
        self.left -= 1
        if self.left == 0:
            self.callback(self.parts, None)


class _Rows:
    """The rows of one `pread_rows` call: each row's parts as they land; the rows that
    completed since the last `flush`, and the ranges that landed, handed over together."""

    __slots__ = ("loop", "callback", "rows", "left", "parts", "single", "done", "ok", "bad", "nbytes", "queued",
                 "flat", "where", "base")

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable, rows: Sequence[Sequence[Any]]):
        self.loop = loop
        self.callback = callback
        self.rows = rows
        self.left = list(map(len, rows))  # ranges still out per row; 0 once handed over
        self.parts: dict[int, list[bytes | None]] = {}  # rows of several ranges, some landed
        self.single = bool(rows) and min(self.left) == max(self.left) == 1  # every row one range: the common case
        #: Every row's ranges in row order, range i as the pool's token `base + i`; for rows of
        #: several ranges, range i's (row, index in the row).
        self.flat = [r[0] for r in rows] if self.single else [rg for r in rows for rg in r]
        self.where = None if self.single else [(row, j) for row, r in enumerate(rows) for j in range(len(r))]
        self.base = 0
        self.done: list[tuple[int, list[bytes] | None, OSError | None]] = []
        self.ok = self.bad = self.nbytes = 0  # ranges landed since the last flush (a failed row's too)
        self.queued = False  # in the current drain's list of groups to flush

    def land(self, i: int, value: bytes | int) -> bool:
        """Range i (of `flat`) landed; True when this group must be flushed after the drain
        (the first range it got since the last flush)."""
        if type(value) is int:
            self.bad += 1
        else:
            self.ok += 1
            self.nbytes += len(value)
        row, j = (i, 0) if self.where is None else self.where[i]
        left = self.left[row]
        if left > 0:  # else its row failed at an earlier range and was handed over then
            if type(value) is int:
                self.left[row] = 0
                self.parts.pop(row, None)
                self.done.append((row, None, OSError(-value, os.strerror(-value))))
            elif self.single:
                self.left[row] = 0
                self.done.append((row, [value], None))
            else:
                parts = self.parts.get(row)
                if parts is None:
                    parts = self.parts[row] = [None] * len(self.rows[row])
                parts[j] = value
                self.left[row] = left - 1
                if left == 1:
                    del self.parts[row]
                    self.done.append((row, parts, None))  # type: ignore[arg-type]
        if self.queued:
            return False
        self.queued = True
        return True

    def flush(self) -> None:
        done, ok, bad, nbytes = self.done, self.ok, self.bad, self.nbytes
        self.done, self.ok, self.bad, self.nbytes, self.queued = [], 0, 0, 0, False
        self.callback(done, ok, bad, nbytes)


class _Files:
    """The files of one `read_files_then` call: those landed since the last `flush`, handed
    over together."""

    __slots__ = ("loop", "callback", "done", "nbytes", "queued", "base", "unread")

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable, unread: bool = False):
        self.loop = loop
        self.callback = callback
        self.unread = unread  # lookups (FILE_IDENTIFY): no bytes
        self.base = 0
        self.done: list[tuple[int, Any, OSError | None]] = []
        self.nbytes = 0
        self.queued = False

    def land(self, i: int, value: Any) -> bool:
        if type(value) is int:
            self.done.append((i, None, OSError(-value, os.strerror(-value))))
        else:
            self.done.append((i, value, None))
            if not self.unread:
                self.nbytes += len(value) if type(value) is bytes else len(value[0])
        if self.queued:
            return False
        self.queued = True
        return True

    def flush(self) -> None:
        done, nbytes = self.done, self.nbytes
        self.done, self.nbytes, self.queued = [], 0, False
        self.callback(done, nbytes)


def _land_elsewhere(group: "_Group | _Rows | _Files | _Call", i: int, value: Any) -> None:
    """A range landed for another loop's read, on that loop (tests share a store)."""
    if group.land(i, value):
        group.flush()  # type: ignore[union-attr]


class _Call:
    """One read without a future: its callback, told on the loop it was submitted from."""

    __slots__ = ("loop", "callback")

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable):
        self.loop = loop
        self.callback = callback

    def land(self, _i: int, value: Any) -> None:
        if isinstance(value, int):
            self.callback(None, OSError(-value, os.strerror(-value)))
        else:
            self.callback(value, None)


def whole_result(value: tuple) -> tuple[bytes, FileVersion]:
    """A `read_whole` future's result as (bytes, FileVersion)."""
    return value[0], FileVersion(os.fsdecode(value[1]), *value[2:])


def identify_result(value: tuple) -> FileVersion:
    """An `identify` future's result as a FileVersion."""
    return FileVersion(os.fsdecode(value[0]), *value[1:])


def start_whole(pool: NativeReadPool, stats: StoreStats, path: str, roots: bytes | None, callback: Callable,
                versioned: bool, error: Callable[[OSError, str], BaseException] | None = None) -> None:
    """A store's `submit_whole` (`versioned`: `submit_whole_versioned`) on the native pool:
    `path` read whole, counted in `stats` as one read, as `Store.read` counts it; an error
    passed through `error(exc, path)` where the store maps them (confinement)."""
    stats.started()
    landed = functools.partial(_whole_landed, stats, callback, versioned, path, error)
    try:
        if versioned:
            pool.read_whole_then(path, roots, landed)
        else:
            pool.read_path_then(path, roots, landed)
    except BaseException:  # not submitted (the pool closed): not in flight
        stats.finished(0, ok=False)
        raise


#: `read_files_then`'s kinds (the native pool's job kinds): bytes; bytes and which file they
#: came from; which file a name leads to now, unread.
FILE_BYTES, FILE_WHOLE, FILE_IDENTIFY = 0, 1, 2


def start_files(pool: NativeReadPool, stats: StoreStats, paths: Sequence[str], roots: bytes | None, versioned: bool,
                callback: Callable[[list[tuple[int, Any, BaseException | None]]], None],
                error: Callable[[OSError, str], BaseException] | None = None, inline: Any = None) -> int:
    """A store's `submit_files` on the native pool: `paths` read whole by one call, counted
    in `stats` as one read each; `callback(done)` once per wake-up with the files landed
    since, each (position, bytes or (bytes, FileVersion), None) or (position, None, error),
    an error passed through `error(exc, path)` where the store maps them (confinement).
    `inline` (an inline_files.InlineFiles): the files it can read now on the loop are read
    so and handed over on the loop's next turn, the rest go to the pool. Returns how many
    were read on the loop."""
    stats.started(len(paths))

    def landed(done: list[tuple[int, Any, OSError | None]], nbytes: int) -> None:
        bad = 0
        for k, (i, value, err) in enumerate(done):
            if err is not None:
                bad += 1
                if error is not None:
                    done[k] = (i, None, error(err, paths[i]))
            elif versioned:
                done[k] = (i, whole_result(value), None)
        if bad < len(done):
            stats.finished(nbytes, len(done) - bad)
        if bad:
            stats.finished(0, bad, ok=False)
        callback(done)  # type: ignore[arg-type]

    def landed_now(done: list[tuple[int, Any, None]], nbytes: int) -> None:  # read on the loop: none failed
        if versioned:
            done[:] = [(i, whole_result(value), None) for i, value, _ in done]
        stats.finished(nbytes, len(done))
        callback(done)

    kind = FILE_WHOLE if versioned else FILE_BYTES
    ready = inline.read_now(paths, kind, roots) if inline is not None else None
    now: list = ready[0] if ready is not None else []
    if now:
        _, rest, nbytes = ready  # type: ignore[misc]
        asyncio.get_running_loop().call_soon(landed_now, now, nbytes)
        if not rest:
            return len(now)
        pooled, to_pool = [paths[i] for i in rest], functools.partial(_renumbered, rest, landed)
    else:
        pooled, to_pool = paths, landed
    try:
        pool.read_files_then(pooled, roots, kind, to_pool)
    except BaseException as exc:  # not submitted (the pool closed): not in flight
        if not now or not isinstance(exc, Exception):
            stats.finished(0, len(pooled), ok=False)
            raise
        # Part of the group is handed over already: the rest fail in the same way, never twice.
        failed = OSError(errno.ECANCELED, f"not read: {exc}")
        asyncio.get_running_loop().call_soon(to_pool, [(j, None, failed) for j in range(len(pooled))], 0)
    return len(now)


def _renumbered(positions: list[int], landed: Callable, done: list[tuple[int, Any, OSError | None]],
                nbytes: int) -> None:
    """Files landed from a part of a group, by their positions in the whole group."""
    landed([(positions[j], value, err) for j, value, err in done], nbytes)


def start_identities(pool: NativeReadPool, paths: Sequence[str], roots: bytes | None,
                     callback: Callable[[list[tuple[int, FileVersion | None]]], None]) -> None:
    """A store's `submit_versions` on the native pool: which file each of `paths` leads to
    now, by one call; `callback([(position, version or None), ...])` once per wake-up, None
    where a name leads to no file (or none under `roots`), as `version` answers."""
    def landed(done: list[tuple[int, Any, OSError | None]], _: int) -> None:
        callback([(i, None if err is not None else identify_result(value)) for i, value, err in done])

    pool.read_files_then(paths, roots, FILE_IDENTIFY, landed)


def _whole_landed(stats: StoreStats, callback: Callable, versioned: bool, path: str,
                  error: Callable[[OSError, str], BaseException] | None, value: Any, err: OSError | None) -> None:
    if err is not None:
        stats.finished(0, ok=False)
        callback(None, err if error is None else error(err, path))
        return
    if versioned:
        value = whole_result(value)
        stats.finished(len(value[0]))
    else:
        stats.finished(len(value))
    callback(value, None)


def start_identify(pool: NativeReadPool, path: str, roots: bytes | None, callback: Callable[[FileVersion | None], None]) -> None:
    """A store's `submit_version` on the native pool: `callback(version)`, None where the
    name leads to no file (or none under `roots`), as `version` answers."""
    pool.identify_then(path, roots, functools.partial(_identified, callback))


def _identified(callback: Callable[[FileVersion | None], None], value: Any, err: OSError | None) -> None:
    callback(None if err is not None else identify_result(value))


def _settle(fut: asyncio.Future[Any], value: bytes | int) -> None:
    if fut.cancelled():
        return
    if isinstance(value, int):
        fut.set_exception(OSError(-value, os.strerror(-value)))
    else:
        fut.set_result(value)
