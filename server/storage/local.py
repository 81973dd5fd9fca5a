"""Local and network file systems (ext4, NFS, Lustre, FUSE mounts): preads on a pool.

Each async read is one pread on a thread that only waits on storage, so as many reads
are in flight as the server's read limit allows: the native pool (native.py, threads
that never take the GIL) when it is built, else the Python one (iopool.py). Files a
dataset reads row by row are opened once and kept (`pin`: an open on NFS or FUSE costs
a round trip of its own), marked POSIX_FADV_RANDOM so that a 1 KB row does not pull
128 KB of kernel read-ahead over the network; other files (images) are opened, read and
closed by the thread that reads them.

A pinned file is read one of three ways, chosen per mount (st_dev) by measurement when the
mount's first file is pinned (readpath.py): preads, copies out of a read-only mapping
of the file, whose page faults the pool's threads take (on a FUSE mount with the kernel's
default cap on background requests, a way past it), or reads of the file opened a second
time with O_DIRECT (past the cap where the FUSE daemon did not ask for async direct
I/O; where the file system refuses O_DIRECT, preads, and the reason is logged).
CROUPIER_READ_PATH or `read_path=` forces one. The Python pool reads with preads only.
A measured mount is watched from the store's own counters (readpath.Watch): when its path
completes far fewer reads at once than are asked of it, it is probed again (on a thread
of its own, at most once per `revisit_interval_s`) and switched, with a log line.

On a local file system (ext4, xfs, tmpfs...), a group of ranges read by preads is first
tried on the loop from the page cache alone (RWF_NOWAIT: it never waits for the disk, and
answers "not cached" instead); only a group that is not all cached goes to the threads.
A 1 KB read from the page cache is under a microsecond; through a thread it is a wake-up,
an eventfd and a drain, several times that, and on 2 cores the woken thread takes the
loop's core. FUSE refuses RWF_NOWAIT, so its reads stay on the threads.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import math
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .base import FileEntry, FileVersion, Range, Store
from . import native, readpath
from .gate import ReadGate
from .iopool import IOPool

log = logging.getLogger("croupier.server.storage")

#: Set to 0 to read every range on the read threads, none on the loop (A/B measurements).
INLINE_ENV = "CROUPIER_INLINE_READS"
#: The most bytes one group reads on the loop from the page cache: a copy this size takes
#: tens of microseconds, beyond which the loop would wait on memcpy a thread could do.
INLINE_MAX_BYTES = 256 << 10

#: Open files kept at once; older unused ones are closed (stays well under ulimit -n).
DEFAULT_MAX_OPEN_FILES = 512


class _FileCache:
    """path -> open fd, at most `limit` unused ones kept; fds in use are never closed."""

    def __init__(self, limit: int):
        self.limit = limit
        self._fds: collections.OrderedDict[str, list[int]] = collections.OrderedDict()  # path -> [fd, users]
        self._lock = threading.Lock()

    def acquire(self, path: str) -> int:
        with self._lock:
            entry = self._fds.get(path)
            if entry is not None:
                entry[1] += 1
                self._fds.move_to_end(path)
                return entry[0]
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise IsADirectoryError(f"{path} is not a regular file")
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            entry = self._fds.get(path)
            if entry is not None:  # another thread opened it meanwhile: keep one
                entry[1] += 1
                os.close(fd)
                return entry[0]
            self._fds[path] = [fd, 1]
            self._evict()
            return fd

    def release(self, path: str) -> None:
        with self._lock:
            entry = self._fds.get(path)
            if entry is not None:
                entry[1] -= 1
            self._evict()

    def _evict(self) -> None:
        """Close the least recently used unused files until at most `limit` are open
        (files in use stay open: a pread may be running on them)."""
        excess = len(self._fds) - self.limit
        if excess <= 0:
            return
        victims = []
        for path, (_, users) in self._fds.items():  # oldest first
            if users == 0:
                victims.append(path)
                if len(victims) == excess:
                    break
        for path in victims:
            os.close(self._fds.pop(path)[0])

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _pread_all(fd: int, offset: int, size: int) -> bytes:
    if size < 0:
        size = max(os.fstat(fd).st_size - offset, 0)
    parts, got = [], 0
    while got < size:  # pread may return less than asked (signals, some file systems)
        part = os.pread(fd, size - got, offset + got)
        if not part:
            break  # end of file: the caller sees fewer bytes than it asked for
        parts.append(part)
        got += len(part)
    if len(parts) == 1:
        return parts[0]
    return b"".join(parts)


def _close_retired(left: list[Any]) -> None:
    """Close what a path change or a remap left: O_DIRECT fds and mappings."""
    for old in left:
        if isinstance(old, int):
            os.close(old)
        else:
            old.close()  # a Mapping: unmapped once reads in flight land


def fd_version(fd: int, path: str, st: os.stat_result | None = None) -> FileVersion:
    """Which file open `fd` (opened by `path`) is: the kernel's name for it, and its stat."""
    st = st or os.fstat(fd)
    real = os.readlink(f"/proc/self/fd/{fd}") if os.path.isdir("/proc/self/fd") else os.path.realpath(path)
    return FileVersion(real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def read_whole_versioned_fd(fd: int, path: str) -> tuple[bytes, FileVersion]:
    """Open `fd` read whole, and which version those bytes are (size -1 when the file
    changed while it was read): the Python pool's `NativeReadPool.read_whole`."""
    version = fd_version(fd, path)
    data = _pread_all(fd, 0, version.size)
    after = os.fstat(fd)
    if (after.st_size, after.st_mtime_ns) != (version.size, version.mtime_ns) or len(data) != version.size:
        version = version._replace(size=-1)
    return data, version


def path_version(path: str, inside: Callable[[str], bool] | None = None) -> FileVersion | None:
    """Which file `path` names now, opened O_PATH (no open on the file system): the Python
    pool's `NativeReadPool.identify`. None where it is no regular file, or its resolved path
    is not `inside`."""
    fd = os.open(path, getattr(os, "O_PATH", os.O_RDONLY) | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        version = fd_version(fd, path, st)
        ok = stat.S_ISREG(st.st_mode) and (inside is None or inside(version.real))
        return version if ok else None
    finally:
        os.close(fd)


def scandir_names(path: str, on_link: Callable[[str], object] | None = None) -> tuple[list[str], list[str]]:
    """(subfolder names, file names) of `path`, sorted, from readdir's names and types:
    no stat per file (a link is followed, a stat each). `on_link(path)` sees each link."""
    dirs, files = [], []
    with os.scandir(path) as it:
        for e in it:
            link = e.is_symlink()
            if on_link is not None and link:
                on_link(e.path)
            if e.is_dir():
                if link and _loops_back(e.path, path):
                    continue
                dirs.append(e.name)
            elif e.is_file():
                files.append(e.name)
    return sorted(dirs), sorted(files)


def _loops_back(link: str, folder: str) -> bool:
    """Whether the folder link `link` in `folder` points at `folder` or one of its parents:
    followed, it would list the same files again and again (until ELOOP, 40 levels down)."""
    target, here = os.path.realpath(link), os.path.realpath(folder)
    if here == target or here.startswith(target.rstrip(os.sep) + os.sep):
        log.warning("skipped %s -> %s: it links to a folder that contains it (a loop)", link, target)
        return True
    return False


def _raise_open_files_limit() -> None:
    """Datasets keep their files open: lift the soft limit on open files to the hard one
    (servers commonly do; 1,024 is a common soft default)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else 1 << 20
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


class LocalStore(Store):
    scheme = "file"

    def __init__(
        self,
        io_threads: int = 256,
        max_open_files: int = DEFAULT_MAX_OPEN_FILES,
        pool: IOPool | None = None,
        native_pool: bool | None = None,
        read_path: str | None = None,
        revisit_window_s: float = readpath.REVISIT_WINDOW_S,
        revisit_interval_s: float = readpath.REVISIT_INTERVAL_S,
        inline_reads: bool | None = None,
    ):
        super().__init__()
        #: Read ranges the page cache holds on the loop (RWF_NOWAIT) where the file system
        #: takes it, and (through a ConfinedStore) small cached files whole (inline_files.py);
        #: from CROUPIER_INLINE_READS (default on) when None.
        self.inline = (os.environ.get(INLINE_ENV, "1") != "0") if inline_reads is None else inline_reads
        #: "pread", "mmap" or "auto" (measure per mount); from CROUPIER_READ_PATH when None.
        self.read_path = readpath.resolve(read_path)
        self.io_threads = io_threads
        use_native = native.available() if native_pool is None else native_pool
        #: The native pool when built (and not turned off), else None.
        self.native = native.NativeReadPool(io_threads) if use_native and pool is None else None
        self.pool = pool or IOPool(io_threads)
        self._files = _FileCache(max_open_files)
        self._pinned: dict[str, int] = {}  # path -> fd, read without a lock on the hot path
        self._pins: dict[str, int] = {}  # path -> datasets that pinned it
        self._pin_lock = threading.Lock()
        self._maps: dict[str, object] = {}  # path -> native.Mapping, for mounts read by page faults
        #: path -> its descriptors in turn, for mounts whose preads are spread over several (readpath.time_handles)
        self._spread: dict[str, Iterator[int]] = {}
        self._extra_fds: dict[str, list[int]] = {}  # path -> the descriptors opened for spreading, closed at unpin
        self._direct: dict[str, native.DirectFile] = {}  # path -> its O_DIRECT fd, for mounts read so
        self._mounts: dict[int, readpath.Choice] = {}  # st_dev -> its read path
        #: Reads issued by each path (counted on the event loop's thread).
        self.path_reads = {"pread": 0, "mmap": 0, "direct": 0}
        #: Of those preads, the ones read on the loop from the page cache (`_read_inline`).
        self.inline_reads = 0
        self._inline: dict[str, int] = {}  # pinned path -> fd, on a local file system that may take inline reads
        self._revisit = (revisit_window_s, revisit_interval_s)
        self._dev_of: dict[str, int] = {}  # pinned path -> st_dev of its mount
        self._watches: dict[int, readpath.Watch] = {}  # st_dev -> its watch, for measured mounts
        #: st_dev -> the gate that holds a daemon-bound mount's reads in flight (readpath.read_limit)
        self._gates: dict[int, ReadGate] = {}
        #: path -> what a path change or a remap left (O_DIRECT fds, mappings), closed at unpin:
        #: the loop may be submitting a read on one right now (changes happen on other threads)
        self._retired: dict[str, list[Any]] = {}
        #: (mount point, old path, new path) of each change made online, in order.
        self.revisits: list[tuple[str, str, str]] = []
        self._revisit_threads: list[threading.Thread] = []
        self._probing: set[int] = set()  # mounts being probed again now (one probe at a time)
        _raise_open_files_limit()

    @property
    def threads(self) -> int:
        """Threads started to wait on reads."""
        return self.native.threads if self.native is not None else self.pool.threads

    def pin(self, path: str) -> None:
        """Keep `path` open until as many `unpin`s (blocking: call at dataset open time);
        mapped too when its mount is read by page faults (the first pin on a mount
        measures which path it wants)."""
        with self._pin_lock:
            if path in self._pinned:
                self._pins[path] += 1
                self._remap_if_grown(path)
                return
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                choice = self._mount_choice(fd, path)
                if choice.path == "mmap":
                    self._maps[path] = native.Mapping(fd)
                elif choice.path == "direct":
                    self._open_direct(choice, path)
                elif choice.handles > 1:
                    self._spread_over(path, fd, choice.handles)
            except BaseException:
                os.close(fd)
                self._close_extra(path)
                raise
            self._pinned[path] = fd
            self._pins[path] = 1
            self._dev_of[path] = os.fstat(fd).st_dev
            if (self.inline and native.read_nowait is not None and self.native is not None and choice.path == "pread"
                    and choice.mount.is_local and path not in self._spread):
                self._inline[path] = fd

    def _spread_over(self, path: str, fd: int, handles: int) -> None:
        """Open `path` `handles - 1` more times (each its own handle in the FUSE daemon) and
        take its preads' descriptors in turn."""
        extra = self._extra_fds.setdefault(path, [])
        for _ in range(handles - 1):
            more = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            extra.append(more)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(more, 0, 0, os.POSIX_FADV_RANDOM)
        self._spread[path] = itertools.cycle([fd, *extra])

    def _close_extra(self, path: str) -> None:
        self._spread.pop(path, None)
        for fd in self._extra_fds.pop(path, []):
            os.close(fd)

    def _open_direct(self, choice: readpath.Choice, path: str) -> None:
        """`path` opened a second time with O_DIRECT (its buffered fd stays for the rest);
        where the file system refuses, the mount falls back to preads, said once."""
        direct = readpath.open_direct(choice, path)
        if direct is not None:
            self._direct[path] = direct
            return
        why = choice.unavailable["direct"]
        log.warning("storage: %s (%s): O_DIRECT reads are unavailable: %s; reading it by preads",
                    choice.mount.point, choice.mount.fs_type, why)
        choice.path, choice.reason = "pread", f"{choice.reason}; O_DIRECT unavailable ({why}): preads"

    def _mount_choice(self, fd: int, path: str) -> readpath.Choice:
        """The read path of the mount `fd` lies on: measured once per mount (forced by
        read_path; preads only without the native pool)."""
        st = os.fstat(fd)
        choice = self._mounts.get(st.st_dev)
        if choice is not None:
            return choice
        mount = readpath.mount_of(st.st_dev, path)
        if self.native is None:
            choice = readpath.Choice(mount, "pread", "the Python read pool has preads only", asked=self.io_threads)
        elif self.read_path != "auto":
            choice = readpath.Choice(mount, self.read_path, f"forced ({readpath.ENV} or read_path)", asked=self.io_threads)
        elif mount.is_local:
            choice = readpath.Choice(mount, "pread", f"a local file system ({mount.fs_type}): no request cap",
                                     asked=self.io_threads)
        else:
            measured = readpath.probe(fd, st.st_size, mount, self.io_threads, path=path)
            if measured is None:  # too small to measure: preads, and the next file tries again
                return readpath.Choice(mount, "pread", "not measured yet", asked=self.io_threads)
            choice = measured
            readpath.time_handles(choice, path, st.st_size)
            readpath.report(choice)
            self._watch(st.st_dev, choice)
            self._gate(st.st_dev, choice)
        self._mounts[st.st_dev] = choice
        return choice

    def _watch(self, dev: int, choice: readpath.Choice, last_probe: float = -math.inf) -> None:
        """Watch a measured mount's reads (readpath.Watch)."""
        window, interval = self._revisit
        self._watches[dev] = readpath.Watch(choice.latency_s, time.monotonic(), window, interval, last_probe)

    def _gate(self, dev: int, choice: readpath.Choice) -> None:
        """Hold mount `dev`'s reads in flight to `readpath.read_limit(choice)` (none: no
        gate; reads waiting at a gate that goes start at once)."""
        limit = readpath.read_limit(choice)
        gate = self._gates.get(dev)
        if gate is None:
            if limit is not None:
                self._gates[dev] = ReadGate(limit)
            return
        if limit is None:
            del self._gates[dev]
        gate.set_limit_threadsafe(limit or 1 << 30)

    def _gate_of(self, path: str) -> ReadGate | None:
        """The gate of the mount pinned file `path` lies on (None: no gate)."""
        return self._gates.get(self._dev_of.get(path, -1)) if self._gates else None

    def _watch_of(self, path: str) -> readpath.Watch | None:
        """The watch of the mount pinned file `path` lies on (None: not watched)."""
        return self._watches.get(self._dev_of.get(path, -1)) if self._watches else None

    def _read_path_of(self, path: str, n: int) -> tuple[Any, native.DirectFile | None]:
        """`path`'s mapping or O_DIRECT file (both None: preads), `n` reads counted on that path."""
        mapping, direct = self._maps.get(path), self._direct.get(path)
        self.path_reads["mmap" if mapping is not None else "direct" if direct is not None else "pread"] += n
        return mapping, direct

    def _pread_fd(self, path: str) -> int | None:
        """The descriptor a pread of `path` goes to: the next of its spread ones, else the pinned one."""
        spread = self._spread.get(path) if self._spread else None
        return next(spread) if spread is not None else self._pinned.get(path)

    def gates(self) -> dict[str, ReadGate]:
        """Each gated mount's point and its gate (metrics, tests)."""
        return {self._mounts[dev].mount.point: g for dev, g in list(self._gates.items()) if dev in self._mounts}

    def _landed(self, path: str, watch: readpath.Watch, n: int) -> None:
        """Reads on a watched mount landed (on the loop): probe it again when its watch says so."""
        if not watch.finished(n, time.monotonic()):
            return
        dev = self._dev_of.get(path)
        if dev is None or self._watches.get(dev) is not watch or dev in self._probing:
            return  # unpinned, or being probed again
        self._probing.add(dev)
        t = threading.Thread(target=self._revisit_mount, args=(dev, path, watch), name="croupier-reprobe", daemon=True)
        self._revisit_threads.append(t)
        t.start()

    def _revisit_mount(self, dev: int, path: str, watch: readpath.Watch) -> None:
        """Probe mount `dev` again on pinned file `path` (off the loop), and switch its files
        to the path measured now, with one log line when it changed."""
        try:
            self._probe_again(dev, path, watch)
        finally:
            self._probing.discard(dev)

    def _probe_again(self, dev: int, path: str, watch: readpath.Watch) -> None:
        with self._pin_lock:
            fd = self._pinned.get(path)
            fd = os.dup(fd) if fd is not None else None  # unpin may close the store's meanwhile
        if fd is None:
            return
        try:
            old = self._mounts[dev]
            # the page cache must not answer the probe: drop the file's pages (re-read on demand)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            new = readpath.probe(fd, os.fstat(fd).st_size, old.mount, self.io_threads, path=path,
                                 seed=time.monotonic_ns(), latency_s=old.latency_s)
        except OSError as e:
            log.warning("storage: probing %s again failed: %s", old.mount.point, e)
            return
        finally:
            os.close(fd)
        if new is None:
            return
        if readpath.keeps_spread(old, new):  # its files stay spread, read by preads
            new.path, new.handles, new.spread = "pread", old.handles, old.spread
        with self._pin_lock:
            asked, achieved = watch.last_window or (0.0, 0.0)
            rates = readpath.rates_line(new)
            self._mounts[dev] = new
            self._gate(dev, new)
            if new.path != old.path:
                self._switch(dev, new)
                self.revisits.append((old.mount.point, old.path, new.path))
                log.warning("storage: %s (%s): the read path changed from %s to %s: %.0f reads were asked at once "
                            "but only about %.0f completed (Little's law over %.1f s); measured again: %s",
                            old.mount.point, old.mount.fs_type, old.path, new.path, asked, achieved, watch.window_s,
                            rates)
                readpath.report(new)
                self._watch(dev, new, last_probe=watch.last_probe)
            else:  # a false alarm (a busy CPU, a slow start, a slower storage): it spends no interval
                self._watches[dev] = watch.confirmed(new.latency_s, time.monotonic())
                log.info("storage: %s (%s): probed again after %.0f reads were asked at once but only about %.0f "
                         "completed; %s still reads fastest (%s)", old.mount.point, old.mount.fs_type, asked,
                         achieved, new.path, rates)

    def _switch(self, dev: int, new: readpath.Choice) -> None:
        """Read mount `dev`'s pinned files by `new.path` (with _pin_lock held). The new path's
        mapping or O_DIRECT fd is in place before the old one goes: a read in flight keeps
        a mapping alive, and a replaced O_DIRECT fd stays open until its file is unpinned."""
        for path, d in list(self._dev_of.items()):
            if d != dev:
                continue
            if new.path == "mmap" and path not in self._maps:
                self._maps[path] = native.Mapping(self._pinned[path])
            elif new.path == "direct" and path not in self._direct:
                direct = readpath.open_direct(new, path)
                if direct is None:
                    new.path = "pread"
                else:
                    self._direct[path] = direct
            if new.path != "direct" and path in self._direct:
                self._retired.setdefault(path, []).append(self._direct.pop(path).fd)
            if new.path != "mmap" and path in self._maps:
                self._retired.setdefault(path, []).append(self._maps.pop(path))

    def join_revisits(self, timeout: float | None = None) -> None:
        """Wait for the mounts being probed again (tests, shutdown)."""
        for t in list(self._revisit_threads):
            t.join(timeout)

    def read_paths(self) -> list[readpath.Choice]:
        """Each mount's read path and its measurement (for metrics and `probe`)."""
        return list(self._mounts.values())

    def _remap_if_grown(self, path: str) -> None:
        """A pinned file pinned again has grown: map its new length (reads in flight keep
        the old mapping; ranges past a mapping are read with pread meanwhile)."""
        old = self._maps.get(path)
        if old is not None and os.fstat(self._pinned[path]).st_size > old.size:  # type: ignore[attr-defined]
            self._maps[path] = native.Mapping(self._pinned[path])
            self._retired.setdefault(path, []).append(old)

    def pinned_fd(self, path: str) -> int | None:
        """The descriptor `pin` keeps open for `path` (None: not pinned)."""
        return self._pinned.get(path)

    def unpin(self, path: str) -> None:
        """The dataset that pinned `path` is closed (its reads are over)."""
        with self._pin_lock:
            if path not in self._pins:
                return
            self._pins[path] -= 1
            if self._pins[path] == 0:
                del self._pins[path]
                mapping = self._maps.pop(path, None)
                if mapping is not None:
                    mapping.close()  # type: ignore[attr-defined]  # unmapped once reads in flight land
                direct = self._direct.pop(path, None)
                if direct is not None:
                    os.close(direct.fd)
                self._close_extra(path)
                _close_retired(self._retired.pop(path, []))
                self._dev_of.pop(path, None)
                self._inline.pop(path, None)
                os.close(self._pinned.pop(path))

    def url(self, path: str) -> str:
        return path

    def join(self, base: str, *parts: str) -> str:
        return os.path.join(base, *parts)

    def size(self, path: str) -> int:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise IsADirectoryError(f"{path} is not a regular file")
        return st.st_size

    def is_file(self, path: str) -> bool:
        return os.path.isfile(path)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def list_dir(self, path: str) -> tuple[list[str], list[FileEntry]]:
        dirs, files = [], []
        with os.scandir(path) as it:
            for e in it:
                if e.is_dir():  # follows links, as ImageFolder's walk does
                    dirs.append(e.name)
                elif e.is_file():
                    files.append(FileEntry(e.path, e.stat().st_size))
        return sorted(dirs), sorted(files, key=lambda f: f.path)

    def list_names(self, path: str) -> tuple[list[str], list[str]]:
        return scandir_names(path)

    def _pread(self, path: str, offset: int, size: int) -> bytes:
        fd = self._pinned.get(path)
        if fd is not None:
            return _pread_all(fd, offset, size)
        fd = self._files.acquire(path)
        try:
            return _pread_all(fd, offset, size)
        finally:
            self._files.release(path)

    def _preads(self, path: str, ranges: Sequence[Range]) -> list[bytes]:
        fd = self._pinned.get(path)
        if fd is not None:
            return [_pread_all(fd, o, s) for o, s in ranges]
        fd = self._files.acquire(path)
        try:
            return [_pread_all(fd, o, s) for o, s in ranges]
        finally:
            self._files.release(path)

    def _read_range(self, path: str, offset: int, size: int) -> bytes:
        return self._pread(path, offset, size)

    def _native_read(self, path: str, offset: int, size: int) -> "asyncio.Future[bytes]":
        gate = self._gate_of(path)
        if gate is not None:
            fut = gate.run(lambda: self._native_read_by_path(path, offset, size))
        else:
            fut = self._native_read_by_path(path, offset, size)
        watch = self._watch_of(path)
        if watch is not None:
            watch.started(1, time.monotonic())
            fut.add_done_callback(lambda _f: self._landed(path, watch, 1))
        return fut

    def _native_read_by_path(self, path: str, offset: int, size: int) -> "asyncio.Future[bytes]":
        assert self.native is not None
        mapping = self._maps.get(path)
        if mapping is not None:
            self.path_reads["mmap"] += 1
            return self.native.map_read(mapping, offset, size)
        direct = self._direct.get(path)
        if direct is not None:
            self.path_reads["direct"] += 1
            return self.native.direct_read(direct, offset, size)
        self.path_reads["pread"] += 1
        fd = self._pread_fd(path)
        if fd is not None:
            return self.native.pread(fd, offset, size)
        return self.native.pread_path(path, offset, size)

    async def _read(self, path: str, offset: int, size: int) -> bytes:
        if self.native is not None:
            return await self._native_read(path, offset, size)
        self.path_reads["pread"] += 1
        return await self.pool.submit(self._pread, path, offset, size)

    async def _read_whole_versioned(self, path: str) -> tuple[bytes, FileVersion | None]:
        if path in self._pinned:  # read by its path of choice; the cache keys pinned files itself
            return await self._read(path, 0, -1), None
        self.path_reads["pread"] += 1
        if self.native is not None:
            return native.whole_result(await self.native.read_whole(path))
        return await self.pool.submit(self._whole_versioned, path)

    def _whole_versioned(self, path: str) -> tuple[bytes, FileVersion]:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return read_whole_versioned_fd(fd, path)
        finally:
            os.close(fd)

    async def version(self, path: str) -> FileVersion | None:
        try:
            if self.native is not None:
                return native.identify_result(await self.native.identify(path))
            return await self.pool.submit(path_version, path)
        except OSError:
            return None  # gone, or no file: a read says so

    async def _read_ranges(self, path: str, ranges: Sequence[Range]) -> list[bytes]:
        if self.native is not None:
            return list(await asyncio.gather(*(self._native_read(path, o, s) for o, s in ranges)))
        if len(ranges) == 1:
            self.path_reads["pread"] += 1
            return [await self.pool.submit(self._pread, path, *ranges[0])]
        return await super()._read_ranges(path, ranges)

    def submit_whole(self, path: str, callback: Callable[..., None]) -> bool:
        return self._start_whole(path, callback, versioned=False)

    def submit_whole_versioned(self, path: str, callback: Callable[..., None]) -> bool:
        return self._start_whole(path, callback, versioned=True)

    def _start_whole(self, path: str, callback: Callable[..., None], versioned: bool) -> bool:
        if self.native is None or path in self._pinned:  # a pinned file: its read path of choice, awaited
            return False
        self.path_reads["pread"] += 1
        native.start_whole(self.native, self.stats, path, None, callback, versioned)
        return True

    def submit_files(self, paths: Sequence[str], versioned: bool, callback: Callable[..., None]) -> bool:
        if self.native is None or not paths or any(p in self._pinned for p in paths):
            return False
        self.path_reads["pread"] += len(paths)
        native.start_files(self.native, self.stats, paths, None, versioned, callback)
        return True

    def submit_versions(self, paths: Sequence[str], callback: Callable[..., None]) -> bool:
        if self.native is None or not paths:
            return False
        native.start_identities(self.native, paths, None, callback)
        return True

    def submit_version(self, path: str, callback: Callable[[FileVersion | None], None]) -> bool:
        if self.native is None:
            return False
        native.start_identify(self.native, path, None, callback)
        return True

    def submit_ranges(self, path: str, ranges: Sequence[Range], callback) -> bool:
        n = len(ranges)
        stats = self.stats
        stats.started(n)
        watch = self._watch_of(path)
        if watch is not None:
            watch.started(n, time.monotonic())

        def counted(parts: list[bytes] | None, err: BaseException | None) -> None:
            stats.finished(sum(map(len, parts)) if parts is not None else 0, n, ok=err is None)
            if watch is not None:
                self._landed(path, watch, n)
            callback(parts, err)

        if self.native is not None:
            gate = self._gate_of(path)
            if gate is None:
                if not (self._inline and self._read_inline(path, ranges, counted)):
                    self._start_ranges(path, ranges, counted)
                return True

            def released(parts: list[bytes] | None, err: BaseException | None) -> None:
                gate.release(n)
                counted(parts, err)

            def start() -> None:
                try:
                    self._start_ranges(path, ranges, released)
                except BaseException as e:  # noqa: BLE001  # it could not start: its caller hears it
                    released(None, e)

            gate.submit(n, start)
            return True

        def landed(f: "asyncio.Future[list[bytes]]") -> None:
            if f.cancelled():
                counted(None, asyncio.CancelledError())
            elif f.exception() is not None:
                counted(None, f.exception())
            else:
                counted(f.result(), None)

        self.path_reads["pread"] += n
        self.pool.submit(self._preads, path, ranges).add_done_callback(landed)
        return True

    def submit_rows(self, path: str, rows: Sequence[Sequence[Range]], callback) -> bool:
        n = sum(map(len, rows))
        if self.native is None or n == 0:
            return False
        stats = self.stats
        stats.started(n)
        watch = self._watch_of(path)
        if watch is not None:
            watch.started(n, time.monotonic())
        gate = self._gate_of(path)

        def counted(done: list[tuple[int, list[bytes] | None, BaseException | None]], ok: int, bad: int,
                    nbytes: int) -> None:
            if gate is not None:
                gate.release(ok + bad)
            stats.finished(nbytes, ok, ok=True)
            if bad:
                stats.finished(0, bad, ok=False)
            if watch is not None:
                self._landed(path, watch, ok + bad)
            if done:
                callback(done)

        def start(which: Sequence[int]) -> None:
            mapping, direct = self._read_path_of(path, sum(len(rows[r]) for r in which))
            landed = counted if len(which) == len(rows) else (
                lambda done, *counts: counted([(which[k], parts, err) for k, parts, err in done], *counts))
            try:
                self.native.pread_rows(self._pread_fd(path), path,  # type: ignore[union-attr]
                                       rows if landed is counted else [rows[r] for r in which], landed, mapping, direct)
            except BaseException as e:  # noqa: BLE001  # it could not start: its caller hears of every row
                counted([(r, None, e) for r in which], 0, sum(len(rows[r]) for r in which), 0)

        if gate is None:
            start(range(len(rows)))
        else:  # each row waits its turn: a group would pass the gate as one, past its limit
            for r in range(len(rows)):
                gate.submit(len(rows[r]), functools.partial(start, (r,)))
        return True

    def _read_inline(self, path: str, ranges: Sequence[Range], callback: Callable) -> bool:
        """`ranges` of `path` read now on the loop where the page cache holds every one
        (`native.read_nowait`), `callback` called soon on the loop; False where not (a page
        missing, more than INLINE_MAX_BYTES, a file not taken inline). A file system that
        refuses RWF_NOWAIT is not asked again for that file."""
        fd = self._inline.get(path)
        if fd is None:
            return False
        try:
            parts = native.read_nowait(fd, ranges, INLINE_MAX_BYTES)  # type: ignore[misc]
        except OSError as e:
            log.debug("storage: %s: no reads from the page cache on the loop: %s", path, e)
            self._inline.pop(path, None)
            return False
        if parts is None:
            return False
        self.path_reads["pread"] += len(ranges)
        self.inline_reads += len(ranges)
        asyncio.get_running_loop().call_soon(callback, parts, None)
        return True

    def _start_ranges(self, path: str, ranges: Sequence[Range], callback: Callable) -> None:
        """Reads of `ranges` of `path` on the native pool, by the file's read path."""
        assert self.native is not None
        mapping, direct = self._read_path_of(path, len(ranges))
        self.native.pread_ranges(self._pread_fd(path), path, ranges, callback, mapping, direct)

    def close(self) -> None:
        if self.native is not None:
            self.native.close()
        self.pool.close()
        self._files.close()
        with self._pin_lock:
            for mapping in self._maps.values():
                mapping.close()  # type: ignore[attr-defined]
            self._maps.clear()
            for direct in self._direct.values():
                os.close(direct.fd)
            self._direct.clear()
            for left in self._retired.values():
                _close_retired(left)
            self._retired.clear()
            self._dev_of.clear()
            self._watches.clear()
            self._gates.clear()
            for path in list(self._extra_fds):
                self._close_extra(path)
            for fd in self._pinned.values():
                os.close(fd)
            self._pinned.clear()
            self._pins.clear()


_default: LocalStore | None = None
_default_lock = threading.Lock()


def default_local_store() -> LocalStore:
    """The process's shared LocalStore, for readers opened without one (tools, tests);
    the server passes its own, sized by --max-reads."""
    global _default
    with _default_lock:
        if _default is None:
            _default = LocalStore()
        return _default
