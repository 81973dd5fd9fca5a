"""List a dataset's folder tree at open: directory listings only, many at once, with progress.

A dataset of loose files (ImageFolder) used to cost a stat per file at open, and a stat
through a FUSE mount of a bucket is a request (rclone: a HEAD each, 20 ms apiece on the
loopback store: 130 s for 6,000 images, one after another). Here each folder costs one
listing (`Store.list_names`: readdir's names and types, no sizes), and the listings run
on threads of their own, `LIST_THREADS` at once, that only wait on storage: not on the
event loop, not on the server's few CPU workers. An open that takes longer than
`PROGRESS_S` logs its progress every `PROGRESS_S`: files listed, folders left, rate.
Opens that read something of each file instead (a tar shard's index, a Parquet footer, an
Arrow file's layout) report theirs with `FilesProgress`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..storage import Store

log = logging.getLogger("croupier.server.open")

#: Listings in flight at once: enough to hide a 20 ms store behind 1,000 folders (about
#: 0.6 s), few enough to stay polite to a metadata server.
LIST_THREADS = 32
#: Seconds between progress lines of a slow open.
PROGRESS_S = 5.0

#: A folder tree by name: '/'-separated path relative to the root ('' for the root) ->
#: (subfolder names, file names), each sorted.
Tree = dict[str, tuple[list[str], list[str]]]


@dataclass
class Progress:
    """Counts of one listing, and the progress lines it logged."""

    what: str  # "dataset NAME (URL)"
    interval_s: float = PROGRESS_S
    clock: Callable[[], float] = time.monotonic
    folders: int = 0
    files: int = 0
    lines: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.started = self.last = self.clock()

    def listed(self, files: int, left: int) -> None:
        """One folder listed holding `files` files, `left` folders still to list."""
        self.folders += 1
        self.files += files
        self.tick(left)

    def tick(self, left: int) -> None:
        now = self.clock()
        if now - self.last < self.interval_s:
            return
        self.last = now
        elapsed = max(now - self.started, 1e-9)
        self.say(
            f"opening {self.what}: {self.files:,} files in {self.folders:,} folders listed, {left:,} folders left, "
            f"{self.files / elapsed:,.0f} files/s"
        )

    def done(self) -> None:
        if self.lines:  # only an open slow enough to report progress reports its end
            elapsed = self.clock() - self.started
            self.say(f"opened {self.what}: {self.files:,} files in {self.folders:,} folders listed in {elapsed:.1f} s")

    def say(self, line: str) -> None:
        _say(self.lines, line)


def _say(lines: list[str], line: str) -> None:
    """A progress line: logged, and kept (what tests and callers read back)."""
    lines.append(line)
    log.info("%s", line)


@dataclass
class FilesProgress:
    """An open that reads something of each of a dataset's `total` files: a line every
    `PROGRESS_S` (read when made) while it runs, with the rate and the time left, and one
    at its end when it logged any. Files may finish on several threads."""

    what: str  # "dataset NAME (URL)"
    total: int
    kind: str = "files"  # what of each file is read: "shard indexes", "footers", ...
    interval_s: float | None = None
    clock: Callable[[], float] = time.monotonic
    lines: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.interval = PROGRESS_S if self.interval_s is None else self.interval_s
        self.done = 0
        self.started = self.last = self.clock()
        self._lock = threading.Lock()

    def step(self) -> None:
        """One more file read."""
        with self._lock:
            self.done += 1
            now = self.clock()
            if now - self.last < self.interval or self.done >= self.total:
                return
            self.last = now
            rate = self.done / max(now - self.started, 1e-9)
            _say(self.lines, f"opening {self.what}: {self.done:,} of {self.total:,} {self.kind} read, {rate:,.1f} a second, "
                      f"about {(self.total - self.done) / rate:,.0f} s left")

    def finish(self) -> None:
        if self.lines:  # only an open slow enough to report progress reports its end
            _say(self.lines, f"opened {self.what}: {self.total:,} {self.kind} read in {self.clock() - self.started:.1f} s")


def list_tree(store: Store, root: str, progress: Progress, threads: int = LIST_THREADS) -> Tree:
    """Every folder under `root` (links to folders followed, as os.walk(followlinks=True)
    and torchvision do), listed by name, `threads` listings at once."""
    tree: Tree = {}
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="croupier-list")
    try:
        pending = {pool.submit(store.list_names, root): ""}
        while pending:
            done, _ = concurrent.futures.wait(pending, timeout=progress.interval_s, return_when="FIRST_COMPLETED")
            if not done:
                progress.tick(len(pending))
                continue
            for fut in done:
                rel = pending.pop(fut)
                dirs, files = fut.result()
                tree[rel] = (dirs, files)
                for d in dirs:
                    child = f"{rel}/{d}" if rel else d
                    pending[pool.submit(store.list_names, store.join(root, child))] = child
                progress.listed(len(files), len(pending))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    progress.done()
    return tree
