"""What /proc says about a process, and the page cache of files (Linux only).

No psutil: CPU seconds, peak RSS and children are a few lines of /proc each.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")
#: The kernel keeps per-thread schedstat (ns on the CPU); checked once, so a thread that ends
#: between its two reads is skipped like any ended thread, not read as if the file never existed.
_SCHEDSTAT = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat")


def cpu_seconds(pid: int | str = "self", children: bool = False) -> float:
    """User + system CPU seconds of `pid` (plus its reaped children's with `children`)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    if children:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime
    return ticks / _TICK


def _status_kb(pid: int | str, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def rss_mb(pid: int | str = "self") -> float:
    """Resident set size now (VmRSS)."""
    return _status_kb(pid, "VmRSS") / 1024


def peak_rss_mb(pid: int | str = "self") -> float:
    """High-water mark of the resident set (VmHWM)."""
    return _status_kb(pid, "VmHWM") / 1024


def private_rss_mb(pid: int | str = "self") -> float:
    """Anonymous resident memory now: what a forked worker does not share with its parent."""
    return _status_kb(pid, "RssAnon") / 1024


def child_pids(pid: int | str = "self") -> list[int]:
    """Direct children of `pid`, over all its threads."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def tree_private_rss_mb(pid: int | str = "self") -> float:
    """RssAnon of a process's children (DataLoader workers), summed; 0 when it has none."""
    total = 0.0
    for child in child_pids(pid):
        try:
            total += private_rss_mb(child)
        except OSError:
            continue
    return total


def files_under(paths: Iterable[str | os.PathLike]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        files += [f for f in p.rglob("*") if f.is_file()] if p.is_dir() else [p]
    return files


def drop_from_page_cache(paths: Iterable[str | os.PathLike]) -> int:
    """posix_fadvise(DONTNEED) every file under `paths`; returns bytes dropped.

    Dirty pages cannot be dropped, so each file is fsynced first. Pages mapped by a
    live process stay: drop before starting the server that maps them.
    """
    total = 0
    for f in files_under(paths):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def load_into_page_cache(paths: Iterable[str | os.PathLike], block: int = 1 << 20) -> int:
    """Read every file under `paths` once so that later reads hit the page cache."""
    total = 0
    for f in files_under(paths):
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(block):
                total += len(chunk)
    return total


#: Per thread: (name, user s, system s, CPU s): user and system are the kernel's tick counts
#: (.../stat, each rounded down to a tick), CPU the scheduler's exact count (.../schedstat).
ThreadCPU = tuple[str, float, float, float]


def thread_cpu(pid: int | str = "self") -> dict[int, ThreadCPU]:
    """Per live thread of `pid`: (name, user s, system s, CPU s).

    CPU is the scheduler's nanosecond count (/proc/PID/task/TID/schedstat; the tick sum where
    the kernel lacks it). User and system are the tick counts of .../stat, which round every
    thread down by up to a tick: over hundreds of short-running I/O threads that hides
    seconds, so sum CPU, and read user/system as a split of the long-running threads only."""
    out: dict[int, ThreadCPU] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            raw = (task / "stat").read_text()
            exact = int((task / "schedstat").read_text().split()[0]) / 1e9 if _SCHEDSTAT else None
        except OSError:
            continue  # ended meanwhile
        name = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw.rsplit(")", 1)[1].split()
        user, system = int(fields[11]) / _TICK, int(fields[12]) / _TICK
        out[int(task.name)] = (name, user, system, max(exact, user + system) if exact is not None else user + system)
    return out


def thread_group(name: str) -> str:
    """A thread's name without its number: croupier-read-17 -> croupier-read."""
    import re

    return re.sub(r"[-_ ]?\d+$", "", name) or name


def thread_cpu_delta(before: dict[int, ThreadCPU], after: dict[int, ThreadCPU],
                     total_s: float | None = None) -> dict[str, dict[str, float]]:
    """CPU seconds by thread group between two `thread_cpu` snapshots ({group: {"cpu", "user",
    "system", "threads"}}); with the process's total CPU over the same time, what threads that
    ended meanwhile used (after their last reading) goes under "(unattributed ...)"."""
    groups: dict[str, dict[str, float]] = {}
    for tid, (name, user, system, cpu) in sorted(after.items()):
        _, u0, s0, c0 = before.get(tid, (name, 0.0, 0.0, 0.0))
        g = groups.setdefault(thread_group(name), {"cpu": 0.0, "user": 0.0, "system": 0.0, "threads": 0})
        g["cpu"] += cpu - c0
        g["user"] += user - u0
        g["system"] += system - s0
        g["threads"] += 1
    if total_s is not None:
        rest = total_s - sum(g["cpu"] for g in groups.values())
        if rest > 0.01:
            groups["(unattributed: threads that ended between readings)"] = {
                "cpu": rest, "user": 0.0, "system": 0.0, "threads": 0}
    return groups
