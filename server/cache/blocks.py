"""What the cache keys on: a file's identity, and fixed-size blocks of it.

A file is known by the real path the dataset's confined store opened (so two datasets
reading one file share its blocks, and a dataset can never be served a file its own reads
could not reach), its size and its modification time: a file rewritten or replaced has
another identity, so its old blocks never match it. An object (s3://) is known by its URL,
size and ETag, which the store gives for every version it holds.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

#: Bytes per block. Through a FUSE mount at 5 ms (latencyfs, kernel defaults) one
#: sequential pread of 1 MiB took 20 ms (8 requests of 128 KiB), 4 MiB 104 ms: the cost
#: is linear past 256 KiB, so a larger block buys no speed and costs finer-grained hits
#: during a fill and more waste at the ends of files (README.md, "Block size").
BLOCK_BYTES = 1 << 20


@dataclass(frozen=True, init=False)
class FileKey:
    """One version of one file: its real path, size and mtime (ns); of an object: its
    URL, size and ETag (mtime_ns 0)."""

    real_path: str
    size: int
    mtime_ns: int
    etag: str = ""

    @classmethod
    def of_fd(cls, fd: int) -> "FileKey":
        """The identity of open file `fd`, by the kernel's name for it (/proc/self/fd)."""
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # no /proc: the caller's path was checked by its confined open
            real = f"fd:{os.fstat(fd).st_ino}"
        st = os.fstat(fd)
        return cls(real, st.st_size, st.st_mtime_ns)

    @classmethod
    def of_object(cls, url: str, size: int, etag: str) -> "FileKey":
        """An object's version: its URL, size and ETag (a rewritten object has another ETag)."""
        return cls(url, size, 0, etag)

    def __init__(self, real_path: str, size: int, mtime_ns: int, etag: str = ""):
        # Written to __dict__, past the frozen class's setattr, and both names hashed once,
        # here (every key is registered, which needs both): plain attributes, read without a
        # descriptor, a lock or a hash at each lookup. One hash object: the version's name
        # hashes the path's bytes and then its tail (the same digest as of both at once). A
        # key is made for every image the cache keeps, on the event loop: the dataclass's own
        # __init__ and two hashes made it 4.8 us of an image's loop time in the server.
        d = self.__dict__
        d["real_path"], d["size"], d["mtime_ns"], d["etag"] = real_path, size, mtime_ns, etag
        h = hashlib.sha256(real_path.encode("utf-8", "surrogateescape"))
        d["path_id"] = h.hexdigest()[:24]
        h.update((f"\0{size}\0{mtime_ns}" + (f"\0{etag}" if etag else "")).encode("utf-8", "surrogateescape"))
        d["version_id"] = h.hexdigest()[:24]

    #: A name for the path alone: every version of the file shares it.
    path_id: str = field(init=False, repr=False, compare=False)
    #: A name for this version (path, size, mtime, and the ETag of an object).
    version_id: str = field(init=False, repr=False, compare=False)

    def blocks(self) -> int:
        return (self.size + BLOCK_BYTES - 1) // BLOCK_BYTES

    def block_length(self, block: int) -> int:
        return max(0, min(BLOCK_BYTES, self.size - block * BLOCK_BYTES))


def span(offset: int, size: int) -> range:
    """The blocks holding bytes [offset, offset + size)."""
    if size <= 0:
        return range(offset // BLOCK_BYTES, offset // BLOCK_BYTES)
    return range(offset // BLOCK_BYTES, (offset + size - 1) // BLOCK_BYTES + 1)


def pieces(offset: int, size: int) -> Iterator[tuple[int, int, int]]:
    """(block, start inside it, length) for each block [offset, offset + size) touches."""
    end = offset + size
    while offset < end:
        block, start = divmod(offset, BLOCK_BYTES)
        length = min(BLOCK_BYTES - start, end - offset)
        yield block, start, length
        offset += length
