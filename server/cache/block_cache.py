"""The one cache of a server: its tiers, the file versions open datasets read, and its
counters. Every dataset's CachedStore reads through the same BlockCache."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence

from .blocks import BLOCK_BYTES, FileKey, pieces, span
from .disk_tier import DiskTier
from .memory_tier import MemoryTier
from .sizing import CacheSizes

log = logging.getLogger("croupier.server.cache")

#: Blocks read at once by fills (and disk-tier reads), over the whole server. A fill's
#: O_DIRECT block is one FUSE request (fill.open_for_fill); a row read directly meanwhile is
#: a page fault on such a mount (outside its 12 background slots) or a pread of a raised one.
#: The real suite's text cases, alternating runs of 8 and 16 (2026-11-28, 8ab4776): through
#: an s3fs mount of a 20 ms bucket 3,198-28,048 rows/s with 8 against 36,369-40,962 with 16
#: (four pairs); latencyfs at 5 ms with the kernel's defaults 35,021-37,072 against
#: 41,341-42,281, raised 40,413 against 44,074, through rclone level (41,409-43,107 against
#: 39,578-44,329), larger than memory (a 10% cache) level (9,077 against 9,678). 4 made
#: 16,746-17,636 on the kernel-default mount where 8 made 26,001-38,062. 32 against 16: through
#: s3fs 43,465-45,159 against 29,522-35,893 and the kernel-default mount 47,313 against 44,051, but
#: rclone 43,094 against 52,119 and larger than memory 5,576 against 9,952 (its 10% cache thrashed).
FILL_IN_FLIGHT = 16


class CacheStats:
    """Range lookups served from a tier (hits) or from storage (misses), and their bytes.
    Counted on the event loop's thread only, as StoreStats' async counters are."""

    __slots__ = ("hits", "misses", "hit_bytes", "miss_bytes", "disk_hits")

    def __init__(self) -> None:
        self.hits = self.misses = self.hit_bytes = self.miss_bytes = self.disk_hits = 0

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class BlockCache:
    def __init__(self, sizes: CacheSizes):
        self.sizes = sizes
        self.memory = MemoryTier(sizes.memory_bytes)
        self.disk = DiskTier(sizes.disk_dir, sizes.disk_bytes) if sizes.disk_dir and sizes.disk_bytes > 0 else None
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._current: dict[str, FileKey] = {}  # path id -> the version open datasets read
        self._users: dict[str, int] = {}  # version id -> pins by open datasets
        #: Threads for fills and disk-tier reads and writes (never the event loop's).
        self.io = concurrent.futures.ThreadPoolExecutor(FILL_IN_FLIGHT, thread_name_prefix="croupier-cache")
        #: st_dev (a mount) or "s3://bucket (endpoint)" (a store) -> whether fills pay there
        #: (fill.py, object_fill.py decide, once each).
        self.fill_pays: dict[int | str, bool] = {}
        self.closed = False

    # ---- file versions ------------------------------------------------------------------
    def register(self, key: FileKey, url: str | Callable[[], str], scan_disk: bool = True) -> None:
        """A dataset opened `key`: drop what is cached of any other version of its file
        (`scan_disk` False: not on disk, whose index a scan walks whole: a file read whole
        is registered at its first read, one of thousands; its other versions there are
        never served, another key, and go when room is needed). `url` names the file in
        the log line, or makes its name when one is written (a store's `url` through its
        layers cost an image a microsecond or two on the loop)."""
        pid, vid = key.path_id, key.version_id
        with self._lock:
            old = self._current.get(pid)
            self._current[pid] = key
            self._users[vid] = self._users.get(vid, 0) + 1
        dropped = 0
        if old is not None and old != key:
            dropped += self.memory.drop(old.version_id)
        if self.disk is not None and scan_disk:
            dropped += self.disk.drop_other_versions(pid, vid)
        if dropped or (old is not None and old != key):  # a version seen before, or one on disk from a past run
            now = f"ETag {key.etag}" if key.etag else f"mtime_ns {key.mtime_ns}"
            log.info("cache: %s changed (now %d bytes, %s): dropped %d cached block(s) of its earlier version",
                     url() if callable(url) else url, key.size, now, dropped)

    def release(self, key: FileKey) -> None:
        """A dataset reading `key` closed; with the last, its memory blocks leave (disk
        blocks stay for the next job, until their room is needed)."""
        vid = key.version_id
        with self._lock:
            left = self._users.get(vid, 0) - 1
            if left > 0:
                self._users[vid] = left
                return
            self._users.pop(vid, None)
        self.memory.drop(vid)

    def forget(self, key: FileKey) -> int:
        """`key` is stale (its object changed while a dataset read it): its blocks leave
        both tiers (the disk's on the cache's threads); how many left memory."""
        with self._lock:
            self._users.pop(key.version_id, None)
        if self.disk is not None and not self.closed:
            self.io.submit(self.disk.drop_version, key.version_id)
        return self.memory.drop(key.version_id)

    def in_use(self) -> set[str]:
        with self._lock:
            return set(self._users)

    # ---- lookups (event loop) -------------------------------------------------------------
    def from_memory(self, key: FileKey, offset: int, size: int) -> bytes | None:
        """Bytes [offset, offset + size) of `key` (clipped at its end) if every block they
        touch is in memory, else None."""
        if size < 0 or offset + size > key.size:
            size = max(0, key.size - offset)
        vid, get = key.version_id, self.memory.get
        if size <= BLOCK_BYTES and (offset % BLOCK_BYTES) + size <= BLOCK_BYTES:  # one block: no join
            block = get(vid, offset // BLOCK_BYTES)
            if block is None:
                return None
            start = offset % BLOCK_BYTES
            return block[start:start + size]
        parts = []
        for b, start, length in pieces(offset, size):
            block = get(vid, b)
            if block is None:
                return None
            parts.append(block[start:start + length])
        return b"".join(parts)

    def whole_in_memory(self, key: FileKey) -> bool:
        """Every block of `key` is in the memory tier (a dict lookup: a count per version)."""
        return self.memory.held(key.version_id) >= -(-key.size // BLOCK_BYTES)

    def on_disk(self, key: FileKey, offset: int, size: int) -> bool:
        if self.disk is None:
            return False
        if size < 0 or offset + size > key.size:
            size = max(0, key.size - offset)
        pid, vid = key.path_id, key.version_id
        return all(self.disk.has((pid, vid, b)) for b in span(offset, size))

    def read_disk(self, key: FileKey, ranges: Sequence[tuple[int, int]]) -> list[bytes] | None:
        """The ranges from disk-tier blocks (checked), or None if a block failed or left
        (blocking: the cache's threads run it)."""
        assert self.disk is not None
        pid, vid = key.path_id, key.version_id
        blocks: dict[int, bytes] = {}
        out = []
        for offset, size in ranges:
            if size < 0 or offset + size > key.size:
                size = max(0, key.size - offset)
            parts = []
            for b, start, length in pieces(offset, size):
                if b not in blocks:
                    data = self.disk.get((pid, vid, b))
                    if data is None:
                        return None
                    blocks[b] = data
                    self.memory.try_admit(vid, b, data)  # promoted while memory has room
                parts.append(blocks[b][start:start + length])
            out.append(b"".join(parts))
        return out

    def admit_read(self, key: FileKey, offset: int, data: bytes) -> None:
        """Blocks that a direct read fetched whole go into memory while it has room."""
        if len(data) < BLOCK_BYTES and offset + len(data) < key.size:
            return
        vid = key.version_id
        first = -(-offset // BLOCK_BYTES)
        for b in range(first, key.blocks()):
            start = b * BLOCK_BYTES - offset
            length = key.block_length(b)
            if start + length > len(data):
                break
            self.memory.try_admit(vid, b, bytes(data[start:start + length]))

    # ---- admission of filled blocks (fill threads) -----------------------------------------
    def store_block(self, key: FileKey, block: int, data: bytes) -> bool:
        """Keep a block a fill read: in memory while it has room, else on disk (making room
        there from files no open dataset reads). False when neither has room: the fill stops."""
        if self.memory.try_admit(key.version_id, block, data):
            return True
        if self.disk is None or not self.disk.writing:
            return False
        bid = (key.path_id, key.version_id, block)
        if self.disk.has(bid):
            return True
        if self.disk.room_signed() < len(data) + 64:
            self.disk.evict_unused(len(data) + 64, self.in_use())
        return self.disk.put(bid, data)

    def cached(self, key: FileKey, block: int) -> bool:
        return self.memory.has(key.version_id, block) or (
            self.disk is not None and self.disk.has((key.path_id, key.version_id, block)))

    async def run_io(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.io, fn, *args)

    def close(self) -> None:
        self.closed = True
        self.io.shutdown(wait=False, cancel_futures=True)


def open_cache(memory: str, cache_dir: str | None, disk_size: str, fill: str = "auto") -> BlockCache | None:
    """The server's cache from its settings (--cache-memory, --cache-dir, --cache-size,
    --cache-fill); None when both tiers are off."""
    from .sizing import disk_folder, memory_limit, parse_memory_budget, parse_size

    if fill not in ("auto", "always", "never"):
        raise ValueError(f"cache_fill={fill!r} (--cache-fill): expected auto, always or never")
    disk_bytes = parse_size(str(disk_size), "cache_size (--cache-size)")
    sizes = CacheSizes(parse_memory_budget(str(memory)), disk_folder(cache_dir) if disk_bytes else None, disk_bytes, fill)
    if not sizes.enabled:
        log.info("cache: off (--cache-memory 0 and no --cache-size)")
        return None
    cache = BlockCache(sizes)
    log.info("cache: %.0f MiB of memory (%s of %.0f MiB the server may use)%s; fill: %s", sizes.memory_bytes / 2**20,
             memory, memory_limit() / 2**20,
             f", {disk_bytes / 2**20:.0f} MiB on disk in {sizes.disk_dir}" if sizes.disk_dir else ", no disk tier", fill)
    return cache
