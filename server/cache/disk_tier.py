"""The disk tier: blocks as files in a local folder, checksummed, never past its bound.

A block is written to a temporary name and renamed into place, so a crash leaves at
most a temporary file, which the next start deletes without reading. Each file starts
with a header (magic, CRC-32 of the data, data length); a read checks both, and a block
that fails is deleted, logged once, and read from storage instead. Any write error (a full
disk, a read-only folder) turns writing off with one warning: reads go to storage, no
stream fails. The bound counts every byte on disk, headers included, and is reserved
before a write, so the folder never holds more than `bound` bytes of blocks.

Calls are blocking (they touch the local disk): the cache runs them on its own threads.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib

log = logging.getLogger("croupier.server.cache")

_HEADER = struct.Struct("<4sII")  # magic, crc32, length
_MAGIC = b"CRB1"
_SUFFIX = ".blk"
_TMP = ".tmp"

BlockId = tuple[str, str, int]  # (path id, version id, block)


class DiskTier:
    def __init__(self, folder: str, bound: int):
        self.folder = folder
        self.bound = bound
        self._lock = threading.Lock()
        self._index: dict[BlockId, int] = {}  # -> bytes on disk
        self.used = 0
        self._reserved = 0
        self.filled = 0
        self.evictions = 0
        self.corrupt = 0  # blocks that failed their check
        self.writing = True  # off after the first write error
        self._warned_corrupt = False
        os.makedirs(folder, exist_ok=True)
        self.partial_removed = self._scan()

    # ---- start ----------------------------------------------------------------------
    def _scan(self) -> int:
        """Index the blocks a previous run left; delete its temporary (partial) files."""
        partial = 0
        for sub in os.scandir(self.folder):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for e in os.scandir(sub.path):
                if _TMP in e.name:
                    _remove(e.path)
                    partial += 1
                    continue
                parsed = _parse_name(e.name)
                if parsed is None:
                    continue
                size = e.stat(follow_symlinks=False).st_size
                self._index[parsed] = size
                self.used += size
        if partial:
            log.info("cache: ignored and deleted %d partial block file(s) in %s (a crash mid-write)", partial, self.folder)
        if self.used > self.bound:  # the bound shrank since the last run
            self.evict_unused(0, set())
        return partial

    def _path(self, bid: BlockId) -> str:
        pid, vid, block = bid
        return os.path.join(self.folder, pid[:2], f"{pid}-{vid}-{block}{_SUFFIX}")

    # ---- lookups ----------------------------------------------------------------------
    def has(self, bid: BlockId) -> bool:
        return bid in self._index

    def get(self, bid: BlockId) -> bytes | None:
        """The block's data if its file is whole and its checksum holds; else None (a bad
        block is deleted and counted)."""
        if bid not in self._index:
            return None
        try:
            with open(self._path(bid), "rb") as f:
                raw = f.read()
        except OSError:
            self._forget(bid, remove=False)
            return None
        if len(raw) >= _HEADER.size:
            magic, crc, length = _HEADER.unpack_from(raw)
            data = raw[_HEADER.size:]
            if magic == _MAGIC and length == len(data) and zlib.crc32(data) == crc:
                return data
        self.corrupt += 1
        if not self._warned_corrupt:
            self._warned_corrupt = True
            log.warning("cache: block file %s failed its checksum; it was deleted and the data is read from storage "
                        "(further bad blocks are counted in croupier_cache_corrupt_blocks, not logged)", self._path(bid))
        self._forget(bid, remove=True)
        return None

    # ---- writes ----------------------------------------------------------------------
    def put(self, bid: BlockId, data: bytes) -> bool:
        """Write a block if writing is on and the bound has room; False otherwise."""
        need = _HEADER.size + len(data)
        with self._lock:
            if not self.writing or bid in self._index or self.used + self._reserved + need > self.bound:
                return False
            self._reserved += need
        path = self._path(bid)
        tmp = f"{path}{_TMP}.{os.getpid()}.{threading.get_ident()}"
        ok = False
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, zlib.crc32(data), len(data)))
                f.write(data)
            os.replace(tmp, path)
            ok = True
        except OSError as exc:
            _remove(tmp)
            self._write_failed(exc)
        with self._lock:
            self._reserved -= need
            if ok:
                self._index[bid] = need
                self.used += need
                self.filled += len(data)
        return ok

    def _write_failed(self, exc: OSError) -> None:
        with self._lock:
            first, self.writing = self.writing, False
        if first:
            log.warning("cache: cannot write to the disk tier %s (%s); no more blocks are written there this run, "
                        "reads that miss go to storage", self.folder, exc)

    # ---- eviction ---------------------------------------------------------------------
    def _forget(self, bid: BlockId, remove: bool) -> None:
        with self._lock:
            size = self._index.pop(bid, None)
            if size is not None:
                self.used -= size
                self.evictions += 1
        if remove:
            _remove(self._path(bid))

    def drop_other_versions(self, path_id: str, version_id: str) -> int:
        """Delete the blocks of every other version of a file (it changed); how many."""
        stale = [bid for bid in list(self._index) if bid[0] == path_id and bid[1] != version_id]
        for bid in stale:
            self._forget(bid, remove=True)
        return len(stale)

    def drop_version(self, version_id: str) -> int:
        gone = [bid for bid in list(self._index) if bid[1] == version_id]
        for bid in gone:
            self._forget(bid, remove=True)
        return len(gone)

    def evict_unused(self, nbytes: int, in_use: set[str]) -> int:
        """Delete blocks of file versions no open dataset reads until `nbytes` are free."""
        freed = 0
        for bid in list(self._index):
            if self.room_signed() >= nbytes:
                break
            if bid[1] not in in_use:
                freed += self._index.get(bid, 0)
                self._forget(bid, remove=True)
        return freed

    def room_signed(self) -> int:
        """Bytes left under the bound (negative when a smaller bound was given)."""
        with self._lock:
            return self.bound - self.used - self._reserved


def _parse_name(name: str) -> BlockId | None:
    if not name.endswith(_SUFFIX):
        return None
    parts = name[: -len(_SUFFIX)].split("-")
    if len(parts) != 3 or not parts[2].isdigit():
        return None
    return parts[0], parts[1], int(parts[2])


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
