"""Which read path a mount wants, by measurement: preads, O_DIRECT reads, or page faults
of a mapping.

All run on the native pool's threads. They differ in how a read reaches the storage:
on FUSE a buffered pread (and its readahead) is a *background* request, and the kernel
caps those per mount (`max_background`, default 12, congestion at 9), however many
threads wait; a page fault of a mapping is a synchronous request, outside that cap; an
O_DIRECT read is one request of the size asked, background (capped) when the daemon
negotiated async direct I/O (libfuse's default), synchronous (uncapped) when it did not.
Measured through latencyfs at 5 ms, 256 reads in flight (server/storage/README.md,
"Three read paths"; bench/results/readpaths.md):
kernel-default mount, preads 2,104 reads/s (12 in flight at the daemon), page faults
26,925, O_DIRECT 2,096 (12 in flight) or, without async direct I/O, 19,073 (203);
raised mount, 26,371 and 31,184 (O_DIRECT 26,020).

The rule (Little's law): time a few reads one at a time (latency L0), then 4*C reads C
at a time with preads (rate R). R*L0 is the concurrency the mount really gives preads.
If it is at least half of C, preads stay (no cap worth avoiding); so they do when the
probe kept half a core busy (CPU-bound, nothing capped), and on a local block or memory
file system (ext4, xfs, tmpfs, overlay, ...), which is not probed at all. Otherwise
O_DIRECT reads (where the file system accepts them) and then page faults are timed the
same way on other pages; a path replaces the best so far when it completes at least 25%
more reads per second; a mount that caps them all keeps preads. The probe reads pages of
the first file pinned on the mount (about 0.3 s on a capped 5 ms mount, a few ms on a
local disk), once per mount, and again when the store's own counters show the chosen
path completing far fewer reads at once than are asked of it (`Watch`).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import random
import threading
import time
from dataclasses import dataclass, field

from . import mounts, native

log = logging.getLogger("croupier.storage")

READ_PATHS = ("pread", "mmap", "direct")
#: The order the rule tries the paths in: a later one must beat the best so far by
#: MARGIN. O_DIRECT before the mapping: it keeps no page cache, reads only the bytes
#: asked, and a file truncated under it is a plain short read.
_RULE_ORDER = ("pread", "direct", "mmap")
#: CROUPIER_READ_PATH=pread|mmap|direct|auto forces a path for every mount (auto: measure).
ENV = "CROUPIER_READ_PATH"
#: Reads in flight the probe asks for (enough to see a cap of 12 clearly).
PROBE_CONCURRENCY = 64
_SERIAL_READS = 8
#: reads per thread in each timed run (4: the steady state dominates the start)
_ROUNDS = 4
#: Each path is first timed on this many reads at once: one that completes fewer than
#: _PILOT_CEILING of them at once (a daemon that serves one read at a time) is taken at that
#: rate. Its full run would only say so again, slowly: 4 rounds of 64 reads one at a time
#: took 7 s a path through a 20 ms rclone mount, 20 s of a dataset's open. The bar is low:
#: 16 threads started at once on a busy 2-core machine made a raised 5 ms mount look like
#: 2.6 at once (538 reads/s) in a probe again beside the server's own reads, with a bar of
#: 4; rclone's pilot makes about 1.
_PILOT_READS = 16
_PILOT_CEILING = 2
#: below this the probe could not tell a cap of 12 from no cap
_MIN_CONCURRENCY = 24
_READ_BYTES = 1024
_PAGE = 4096
#: preads reach at least this share of the concurrency asked for: no cap to get around.
_UNCAPPED_SHARE = 0.5
#: the probe's preads kept this much of a core busy: CPU-bound, not capped by the storage
_CPU_BOUND_CORES = 0.5
#: a path must beat the best so far by this factor to replace it (probe noise; the mapping
#: also costs page cache and RSS).
MARGIN = 1.25


#: Block and memory file systems: a pread is served by the kernel itself, with no
#: per-mount request cap to get around, so these keep preads without a probe (a probe on
#: a busy machine could read CPU contention as a cap).
LOCAL_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "ramfs",
                                "overlay", "squashfs", "vfat", "exfat", "ntfs3", "jfs", "reiserfs"})


def resolve(read_path: str | None) -> str:
    """`read_path`, else $CROUPIER_READ_PATH, else "auto"; a ValueError naming the bad value."""
    value = (read_path if read_path is not None else os.environ.get(ENV, "auto")).strip().lower()
    if value not in (*READ_PATHS, "auto"):
        where = "read_path" if read_path is not None else ENV
        raise ValueError(f"{where}={value!r}: expected pread, mmap, direct or auto")
    return value


@dataclass(frozen=True)
class Mount:
    """A mounted file system, as /proc/self/mountinfo names it."""

    device: int  # st_dev of its files
    point: str
    fs_type: str  # "ext4", "fuse.rclone", "nfs4", ...
    source: str

    @property
    def is_fuse(self) -> bool:
        return self.fs_type == "fuse" or self.fs_type.startswith(("fuse.", "fuseblk"))

    @property
    def is_local(self) -> bool:
        """A block or memory file system (LOCAL_FILE_SYSTEMS): nothing to probe."""
        return self.fs_type in LOCAL_FILE_SYSTEMS

    def fuse_connection(self) -> str:
        """/sys/fs/fuse/connections/<N> of this mount (N: the kernel's device number)."""
        major, minor = os.major(self.device), os.minor(self.device)
        return f"/sys/fs/fuse/connections/{(major << 20) | minor}"

    def fuse_limits(self) -> dict[str, int]:
        """max_background and congestion_threshold of a FUSE mount, where fusectl is
        mounted and readable ({} otherwise)."""
        out: dict[str, int] = {}
        if not self.is_fuse:
            return out
        for name in ("max_background", "congestion_threshold"):
            try:
                with open(os.path.join(self.fuse_connection(), name)) as f:
                    out[name] = int(f.read().strip())
            except (OSError, ValueError):
                pass
        return out


def mount_of(device: int, path: str | None = None) -> Mount:
    """The mount whose files have st_dev `device`: the one holding `path` when given (a
    device bind-mounted in several places shows under each), else the last such line of
    mountinfo (parsed by mounts.py)."""
    want = f"{os.major(device)}:{os.minor(device)}"
    found = Mount(device, "?", "unknown", "?")
    if path is not None:
        holder = mounts.mount_of(path)
        if holder is not None and holder.device == want:
            return Mount(device, holder.mount_point, holder.fs_type, holder.source)
    try:
        with open(mounts.MOUNTINFO) as f:
            text = f.read()
    except OSError:
        return found
    for m in mounts.parse_mountinfo(text):
        if m.device == want:
            found = Mount(device, m.mount_point, m.fs_type, m.source)
    return found


@dataclass
class Choice:
    """A mount's read path and what measured it."""

    mount: Mount
    path: str  # "pread", "mmap" or "direct"
    reason: str  # "measured", "forced by ...", "preads only ..."
    asked: int = 0  # reads in flight the store may ask for (its threads)
    latency_s: float = 0.0  # L0, one read at a time
    rates: dict[str, float] = field(default_factory=dict)  # path -> reads/s at the probe's concurrency
    ceilings: dict[str, float] = field(default_factory=dict)  # path -> R * L0, reads in flight achieved
    cpu_cores: dict[str, float] = field(default_factory=dict)  # path -> the process's CPU seconds per second
    probe_concurrency: int = 0
    unavailable: dict[str, str] = field(default_factory=dict)  # path -> why it cannot be used here
    direct_align: int = 0  # offset and size alignment O_DIRECT reads need here (0: not known)
    #: Descriptors of each pinned file its preads are spread over (a daemon-bound mount whose
    #: daemon serves files apart in parallel: `time_handles`), and what they completed at once.
    handles: int = 1
    spread: tuple[int, float] | None = None  # (descriptors, reads/s) where spread preads were timed

    @property
    def ceiling(self) -> float:
        """The chosen path's measured concurrency (0: not measured)."""
        return self.ceilings.get(self.path, 0.0)

    @property
    def spread_ceiling(self) -> float:
        """Reads the spread descriptors completed at once, where the store uses them (else 0)."""
        if self.handles <= 1 or self.spread is None:
            return 0.0
        return min(2.0 * self.handles, self.spread[1] * self.latency_s)

    def capped(self) -> bool:
        """Preads reach less than half the concurrency the probe asked for, and not
        because the CPU was busy (a page-cached local file: the reads are CPU-bound,
        the storage caps nothing)."""
        c = self.ceilings.get("pread")
        return (c is not None and self.probe_concurrency > 0 and c < _UNCAPPED_SHARE * self.probe_concurrency
                and self.cpu_cores.get("pread", 0.0) < _CPU_BOUND_CORES)


def _pages(size: int, count: int, seed: int) -> list[int] | None:
    pages = size // _PAGE
    if pages < count:
        return None
    return random.Random(seed).sample(range(pages), count)


def probe(fd: int, file_size: int, mount: Mount, asked: int, concurrency: int = PROBE_CONCURRENCY,
          path: str | None = None, seed: int | None = None, latency_s: float | None = None) -> Choice | None:
    """Measure preads and, when they look capped, O_DIRECT reads (of `path` opened again,
    when given) and page faults, on pages of open file `fd` (blocking, about 0.3 s on a
    capped 5 ms mount). None when the file is too small to probe (8 + 3*4*24 pages: about
    1.2 MB) or the native pool is not built. `seed` draws the pages (default: the file's
    size); a probe again draws others, which the page cache does not hold. `latency_s`: L0
    of an earlier probe, kept when less (a probe beside the store's own reads may queue
    behind them)."""
    if native.measure is None or native.Mapping is None:
        return None
    # C as asked, fewer on a small file, never so few that a cap of 12 would not show
    c = max(1, min(concurrency, asked, (file_size // _PAGE - _SERIAL_READS) // (3 * _ROUNDS)))
    if c < min(_MIN_CONCURRENCY, asked):
        return None
    pages = _pages(file_size, _SERIAL_READS + 3 * _ROUNDS * c, seed=file_size if seed is None else seed)
    if pages is None:
        return None
    offsets = [p * _PAGE + 64 for p in pages]
    n = _ROUNDS * c
    serial = offsets[:_SERIAL_READS]
    pread_set, direct_set, map_set = (offsets[_SERIAL_READS + i * n:_SERIAL_READS + (i + 1) * n] for i in range(3))
    secs, errors, *_ = native.measure(fd, None, serial, _READ_BYTES, 1)
    if errors:
        return None
    l0 = secs / len(serial) if latency_s is None else min(latency_s, secs / len(serial))
    choice = Choice(mount, "pread", "measured", asked=asked, latency_s=l0, probe_concurrency=c)
    _time(choice, "pread", fd, None, pread_set, c)
    if not choice.capped():
        return choice
    if path is not None:
        direct = open_direct(choice, path)
        if direct is not None:
            try:
                _time(choice, "direct", direct.fd, None, direct_set, c, direct.align)
            finally:
                os.close(direct.fd)
    mapping = native.Mapping(fd)
    try:
        _time(choice, "mmap", fd, mapping, map_set, c)
    finally:
        mapping.close()
    choice.path = decide(choice)
    return choice


def open_direct(choice: Choice, path: str) -> native.DirectFile | None:
    """`path` opened with O_DIRECT at the mount's alignment (found, and kept in `choice`, on
    its first file); None, the reason kept in `choice.unavailable`, where it is refused."""
    try:
        direct = native.open_direct(path, choice.direct_align or None)
    except OSError as e:
        why = "the file system refuses O_DIRECT" if e.errno == errno.EINVAL else "O_DIRECT open failed"
        choice.unavailable["direct"] = f"{why} ({choice.mount.fs_type}: {e.strerror or e})"
        return None
    choice.direct_align = direct.align
    return direct


def decide(choice: Choice) -> str:
    """The rule, on a Choice whose preads (and, when capped, the other paths) were timed at
    `probe_concurrency`: preads unless they are capped; then each path in _RULE_ORDER that
    was timed replaces the best so far when it completes `MARGIN` times its reads per
    second (`croupier probe` applies it to its own measurements)."""
    if not choice.capped():
        return "pread"
    best = "pread"
    for path in _RULE_ORDER[1:]:
        if path in choice.rates and choice.rates[path] >= MARGIN * choice.rates[best]:
            best = path
    return best


def timed_rate(fd: int, mapping, offsets: list[int], size: int, c: int, align: int = 0) -> tuple[float, float]:
    """Reads/s of `size` bytes at `offsets` (preads, page faults of `mapping`, or with
    `align` > 0 O_DIRECT reads of `fd` at that alignment), `c` at a time on native
    threads, in the steady state: those done by the time the last one started, over that
    time (the slowest few reads' tail left out); and the CPU seconds per second its reading
    threads used, theirs alone: a probe again runs beside a busy server, whose other
    threads' CPU says nothing of whether these reads are CPU-bound."""
    secs, _, _, dry_secs, dry_done, cpu = native.measure(fd, mapping, offsets, size, c, align)
    cores = cpu / max(secs, 1e-9)
    rate = dry_done / dry_secs if dry_done >= c and dry_secs > 0 else len(offsets) / max(secs, 1e-9)
    return rate, cores


def _time(choice: Choice, path: str, fd: int, mapping, offsets: list[int], c: int, align: int = 0) -> None:
    """Time `path` at `c` reads at once, after a pilot of _PILOT_READS reads: a path that
    completes fewer than _PILOT_CEILING of those at once is taken at the pilot's rate."""
    pilot = min(_PILOT_READS, c, len(offsets) // 2)
    rate, cores = timed_rate(fd, mapping, offsets[:pilot], _READ_BYTES, pilot, align)
    if pilot == 0 or rate * choice.latency_s >= _PILOT_CEILING:
        rate, cores = timed_rate(fd, mapping, offsets[pilot:], _READ_BYTES, c, align)
    choice.cpu_cores[path] = cores
    choice.rates[path] = rate
    choice.ceilings[path] = min(float(c), rate * choice.latency_s)


def daemon_bound(choice: Choice) -> bool:
    """A FUSE mount whose page faults got no further than its preads: page faults are
    synchronous requests, outside the kernel's max_background, so the cap is the FUSE
    daemon's own (rclone mount with its defaults serves about one read of a file at a time:
    bench/results/readpaths-bucket-mounts.md)."""
    c = choice.ceilings
    # "no further": within MARGIN, or within one read where both are about one (a daemon with
    # one worker measures 1.3-1.7 reads in flight on either path, and 1.7 against 1.3 is noise)
    return (choice.mount.is_fuse and "pread" in c and "mmap" in c and choice.probe_concurrency > 0
            and c["mmap"] < max(MARGIN * c["pread"], c["pread"] + 1)
            and c["mmap"] < _UNCAPPED_SHARE * choice.probe_concurrency)


#: Descriptors of a file a daemon-bound mount's preads are spread over, when that pays: rclone
#: serves an open file's reads one at a time, but files opened apart in parallel (through a 20 ms
#: rclone mount, random 1 KiB reads of one file made 36 reads/s through one descriptor, 141
#: through 4 and 236 through 16, and fewer again through 64).
HANDLES = 8


def keeps_spread(old: Choice, new: Choice) -> bool:
    """A probe again of a mount whose preads were spread over descriptors keeps them spread
    (and preads): while the daemon stays the cap, unless the path the new probe prefers beats
    the spread preads' own rate by MARGIN. The probe times each path through one descriptor,
    so on a daemon that serves one read of a file at a time every path measures about the
    same (rclone at 20 ms: 29-46 reads/s, noise that once picked O_DIRECT), against 168 for
    preads spread over 8: taking such a path dropped the spread, the mount's gate fell from 9
    reads in flight to 2 and a 10% cache's rows came at 40-75 a second."""
    if old.handles <= 1 or old.spread is None or not daemon_bound(new):
        return False
    return new.path == "pread" or new.rates.get(new.path, 0.0) < MARGIN * old.spread[1]


def time_handles(choice: Choice, path: str, size: int, k: int = HANDLES, offsets: list[int] | None = None,
                 read_bytes: int = _READ_BYTES) -> None:
    """On a daemon-bound mount read by preads, time reads of `path` spread over `k`
    descriptors of it, 2k at once on Python threads (reads this slow leave the GIL idle), and
    spread the store's preads over that many when they complete MARGIN times what one does.
    `offsets`: where to read (default: 4k pages of the file drawn at random)."""
    if not daemon_bound(choice) or choice.path != "pread" or "pread" not in choice.rates:
        return
    if offsets is None:
        pages = _pages(size, 4 * k, seed=size + 1)
        if pages is None:
            return
        offsets = [p * _PAGE + 64 for p in pages]
    fds: list[int] = []
    try:
        for _ in range(k):
            fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fds[-1], 0, 0, os.POSIX_FADV_RANDOM)

        def reads(i: int) -> None:
            for off in offsets[i::2 * k]:
                os.pread(fds[i % k], read_bytes, off)

        threads = [threading.Thread(target=reads, args=(i,), name="croupier-probe") for i in range(2 * k)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        secs = time.perf_counter() - t0
    except OSError as e:
        log.info("storage: %s: reads over %d descriptors of a file could not be timed: %s", choice.mount.point, k, e)
        return
    finally:
        for fd in fds:
            os.close(fd)
    rate = len(offsets) / max(secs, 1e-9)
    choice.spread = (k, rate)
    if rate >= MARGIN * choice.rates["pread"]:
        choice.handles = k


#: A daemon-bound mount's reads in flight at its storage are held to this many times the
#: ceiling its probe measured, and at least READ_LIMIT_MIN (storage/gate.py): more only
#: wait inside the daemon, holding the kernel's background requests from the cache's fill.
READ_LIMIT_HEADROOM = 2.0
READ_LIMIT_MIN = 2


def read_limit(choice: Choice) -> int | None:
    """The most reads a mount should have in flight at once (None: no limit but the
    store's threads): on a daemon-bound mount, READ_LIMIT_HEADROOM x its measured ceiling."""
    if not daemon_bound(choice):
        return None
    return max(READ_LIMIT_MIN, math.ceil(READ_LIMIT_HEADROOM * max(choice.ceiling, choice.spread_ceiling)))


def remedy(mount: Mount, want: int, choice: Choice | None = None) -> str:
    """What would raise a mount's cap on concurrent reads (`choice`: its measurement, which
    tells a daemon's own cap from the kernel's)."""
    if choice is not None and daemon_bound(choice):
        own = mounts.client_limit(mount.fs_type)
        return (f"the FUSE daemon itself completes only about {choice.ceilings['mmap']:.0f} reads at once, whatever "
                "the read path (page faults, which the kernel's max_background does not cap, got no further than "
                "preads): raising max_background would not help; "
                + (f"the daemon's own options: {own}" if own else
                   "the daemon's own options might (its worker threads, its read-ahead)")
                + ", or read the data without the mount")
    if mount.is_fuse:
        return (f"mount it with -o max_background={want} (if the FUSE file system passes it on), or as root "
                f"`echo {want} > {mount.fuse_connection()}/max_background` (needs fusectl mounted at /sys/fs/fuse/connections)")
    return "raise the file system's own limit on concurrent requests (NFS: nconnect, the RPC slot table)"


def rates_line(choice: Choice) -> str:
    """Each path's measured reads/s, and preads spread over descriptors where that was timed."""
    line = ", ".join(f"{p} {r:,.0f} reads/s" for p, r in choice.rates.items())
    if choice.spread is not None:
        line += f", pread over {choice.spread[0]} descriptors {choice.spread[1]:,.0f} reads/s"
    return line


def report(choice: Choice) -> None:
    """One log line for a mount whose preads are capped below the concurrency asked for."""
    if not choice.capped():
        return
    m = choice.mount
    limits = m.fuse_limits()
    known = f" (the kernel says max_background={limits['max_background']})" if "max_background" in limits else ""
    rates = rates_line(choice)
    rates += "".join(f"; {p} unavailable: {why}" for p, why in choice.unavailable.items())
    log.warning(
        "storage: %s (%s) completes only about %.0f reads at once with preads%s, croupier asks for up to %d; "
        "measured at %.1f ms a read: %s; reading it by %s. To raise the cap: %s",
        m.point, m.fs_type, choice.ceilings["pread"], known, choice.asked, choice.latency_s * 1e3, rates,
        PATH_WORDS[choice.path] if choice.path != "pread" else "preads all the same", remedy(m, choice.asked, choice),
    )
    limit = read_limit(choice)
    if limit is not None:
        spread = (f"; its preads spread over {choice.handles} descriptors of each file, which its daemon serves "
                  "apart in parallel" if choice.handles > 1 else "")
        log.warning("storage: %s (%s): holding its reads in flight to %d (%.0fx what it completes at once%s); the "
                    "rest wait in croupier, where they leave the mount free for the cache's large reads",
                    m.point, m.fs_type, limit, READ_LIMIT_HEADROOM, spread)


#: Each path in words, for log lines and `croupier probe`.
PATH_WORDS = {"pread": "preads", "mmap": "page faults of a mapping", "direct": "O_DIRECT reads"}


# ---- revisiting the choice online -------------------------------------------------------------

#: A mount is watched over windows of this many seconds, and probed again at most once per
#: REVISIT_INTERVAL_S (a probe is about 0.3 s of reads on a capped mount, off the loop).
REVISIT_WINDOW_S = 2.0
REVISIT_INTERVAL_S = 600.0
#: Short windows in a row before the first probe again (each confirming probe doubles it).
REVISIT_PATIENCE = 2


class Watch:
    """Little's law over a window, from the store's own counters, for one measured mount:
    whether its chosen path now completes far fewer reads at once than are asked of it (a
    FUSE mount's max_background lowered, say, since the probe).

    asked: the mean reads in flight at the store on the mount over the window (the area
    under in-flight, over time); achieved: the completions per second times the latency
    the probe measured one read at a time (L0), the reads the storage completed at once.
    Achieved under half of asked, with at least _MIN_CONCURRENCY asked, in `patience`
    windows in a row: reads are queueing behind a cap, so `finished` says to probe the
    mount again, at most once per `interval_s`. One short window is not enough: the first
    reads on a mount (threads starting, the daemon's own warm-up) or a busy CPU make one,
    and a probe spent on it would leave a real cap unseen for the interval. A storage that
    merely got slower looks the same; the probe tells them apart (it measures L0 again).
    A probe that keeps the path (`confirmed`) spends none of the interval, and doubles
    the patience of the next: false alarms cost ever less often."""

    __slots__ = ("latency_s", "window_s", "interval_s", "in_flight", "last_probe", "last_window",
                 "patience", "_before_probe", "_short", "_area", "_done", "_t0", "_t_last")

    def __init__(self, latency_s: float, now: float, window_s: float = REVISIT_WINDOW_S,
                 interval_s: float = REVISIT_INTERVAL_S, last_probe: float = -math.inf,
                 patience: int = REVISIT_PATIENCE):
        self.latency_s, self.window_s, self.interval_s = latency_s, window_s, interval_s
        self.in_flight = 0
        self.last_probe = last_probe  # when the watch last asked for a probe (the first probe is free)
        self._before_probe = last_probe  # last_probe before that ask (restored by `confirmed`)
        self.patience = patience  # short windows in a row that ask for a probe
        self._short = 0  # short windows in a row so far
        self.last_window: tuple[float, float] | None = None  # (asked, achieved) of the last full window
        self._area, self._done, self._t0, self._t_last = 0.0, 0, now, now

    def started(self, n: int, now: float) -> None:
        self._area += self.in_flight * (now - self._t_last)
        self._t_last = now
        self.in_flight += n

    def finished(self, n: int, now: float) -> bool:
        """`n` reads landed; True when the mount should be probed again (once per interval)."""
        self._area += self.in_flight * (now - self._t_last)
        self._t_last = now
        self.in_flight -= n
        self._done += n
        span = now - self._t0
        if span < self.window_s:
            return False
        asked, achieved = self._area / span, self._done / span * self.latency_s
        self.last_window = (asked, achieved)
        self._area, self._done, self._t0 = 0.0, 0, now
        if asked < _MIN_CONCURRENCY or achieved >= _UNCAPPED_SHARE * asked:
            self._short = 0
            return False
        self._short += 1
        if self._short < self.patience or now - self.last_probe < self.interval_s:
            return False
        self._short = 0
        self._before_probe, self.last_probe = self.last_probe, now
        return True

    def confirmed(self, latency_s: float, now: float) -> "Watch":
        """The watch that follows a probe that kept the path: the interval as before that
        probe, twice the patience, the L0 just measured."""
        return Watch(latency_s, now, self.window_s, self.interval_s, self._before_probe, 2 * self.patience)
