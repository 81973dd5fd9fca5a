"""Which read path a mount wants, by measurement: preads, or page faults of a mapping.

Both run on the native pool's threads. They differ in how a read reaches the storage:
on FUSE a buffered pread (and its readahead) is a *background* request, and the kernel
caps those per mount (`max_background`, default 12, congestion at 9), however many
threads wait; a page fault of a mapping is a synchronous request, outside that cap.
Measured through latencyfs at 5 ms, 256 reads in flight (server/storage/README.md,
"Two read paths"; bench/results/readpaths.md):
kernel-default mount, preads 2,104 reads/s (12 in flight at the daemon), page faults
26,925; raised mount, 26,371 and 31,184.

The rule (Little's law): time a few reads one at a time (latency L0), then 4*C reads C
at a time with preads (rate R). R*L0 is the concurrency the mount really gives preads.
If it is at least half of C, preads stay (no cap worth avoiding); so they do when the
probe kept half a core busy (CPU-bound, nothing capped), and on a local block or memory
file system (ext4, xfs, tmpfs, overlay, ...), which is not probed at all. Otherwise page faults
are timed the same way on other pages, and the mapping is used when it completes at
least 25% more reads per second; a mount that caps both keeps preads. The probe reads
pages of the first file pinned on the mount (about 0.1 s on a capped 5 ms mount, a few
ms on a local disk), once per mount.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass, field

from . import mounts, native

log = logging.getLogger("croupier.storage")

READ_PATHS = ("pread", "mmap")
#: CROUPIER_READ_PATH=pread|mmap|auto forces a path for every mount (auto: measure).
ENV = "CROUPIER_READ_PATH"
#: Reads in flight the probe asks for (enough to see a cap of 12 clearly).
PROBE_CONCURRENCY = 64
_SERIAL_READS = 8
#: reads per thread in each timed run (4: the steady state dominates the start)
_ROUNDS = 4
#: below this the probe could not tell a cap of 12 from no cap
_MIN_CONCURRENCY = 24
_READ_BYTES = 1024
_PAGE = 4096
#: preads reach at least this share of the concurrency asked for: no cap to get around.
_UNCAPPED_SHARE = 0.5
#: the probe's preads kept this much of a core busy: CPU-bound, not capped by the storage
_CPU_BOUND_CORES = 0.5
#: the mapping must beat preads by this factor to be chosen (probe noise, RSS it costs).
_MAP_MARGIN = 1.25


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
        raise ValueError(f"{where}={value!r}: expected pread, mmap or auto")
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


def mount_of(device: int) -> Mount:
    """The mount whose files have st_dev `device` (the last such line of mountinfo,
    parsed by mounts.py)."""
    want = f"{os.major(device)}:{os.minor(device)}"
    found = Mount(device, "?", "unknown", "?")
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
    path: str  # "pread" or "mmap"
    reason: str  # "measured", "forced by ...", "preads only ..."
    asked: int = 0  # reads in flight the store may ask for (its threads)
    latency_s: float = 0.0  # L0, one read at a time
    rates: dict[str, float] = field(default_factory=dict)  # path -> reads/s at the probe's concurrency
    ceilings: dict[str, float] = field(default_factory=dict)  # path -> R * L0, reads in flight achieved
    cpu_cores: dict[str, float] = field(default_factory=dict)  # path -> the process's CPU seconds per second
    probe_concurrency: int = 0

    @property
    def ceiling(self) -> float:
        """The chosen path's measured concurrency (0: not measured)."""
        return self.ceilings.get(self.path, 0.0)

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


def probe(fd: int, file_size: int, mount: Mount, asked: int, concurrency: int = PROBE_CONCURRENCY) -> Choice | None:
    """Measure preads, and page faults when preads look capped, on pages of open file
    `fd` (blocking, about 0.2 s on a capped 5 ms mount). None when the file is too small
    to probe (8*24 + 8 pages: about 800 KB) or the native pool is not built."""
    if native.measure is None or native.Mapping is None:
        return None
    # C as asked, fewer on a small file, never so few that a cap of 12 would not show
    c = max(1, min(concurrency, asked, (file_size // _PAGE - _SERIAL_READS) // (2 * _ROUNDS)))
    if c < min(_MIN_CONCURRENCY, asked):
        return None
    pages = _pages(file_size, _SERIAL_READS + 2 * _ROUNDS * c, seed=file_size)
    if pages is None:
        return None
    offsets = [p * _PAGE + 64 for p in pages]
    n = _ROUNDS * c
    serial, pread_set, map_set = offsets[:_SERIAL_READS], offsets[_SERIAL_READS:_SERIAL_READS + n], offsets[_SERIAL_READS + n:]
    secs, errors, *_ = native.measure(fd, None, serial, _READ_BYTES, 1)
    if errors:
        return None
    choice = Choice(mount, "pread", "measured", asked=asked, latency_s=secs / len(serial), probe_concurrency=c)
    _time(choice, "pread", fd, None, pread_set, c)
    if not choice.capped():
        return choice
    mapping = native.Mapping(fd)
    try:
        _time(choice, "mmap", fd, mapping, map_set, c)
    finally:
        mapping.close()
    choice.path = decide(choice)
    return choice


def decide(choice: Choice) -> str:
    """The rule, on a Choice whose preads (and, when capped, page faults) were timed at
    `probe_concurrency`: preads unless they are capped and the mapping beats them by
    `_MAP_MARGIN` (`croupier probe` applies it to its own measurements)."""
    if not choice.capped() or "mmap" not in choice.rates:
        return "pread"
    return "mmap" if choice.rates["mmap"] >= _MAP_MARGIN * choice.rates["pread"] else "pread"


def timed_rate(fd: int, mapping, offsets: list[int], size: int, c: int) -> tuple[float, float]:
    """Reads/s of `size` bytes at `offsets` (preads, or page faults of `mapping`), `c` at a
    time on native threads, in the steady state: those done by the time the last one
    started, over that time (the slowest few reads' tail left out); and the process's CPU
    seconds per second meanwhile."""
    cpu0 = time.process_time()
    secs, _, _, dry_secs, dry_done = native.measure(fd, mapping, offsets, size, c)
    cores = (time.process_time() - cpu0) / max(secs, 1e-9)
    rate = dry_done / dry_secs if dry_done >= c and dry_secs > 0 else len(offsets) / max(secs, 1e-9)
    return rate, cores


def _time(choice: Choice, path: str, fd: int, mapping, offsets: list[int], c: int) -> None:
    rate, choice.cpu_cores[path] = timed_rate(fd, mapping, offsets, _READ_BYTES, c)
    choice.rates[path] = rate
    choice.ceilings[path] = min(float(c), rate * choice.latency_s)


def remedy(mount: Mount, want: int) -> str:
    """What would raise a mount's cap on concurrent reads."""
    if mount.is_fuse:
        return (f"mount it with -o max_background={want} (if the FUSE file system passes it on), or as root "
                f"`echo {want} > {mount.fuse_connection()}/max_background` (needs fusectl mounted at /sys/fs/fuse/connections)")
    return "raise the file system's own limit on concurrent requests (NFS: nconnect, the RPC slot table)"


def report(choice: Choice) -> None:
    """One log line for a mount whose preads are capped below the concurrency asked for."""
    if not choice.capped():
        return
    m = choice.mount
    limits = m.fuse_limits()
    known = f" (the kernel says max_background={limits['max_background']})" if "max_background" in limits else ""
    rates = ", ".join(f"{p} {r:,.0f} reads/s" for p, r in choice.rates.items())
    log.warning(
        "storage: %s (%s) completes only about %.0f reads at once with preads%s, croupier asks for up to %d; "
        "measured at %.1f ms a read: %s; reading it by %s. To raise the cap: %s",
        m.point, m.fs_type, choice.ceilings["pread"], known, choice.asked, choice.latency_s * 1e3, rates,
        "page faults of a mapping" if choice.path == "mmap" else "preads all the same", remedy(m, choice.asked),
    )
