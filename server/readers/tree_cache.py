"""A dataset's folder listing cached between starts: the next open reads one file.

The cache file (JSON, under --cache-dir, else ~/.cache/croupier/tree-index) holds the
tree listed at the last open and the mtime of every folder in it, taken just before that
folder was listed. An open stats each folder again (one stat per folder, on the listing
threads) and uses the file when all mtimes match; else it lists the tree afresh.

A folder's mtime changes when an entry is added to it, removed or renamed, so a file or
subfolder added or removed anywhere in the tree is seen. Not seen: a file rewritten in
place under the same name (nothing about a file is cached but its name: its bytes are
read fresh anyway), and a change within `RACY_S` of the listing on a file system whose
mtimes are coarse: a listing with a folder changed that recently is not written.

Not used on a FUSE mount of an object store: there a folder's mtime says when the client
first listed it, not when its objects changed (rclone: measured; it stays put when an
object is added and moves at each mount), so every open lists afresh: one listing per
folder, a few requests each.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from ..storage import Store
from .listing import LIST_THREADS, Progress, Tree, list_tree

VERSION = 1
#: A listing whose folders changed less than this long before it is not cached (the
#: mtimes of some file systems have 1 s or 2 s steps).
RACY_S = 2.0


def cache_path(root: str, cache_dir: str | os.PathLike[str] | None, kind: str) -> Path:
    base = Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "croupier" / "tree-index"
    digest = hashlib.sha1(os.path.realpath(root).encode()).hexdigest()[:16]
    return base / f"{kind}.{os.path.basename(root.rstrip('/')) or 'root'}.{digest}.json"


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write `obj` to `path` as JSON through a fresh temporary file and a rename; an
    unwritable cache only costs a rescan next time, so errors are dropped."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    created = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A new file, never an existing name: a link planted under the temporary name (the
        # folder may be writable by others) must not redirect the server's write.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        created = True
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(obj))
        os.replace(tmp, path)  # replaces a link named like the file, never writes through it
    except OSError:
        if created:
            tmp.unlink(missing_ok=True)


def _mtimes(root: str, rels: list[str], threads: int) -> dict[str, int | None]:
    def one(rel: str) -> int | None:
        try:
            return os.stat(os.path.join(root, rel) if rel else root).st_mtime_ns
        except OSError:
            return None

    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="croupier-stat") as pool:
        return dict(zip(rels, pool.map(one, rels)))


def _load(path: Path, root: str, threads: int) -> Tree | None:
    try:
        cached = json.loads(path.read_text())
        if cached.get("version") != VERSION or cached.get("root") != os.path.realpath(root):
            return None
        stamp: dict[str, int] = cached["mtimes"]
        if _mtimes(root, list(stamp), threads) != stamp:
            return None
        return {rel: (dirs, files) for rel, (dirs, files) in cached["tree"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing, stale or unreadable: list again


class _Stamping:
    """A store's `list_names` that notes each folder's mtime just before listing it, so a
    change during the listing shows as a stale stamp at the next open."""

    def __init__(self, store: Store, root: str):
        self.store, self.root = store, root
        self.mtimes: dict[str, int] = {}
        self.join = store.join

    def list_names(self, path: str) -> tuple[list[str], list[str]]:
        rel = os.path.relpath(path, self.root).replace(os.sep, "/")
        self.mtimes["" if rel == "." else rel] = os.stat(path).st_mtime_ns
        return self.store.list_names(path)


def cached_tree(
    store: Store,
    root: str,
    progress: Progress,
    cache_dir: str | os.PathLike[str] | None,
    kind: str,
    use_cache: bool = True,
    threads: int = LIST_THREADS,
) -> tuple[Tree, bool]:
    """The tree under `root` (a local path), and whether it came from the cache."""
    if not use_cache or store.scheme != "file":
        return list_tree(store, root, progress, threads), False
    path = cache_path(root, cache_dir, kind)
    tree = _load(path, root, threads)
    if tree is not None:
        return tree, True
    started = time.time_ns()
    stamping = _Stamping(store, root)
    tree = list_tree(stamping, root, progress, threads)  # type: ignore[arg-type]
    if max(stamping.mtimes.values(), default=0) < started - int(RACY_S * 1e9):
        write_json_atomic(
            path, {"version": VERSION, "root": os.path.realpath(root), "mtimes": stamping.mtimes, "tree": tree}
        )
    return tree, False
