"""`croupier probe PATH|s3://bucket/prefix`: what the storage gives croupier, before training.

For each read path that applies it measures the latency of one read at a time (p50, p90,
p99) and sweeps the reads in flight (1, 2, 4, ... up to --max-concurrency), stopping once
the rate has gained less than 10% twice in a row: the concurrency at which throughput
stops rising, and the peak rate there.

* Files (a local disk, NFS, a FUSE mount): preads, page faults of a read-only mapping and
  O_DIRECT reads, all on native threads (the pool's `measure`, as the server's own probe
  at pin), on pages never read before in this run, the file marked POSIX_FADV_RANDOM and
  mapped MADV_RANDOM as the server does, so a read asks the storage for its own pages
  only (O_DIRECT: for the bytes asked, rounded to the alignment the file system wants).
  Where the file system refuses O_DIRECT, that path is shown unavailable, with the reason.
  The path croupier will use is readpath.py's rule applied to the rates at its probe
  concurrency (64).
* An ImageFolder (a folder whose files are mostly images, listed by name, no stat: a stat
  is a request on a bucket mount): image files drawn at random across its folders, each
  read whole once (open, fstat, read, close: `measure_files`, what the server's whole-file
  jobs do), one at a time and then 1, 2, 4, ... at once; within --max-bytes, a file that
  would pass it closed unread.
* s3:// (gs://, az://): range GETs through the server's ObjectStore (urls.open_store: the
  same client, options and environment).

It prints which path croupier will use, the samples/s that predicts for rows of
--row-bytes (reads per sample: 2 for text rows, an Arrow string column's offsets and its
bytes; 1 for images), and what would raise the ceiling: a FUSE mount's max_background,
or, for a FUSE mount of an object store, the s3:// URL to serve instead (mounts.py).
It reads at most --max-bytes (each read charged the pages it touches), stated in the
output, opens every file O_RDONLY (O_NOATIME where allowed) and writes nothing.
A single read's latency includes starting its thread (tens of microseconds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import math
import os
import random
import stat
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from croupier.server.readers.images import is_image_name
from croupier.server.serve_options import _storage_options as storage_options
from croupier.server.storage import mounts, native, readpath, urls

READS_PER_SAMPLE = {"text": 2, "images": 1}
DEFAULT_ROW_BYTES = 1024
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_MAX_CONCURRENCY = 256
#: reads timed one at a time for the latency distribution
LATENCY_READS = 64
#: reads per thread at each step of the sweep (as readpath's probe)
ROUNDS = 4
#: a step that gains less than this factor is flat; two flat steps in a row end the sweep
FLAT_GAIN = 1.10
FLAT_STEPS = 2
#: files looked at under PATH at most
MAX_FILES = 10_000
#: an ImageFolder's file names listed at most (no stat: a stat is a request on a bucket
#: mount); the files read are drawn from them across folders, as a shuffled epoch's are
MAX_IMAGE_NAMES = 200_000
#: image files timed one at a time, whole, for the latency distribution
WHOLE_LATENCY_FILES = 32
_PAGE = 4096
_SKEW = 64  # reads start this far into a page, as rows do (readpath's probe too)
_SERIAL_READS = 8  # readpath's L0: these reads one after another on one thread


class ProbeError(Exception):
    """A target that cannot be probed; the message names it. Exit code 2."""


@dataclass
class PathResult:
    """One read path's measurements."""

    name: str  # "pread", "mmap", "direct" or "get"
    latencies_s: list[float] = field(default_factory=list)
    sweep: list[tuple[int, float]] = field(default_factory=list)  # (reads in flight, reads/s)
    cpu_cores: dict[int, float] = field(default_factory=dict)  # concurrency -> CPU seconds per second
    reads: int = 0
    bytes: int = 0  # charged against --max-bytes
    stopped: str = ""  # why the sweep ended
    rule_rate: float | None = None  # files: reads/s at readpath.PROBE_CONCURRENCY, which its rule reads
    serial_latency_s: float = 0.0  # files: the mean of _SERIAL_READS reads on one thread, as readpath times L0
    unavailable: str = ""  # why this path cannot be used here (O_DIRECT refused), else ""
    align: int = 0  # direct: the offset and size alignment the file system wants

    def percentile(self, q: float) -> float:
        xs = sorted(self.latencies_s)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0

    @property
    def mean_latency_s(self) -> float:
        return sum(self.latencies_s) / len(self.latencies_s) if self.latencies_s else 0.0

    @property
    def peak_rate(self) -> float:
        return max((r for _, r in self.sweep), default=0.0)

    @property
    def knee(self) -> int:
        """The concurrency at which throughput stopped rising (the largest measured when it
        never did): the step before the flat ones."""
        if self.stopped.startswith("flat") and len(self.sweep) > FLAT_STEPS:
            return self.sweep[-FLAT_STEPS - 1][0]
        return self.sweep[-1][0] if self.sweep else 0

    @property
    def ceiling(self) -> float:
        """Reads in flight the storage really completed (Little's law: peak rate x mean latency)."""
        return self.peak_rate * self.mean_latency_s

    def rate_at(self, c: int) -> float | None:
        return next((r for k, r in self.sweep if k == c), None)

    def to_json(self) -> dict:
        return {"latency_ms": {f"p{q}": round(self.percentile(q / 100) * 1e3, 3) for q in (50, 90, 99)},
                "latency_reads": len(self.latencies_s), "sweep": [{"concurrency": c, "reads_per_s": round(r, 1)}
                                                                  for c, r in self.sweep],
                "knee_concurrency": self.knee, "peak_reads_per_s": round(self.peak_rate, 1),
                "ceiling_in_flight": round(self.ceiling, 1), "reads": self.reads, "bytes": self.bytes,
                "stopped": self.stopped, "reads_per_s_at_rule_concurrency": self.rule_rate,
                "unavailable": self.unavailable or None}


@dataclass
class Report:
    """What `croupier probe` found."""

    target: str
    storage: str  # "fuse.latencyfs at /mnt/x (max_background=12)", "s3 bucket b (endpoint ...)"
    objects: int  # files or objects found
    row_bytes: int
    rows: str  # "text" or "images"
    max_bytes: int
    paths: dict[str, PathResult]
    chosen: str
    reason: str
    remedies: list[str] = field(default_factory=list)
    #: preads spread over descriptors of a file, where croupier's server would time that:
    #: {"descriptors", "reads_per_s", "used"}
    spread: dict | None = None

    @property
    def bytes_read(self) -> int:
        return sum(p.bytes for p in self.paths.values())

    @property
    def samples_per_s(self) -> float:
        rate = self.paths[self.chosen].peak_rate
        if self.spread is not None and self.spread["used"]:  # the server spreads its preads: their rate
            rate = max(rate, self.spread["reads_per_s"])
        return rate / (1 if self.chosen == "whole" else READS_PER_SAMPLE[self.rows])

    def to_json(self) -> dict:
        return {"target": self.target, "storage": self.storage, "objects": self.objects,
                "row_bytes": self.row_bytes, "rows": self.rows, "reads_per_sample": READS_PER_SAMPLE[self.rows],
                "max_bytes": self.max_bytes, "bytes_read": self.bytes_read,
                "paths": {n: p.to_json() for n, p in self.paths.items()}, "chosen": self.chosen,
                "reason": self.reason, "samples_per_s": round(self.samples_per_s, 1), "remedies": self.remedies,
                "spread": self.spread}

    def table(self) -> str:
        lines = [f"croupier probe {self.target}: {self.storage}, {self.objects} file(s)",
                 f"read {self.bytes_read:,} bytes (bound {self.max_bytes:,}), wrote nothing", "",
                 f"{'path':<6} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'knee':>5} {'peak reads/s':>13} "
                 f"{'in flight':>9}  sweep (concurrency:reads/s)"]
        for p in self.paths.values():
            if p.unavailable:
                lines.append(f"{p.name:<6} unavailable: {p.unavailable}")
                continue
            mark = "*" if p.name == self.chosen else " "
            sweep = " ".join(f"{c}:{r:,.0f}" for c, r in p.sweep)
            lines.append(f"{p.name + mark:<6} {p.percentile(.5) * 1e3:>8.2f} {p.percentile(.9) * 1e3:>8.2f} "
                         f"{p.percentile(.99) * 1e3:>8.2f} {p.knee:>5} {p.peak_rate:>13,.0f} {p.ceiling:>9.1f}  {sweep}")
        per = READS_PER_SAMPLE[self.rows]
        what = (f"image files of {self.row_bytes:,} bytes on average (one file a sample" if self.chosen == "whole" else
                f"{self.rows} rows of {self.row_bytes:,} bytes ({per} read{'s' * (per > 1)} a sample")
        lines += ["", f"croupier will read by {self.chosen} ({self.reason}): about {self.samples_per_s:,.0f} "
                      f"samples/s for {what}, at the peak rate; the server's CPU may bound it lower)"]
        if self.spread is not None:
            k, rate = self.spread["descriptors"], self.spread["reads_per_s"]
            lines.append(f"preads spread over {k} descriptors of a file: {rate:,.0f} reads/s; croupier "
                         + ("spreads them (its daemon serves separate opens of a file in parallel)"
                            if self.spread["used"] else "keeps one (they did not pay 25% more)"))
        lines += [f"to raise the ceiling: {r}" for r in self.remedies]
        return "\n".join(lines)


# ---- the sweep, for any read path -----------------------------------------------------------

def sweep(result: PathResult, step: Callable[[int], float | None], max_concurrency: int) -> None:
    """Time `step(c)` (reads/s at c in flight; None: the budget or the pages ran out) at
    c = 1, 2, 4, ..., max_concurrency, until the rate gained less than FLAT_GAIN FLAT_STEPS
    times in a row."""
    c, flat = 1, 0
    while c <= max_concurrency:
        rate = step(c)
        if rate is None:
            result.stopped = result.stopped or f"--max-bytes reached before {c} in flight"
            return
        if result.sweep and rate < FLAT_GAIN * result.sweep[-1][1]:
            flat += 1
        else:
            flat = 0
        result.sweep.append((c, rate))
        if flat >= FLAT_STEPS:
            result.stopped = f"flat: gained under {FLAT_GAIN - 1:.0%} {FLAT_STEPS} steps in a row"
            return
        c *= 2
    result.stopped = f"still rising at --max-concurrency {max_concurrency}"


class Budget:
    """Bytes left of --max-bytes; a read is charged `cost` bytes (the pages it touches)."""

    def __init__(self, max_bytes: int, cost: int):
        self.left, self.cost = max_bytes, cost

    def take(self, reads: int, result: PathResult) -> int:
        n = max(0, min(reads, self.left // self.cost))
        self.left -= n * self.cost
        result.reads += n
        result.bytes += n * self.cost
        return n


def _bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="read", file=sys.stderr, leave=False, dynamic_ncols=True)


def _planned_reads(max_concurrency: int) -> int:
    steps = int(math.log2(max_concurrency)) + 1
    return LATENCY_READS + sum(ROUNDS * (1 << i) for i in range(steps))


# ---- files ----------------------------------------------------------------------------------

@dataclass
class _File:
    path: str
    size: int
    slots: int  # reads of `span` bytes the file holds
    used: set[int] = field(default_factory=set)

    @property
    def free(self) -> int:
        return self.slots - len(self.used)


class Pages:
    """Places never read before in this run, `span` bytes apart, drawn at random from the
    file with the most left (a read must not find the pages an earlier one brought in)."""

    def __init__(self, files: list[tuple[str, int]], row_bytes: int, seed: int = 0):
        self.span = math.ceil((_SKEW + row_bytes) / _PAGE) * _PAGE
        self.files = [_File(p, s, (s - _SKEW - row_bytes) // self.span + 1) for p, s in files
                      if s >= _SKEW + row_bytes]
        self.rng = random.Random(seed)

    def take(self, n: int) -> tuple[str, list[int]]:
        f = max(self.files, key=lambda f: f.free, default=None)
        if f is None or f.free <= 0:
            return "", []
        n = min(n, f.free)
        picked: list[int] = []
        while len(picked) < n:
            s = self.rng.randrange(f.slots)
            if s not in f.used:
                f.used.add(s)
                picked.append(s * self.span + _SKEW)
        return f.path, picked


def _open(path: str) -> int:
    flags = os.O_RDONLY | os.O_CLOEXEC
    try:
        return os.open(path, flags | getattr(os, "O_NOATIME", 0))
    except PermissionError:
        return os.open(path, flags)  # O_NOATIME needs the file's owner
    except OSError as e:
        raise ProbeError(f"{path}: cannot open it for reading: {e.strerror}") from e


@contextlib.contextmanager
def _opened(result: PathResult, path: str) -> Iterator[tuple[int, object, int]]:
    """`path` opened as `result`'s path reads it: (fd, mapping or None, O_DIRECT alignment
    or 0); O_DIRECT at the alignment found on the first file (OSError where refused)."""
    mapping = None
    if result.name == "direct":
        fd, result.align = native.open_direct(path, result.align or None)
    else:
        fd = _open(path)
    try:
        if result.name != "direct":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        mapping = native.Mapping(fd) if result.name == "mmap" else None
        yield fd, mapping, result.align
    finally:
        if mapping is not None:
            mapping.close()
        os.close(fd)


def _read_cost(result: PathResult, pages: Pages, row_bytes: int) -> int:
    """Bytes one read asks the storage for: its pages, or for O_DIRECT the aligned range
    around the row (a row starts _SKEW into its slot, which is page-aligned)."""
    a = result.align
    if result.name != "direct" or a <= 0:
        return pages.span
    return -(-(_SKEW % a + row_bytes) // a) * a


def _file_step(result: PathResult, pages: Pages, budget: Budget, row_bytes: int, bar) -> Callable[[int], float | None]:
    """reads/s at c in flight of `result.name` (pread, mmap or direct) on unread pages."""

    def step(c: int) -> float | None:
        n = ROUNDS * c
        if budget.left // budget.cost < n:
            result.stopped = f"--max-bytes reached before {c} in flight"
            return None
        path, offsets = pages.take(n)
        if len(offsets) < n:
            result.stopped = f"the files ran out of unread pages before {c} in flight"
            return None
        budget.take(n, result)
        with _opened(result, path) as (fd, mapping, align):
            rate, result.cpu_cores[c] = readpath.timed_rate(fd, mapping, offsets, row_bytes, c, align)
        bar.update(n)
        return rate

    return step


def _file_latencies(result: PathResult, pages: Pages, budget: Budget, row_bytes: int, bar) -> None:
    path, offsets = pages.take(LATENCY_READS + _SERIAL_READS)
    offsets = offsets[:budget.take(len(offsets), result)]
    if not offsets:
        return
    with _opened(result, path) as (fd, mapping, align):
        serial, offsets = offsets[:_SERIAL_READS], offsets[_SERIAL_READS:]
        secs, *_ = native.measure(fd, mapping, serial, row_bytes, 1, align)
        result.serial_latency_s = secs / max(1, len(serial))  # readpath's L0: one thread, one read at a time
        bar.update(len(serial))
        for off in offsets:
            secs, errors, *_ = native.measure(fd, mapping, [off], row_bytes, 1, align)
            if errors:
                raise ProbeError(f"{path}: a read of {row_bytes} bytes at offset {off} failed")
            result.latencies_s.append(secs)
            bar.update(1)


def _names(target: str) -> Iterator[str]:
    """The non-hidden files' paths under folder `target`, folders in sorted order (by the
    listing's names and types: no stat)."""
    for folder, dirs, names in os.walk(target, onerror=None):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        yield from (os.path.join(folder, name) for name in sorted(names) if not name.startswith("."))


def image_files(target: str) -> tuple[list[str], int]:
    """An ImageFolder's image paths under folder `target` (at most MAX_IMAGE_NAMES, names
    only: no stat), and how many other files it met."""
    images: list[str] = []
    others = 0
    for path in _names(target):
        if not is_image_name(path):
            others += 1
            continue
        images.append(path)
        if len(images) >= MAX_IMAGE_NAMES:
            break
    return images, others


def probe_whole_files(target: str, images: list[str], *, max_bytes: int, max_concurrency: int) -> Report:
    """An ImageFolder: image files read whole (open, fstat, read, close) by bare C threads, as
    the server reads them, each file once, drawn at random across its folders."""
    if native.measure_files is None:
        raise ProbeError(f"{target}: the probe needs croupier's native read pool, which this install lacks "
                         "(built without a C compiler)")
    files = list(images)
    random.Random(0).shuffle(files)  # a shuffled epoch's files, from every folder listed
    result = PathResult("whole")
    left = [max_bytes]

    def read(batch: list[str], c: int) -> tuple[float, int] | None:
        """(seconds, files read) of `batch` read whole c at a time, within the byte bound."""
        secs, errors, _, nbytes, cpu, skipped = native.measure_files(batch, c, left[0])
        if errors:
            for path in batch:  # name one: the threads only counted them
                try:
                    with open(path, "rb") as f:
                        f.read(1)
                except OSError as e:
                    raise ProbeError(f"{path}: cannot read it ({e.strerror}); {errors} of {len(batch)} image "
                                     "file(s) in this step failed") from None
            raise ProbeError(f"{target}: {errors} of {len(batch)} image file(s) could not be opened or read")
        left[0] -= nbytes
        result.bytes += nbytes
        result.reads += len(batch) - skipped
        result.cpu_cores[c] = cpu / secs if secs > 0 else 0.0
        return (secs, len(batch) - skipped) if not skipped else None

    it = iter(files)
    with _bar(WHOLE_LATENCY_FILES + ROUNDS * (2 * max_concurrency - 1), f"probe {target}") as bar:
        for path in [p for _, p in zip(range(WHOLE_LATENCY_FILES), it)]:
            got = read([path], 1)
            if got is None:
                result.stopped = "--max-bytes reached before a file was read" if not result.latencies_s else \
                    f"--max-bytes reached after {len(result.latencies_s)} files one at a time"
                break
            result.latencies_s.append(got[0])
            bar.update(1)

        def step(c: int) -> float | None:
            n = ROUNDS * c
            batch = [p for _, p in zip(range(n), it)]
            if len(batch) < n:
                result.stopped = f"the folder ran out of unread image files before {c} in flight"
                return None
            got = read(batch, c)
            bar.update(n)
            if got is None:
                result.stopped = f"--max-bytes reached before {c} in flight"
                return None
            return got[1] / got[0]

        if result.latencies_s:
            sweep(result, step, max_concurrency)
    mount = readpath.mount_of(os.stat(files[0]).st_dev, files[0])
    limits = mount.fuse_limits()
    known = f", max_background={limits['max_background']}" if "max_background" in limits else ""
    mean = result.bytes / result.reads if result.reads else 0
    # Whole-file reads as the rule sees preads: capped when they stop well short of what the
    # server asks (its probe's concurrency, or --max-concurrency when lower), not for want of
    # CPU; a local disk caps nothing.
    peak = max(result.sweep, key=lambda cr: cr[1])[0] if result.sweep else 1
    choice = readpath.Choice(mount, "pread", "measured", asked=max_concurrency, latency_s=result.mean_latency_s,
                             rates={"pread": result.peak_rate}, ceilings={"pread": result.ceiling},
                             probe_concurrency=min(max_concurrency, readpath.PROBE_CONCURRENCY) if result.sweep else 0,
                             cpu_cores={"pread": result.cpu_cores.get(peak, 0.0)})
    remedies = _file_remedies(target, choice, max_concurrency, capped=not mount.is_local and choice.capped())
    return Report(target, f"{mount.fs_type} at {mount.point}{known}", len(images), round(mean), "images", max_bytes,
                  {"whole": result}, "whole", "an ImageFolder: each image file read whole, open, read and close, as "
                  "the server reads it", remedies)


def list_files(target: str) -> list[tuple[str, int]]:
    """(path, size) of the regular, non-hidden files at or under `target` (at most MAX_FILES)."""
    if not os.path.exists(target):
        raise ProbeError(f"{target}: no such file or folder")
    if os.path.isfile(target):
        return [(target, os.stat(target).st_size)]
    if not os.path.isdir(target):
        raise ProbeError(f"{target}: neither a file nor a folder")
    if not os.access(target, os.R_OK | os.X_OK):
        raise ProbeError(f"{target}: cannot list it (permission denied)")
    out: list[tuple[str, int]] = []
    for p in _names(target):
        try:
            st = os.stat(p)  # one stat a file (on a bucket mount, a request each)
        except OSError:  # gone, or a dangling link: not a file to read
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        out.append((p, st.st_size))
        if len(out) >= MAX_FILES:
            break
    return out


def probe_files(target: str, *, row_bytes: int, rows: str, max_bytes: int, max_concurrency: int) -> Report:
    """Measure preads and page faults of the files under `target` (an ImageFolder's image
    files: whole-file reads, `probe_whole_files`)."""
    if os.path.isdir(target) and os.access(target, os.R_OK | os.X_OK):
        images, others = image_files(target)
        if images and len(images) >= others:
            return probe_whole_files(target, images, max_bytes=max_bytes, max_concurrency=max_concurrency)
    if native.measure is None or native.Mapping is None:
        raise ProbeError(f"{target}: the probe needs croupier's native read pool, which this install lacks "
                         "(built without a C compiler)")
    files = list_files(target)
    pages = Pages(files, row_bytes)
    if not pages.files:
        what = "no files" if not files else f"{len(files)} file(s), none with {_SKEW + row_bytes} bytes or more"
        raise ProbeError(f"{target}: not a dataset's files: {what} (hidden files are skipped)")
    for path, _ in files[:1]:
        os.close(_open(path))  # unreadable: say so before any measurement
    budget = Budget(max_bytes, pages.span)
    paths = len(readpath.READ_PATHS)
    share = max_bytes // paths // pages.span  # reads per path
    results = {name: PathResult(name) for name in readpath.READ_PATHS}
    with _bar(paths * min(_planned_reads(max_concurrency), share), f"probe {target}") as bar:
        for result in results.values():
            if not _usable(result, pages.files[0].path):
                continue
            spent = result.bytes  # O_DIRECT's test read of the alignment
            path_budget = Budget(min(budget.left - spent, share * pages.span), _read_cost(result, pages, row_bytes))
            _file_latencies(result, pages, path_budget, row_bytes, bar)
            sweep(result, _file_step(result, pages, path_budget, row_bytes, bar), max_concurrency)
            _at_probe_concurrency(result, _file_step(result, pages, path_budget, row_bytes, bar))
            budget.left -= result.bytes
    mount = readpath.mount_of(os.stat(pages.files[0].path).st_dev, pages.files[0].path)
    choice = _choice(mount, results, max_concurrency)
    spread = _spread(choice, pages, budget, results["pread"], row_bytes)
    limits = mount.fuse_limits()
    known = f", max_background={limits['max_background']}" if "max_background" in limits else ""
    storage = f"{mount.fs_type} at {mount.point}{known}"
    return Report(target, storage, len(files), row_bytes, rows, max_bytes, results, choice.path,
                  _reason(choice), _file_remedies(target, choice, max_concurrency), spread)


def _spread(choice: readpath.Choice, pages: Pages, budget: Budget, pread: PathResult, row_bytes: int) -> dict | None:
    """What the server times on a daemon-bound mount read by preads: preads spread over
    readpath.HANDLES descriptors of a file (readpath.time_handles), on places never read
    before, charged to the byte bound and counted as preads; None where it would not."""
    if choice.path != "pread" or not readpath.daemon_bound(choice):
        return None
    n = 4 * readpath.HANDLES
    cost = _read_cost(pread, pages, row_bytes)
    if budget.left < n * cost:
        return None
    path, offsets = pages.take(n)
    if len(offsets) < n:
        return None
    readpath.time_handles(choice, path, 0, offsets=offsets, read_bytes=row_bytes)
    pread.reads += n
    pread.bytes += n * cost
    budget.left -= n * cost
    if choice.spread is None:
        return None
    k, rate = choice.spread
    return {"descriptors": k, "reads_per_s": round(rate, 1), "used": choice.handles > 1}


def _usable(result: PathResult, path: str) -> bool:
    """The path can read `path` here (O_DIRECT may be refused: the reason is kept)."""
    if result.name != "direct":
        return True
    try:
        with _opened(result, path):
            pass
    except OSError as e:
        why = "the file system refuses O_DIRECT" if e.errno == errno.EINVAL else "O_DIRECT open failed"
        result.unavailable = f"{why} ({e.strerror or e})"
        return False
    if result.align in (1, 512):  # found by reading that many bytes at that offset (1, then 512)
        result.reads += 1
        result.bytes += result.align
    return True


def _at_probe_concurrency(result: PathResult, step: Callable[[int], float | None]) -> None:
    """The rate at readpath's probe concurrency, which its rule is stated for, where the sweep
    stopped short of it."""
    c = readpath.PROBE_CONCURRENCY
    result.rule_rate = result.rate_at(c)
    if result.rule_rate is None and result.sweep:
        stopped = result.stopped
        result.rule_rate = step(c)
        result.stopped = stopped


def _choice(mount: readpath.Mount, results: dict[str, PathResult], max_concurrency: int) -> readpath.Choice:
    """readpath's rule on the rates measured at its probe concurrency."""
    c = readpath.PROBE_CONCURRENCY
    latency = results["pread"].serial_latency_s
    choice = readpath.Choice(mount, "pread", "measured", asked=max_concurrency, latency_s=latency, probe_concurrency=c)
    for name, result in results.items():
        if result.unavailable:
            choice.unavailable[name] = result.unavailable
        rate = result.rule_rate
        if rate is not None:
            choice.rates[name] = rate
            choice.ceilings[name] = min(float(c), rate * latency)
            choice.cpu_cores[name] = result.cpu_cores.get(c, 0.0)
    if "pread" not in choice.rates:
        choice.reason = f"not measured at {c} in flight (byte bound): preads, the default"
        return choice
    if mount.is_local:  # the server does not probe these: preads, whatever the rates say
        choice.reason = f"a local file system ({mount.fs_type}): no request cap"
        return choice
    choice.path = readpath.decide(choice)
    return choice


def _reason(choice: readpath.Choice) -> str:
    if choice.reason != "measured":
        return choice.reason
    c = choice.probe_concurrency
    if not choice.capped():
        return f"preads reach {choice.ceilings['pread']:.0f} of {c} reads in flight: not capped"
    capped = f"preads capped at about {choice.ceilings['pread']:.0f} in flight"
    if choice.path != "pread":
        return (f"{capped}; {readpath.PATH_WORDS[choice.path]} make {choice.rates[choice.path]:,.0f} reads/s "
                f"against {choice.rates['pread']:,.0f}")
    others = " nor ".join(readpath.PATH_WORDS[p] for p in choice.rates if p != "pread") or "nothing else"
    return f"{capped}, and neither {others} do {readpath.MARGIN - 1:.0%} better"


def _file_remedies(target: str, choice: readpath.Choice, want: int, capped: bool | None = None) -> list[str]:
    out: list[str] = []
    store_mount = mounts.object_store_mount(target)
    if store_mount is not None:
        m = store_mount.mount
        if store_mount.url is not None:
            out.append(f"{m.mount_point} is a {store_mount.client} mount of an object store: serve "
                       f"{store_mount.url} instead" + (f" ({store_mount.note})" if store_mount.note else "")
                       + f"; `croupier probe {store_mount.url}` measures it")
        else:
            out.append(f"{m.mount_point} is a {store_mount.client} mount of an object store; serve its bucket's "
                       f"URL instead (not derived: {store_mount.note})")
        limit = mounts.CLIENT_LIMITS.get(store_mount.client)
        if limit and not (capped is None and choice.capped() and readpath.daemon_bound(choice)):  # else the remedy says it
            out.append(f"to keep the mount: {limit}")
    if capped is None:  # ranges: the paths measured tell the kernel's cap from the daemon's
        if choice.capped():
            out.append(readpath.remedy(choice.mount, want, choice))
    elif capped and not (store_mount is not None and store_mount.client in mounts.CLIENT_LIMITS):
        out.append(readpath.remedy(choice.mount, want))  # whole files: the mount's cap, where no client's own is known
    return out


# ---- object stores --------------------------------------------------------------------------

async def _gets(store, reads: list[tuple[str, int]], size: int, c: int) -> float:
    """GETs/s of `reads` (key, offset), `c` at a time, in the steady state (as the native probe)."""
    it = iter(reads)
    done, dry = [0], [0.0, 0]

    async def worker() -> None:
        for key, off in it:
            await store.read(key, off, size)
            done[0] += 1
        if not dry[0]:
            dry[:] = [time.perf_counter() - t0, done[0]]

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(c)))
    secs = time.perf_counter() - t0
    return dry[1] / dry[0] if dry[1] >= c and dry[0] > 0 else len(reads) / max(secs, 1e-9)


def probe_objects(target: str, *, row_bytes: int, rows: str, max_bytes: int, max_concurrency: int,
                  options: dict[str, str]) -> Report:
    """Measure range GETs of the objects under `target` through the server's ObjectStore."""
    try:
        store, prefix = urls.open_store(target, options=options)
        objects = [(f.path, f.size) for f in store.list_files(prefix)]
    except (OSError, ValueError) as e:
        raise ProbeError(f"{target}: {e}") from e
    objects = [(k, s) for k, s in objects if s >= row_bytes and not k.rsplit("/", 1)[-1].startswith(".")]
    if not objects:
        raise ProbeError(f"{target}: not a dataset's objects: none under it holds {row_bytes} bytes or more")
    rng = random.Random(0)
    result = PathResult("get")
    budget = Budget(max_bytes, row_bytes)

    def draw(n: int) -> list[tuple[str, int]]:
        picks = [objects[rng.randrange(len(objects))] for _ in range(budget.take(n, result))]
        return [(k, rng.randrange(s - row_bytes + 1)) for k, s in picks]

    loop = asyncio.new_event_loop()
    try:
        with _bar(_planned_reads(max_concurrency), f"probe {target}") as bar:
            for key, off in draw(LATENCY_READS):
                t = time.perf_counter()
                loop.run_until_complete(store.read(key, off, row_bytes))
                result.latencies_s.append(time.perf_counter() - t)
                bar.update(1)

            def step(c: int) -> float | None:
                if budget.left // budget.cost < ROUNDS * c:
                    return None
                reads = draw(ROUNDS * c)
                rate = loop.run_until_complete(_gets(store, reads, row_bytes, c))
                bar.update(len(reads))
                return rate

            sweep(result, step, max_concurrency)
    except OSError as e:
        raise ProbeError(f"{target}: {e}") from e
    finally:
        loop.close()
    storage = f"{store.url('')} (endpoint {getattr(store, 'endpoint', None) or 'default'}), range GETs"
    reason = f"object store: range GETs, {result.knee} in flight before the rate stops rising"
    return Report(target, storage, len(objects), row_bytes, rows, max_bytes, {"get": result}, "get", reason)


# ---- the command ----------------------------------------------------------------------------

def run(target: str, *, row_bytes: int = DEFAULT_ROW_BYTES, rows: str = "text", max_bytes: int = DEFAULT_MAX_BYTES,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY, options: dict[str, str] | None = None) -> Report:
    """Probe `target` (a path, or an object store URL). Raises ProbeError naming it."""
    if row_bytes < 1 or max_bytes < 1 or max_concurrency < 1:
        raise ProbeError(f"{target}: --row-bytes, --max-bytes and --max-concurrency must be positive")
    if rows not in READS_PER_SAMPLE:
        raise ProbeError(f"{target}: --rows must be one of {', '.join(READS_PER_SAMPLE)}, not {rows!r}")
    kwargs = dict(row_bytes=row_bytes, rows=rows, max_bytes=max_bytes, max_concurrency=max_concurrency)
    if urls.is_url(target) and not target.lower().startswith("file://"):
        return probe_objects(target, options=dict(options or {}), **kwargs)
    if target.lower().startswith("file://"):
        try:
            _, target = urls.open_store(target)
        except ValueError as e:
            raise ProbeError(str(e)) from e
    return probe_files(target, **kwargs)


def _bytes(text: str) -> int:
    """'67108864', '64MiB', '64M', '1G' -> bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if scale > 1 else t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected bytes, e.g. 67108864 or 64MiB") from None


def cmd_probe(args: argparse.Namespace) -> int:
    try:
        report = run(args.target, row_bytes=args.row_bytes, rows=args.rows, max_bytes=args.max_bytes,
                     max_concurrency=args.max_concurrency, options=storage_options(args.storage_option or []))
    except (ProbeError, ValueError) as e:
        print(f"croupier probe: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json(), indent=2) if args.json else report.table())
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`croupier probe`: measure the storage before training."""
    p = sub.add_parser("probe", help="measure a path's or bucket's latency and concurrency, and predict samples/s",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="PATH|URL", help="a dataset's file or folder, or s3://bucket/prefix")
    p.add_argument("--row-bytes", type=int, default=DEFAULT_ROW_BYTES,
                   help=f"bytes of one read, a row's size (default {DEFAULT_ROW_BYTES})")
    p.add_argument("--rows", choices=sorted(READS_PER_SAMPLE), default="text",
                   help="text rows take 2 reads a sample, images 1 (default text)")
    p.add_argument("--max-bytes", type=_bytes, default=DEFAULT_MAX_BYTES,
                   help=f"read at most this much (default {DEFAULT_MAX_BYTES >> 20}MiB)")
    p.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY,
                   help=f"largest reads in flight of the sweep (default {DEFAULT_MAX_CONCURRENCY})")
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                   help="object-store setting for s3:// (as croupier serve's): endpoint, region, ...")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_probe)
