"""Small files read whole on the event loop where nothing would wait (issue 21 item 4).

On the native pool a group of images costs, per file, a thread woken, a hand-back through
the eventfd and its share of a drain. Where the files sit on a local disk and the page
cache holds them, `native.files_nowait` reads them on the loop for a few syscalls each,
and nothing there can block the loop: the open resolves only names already in the
kernel's lookup cache (openat2 RESOLVE_CACHED), beneath the dataset's folder and on its
mount (RESOLVE_BENEATH, RESOLVE_NO_XDEV: never another file system's open, a FUSE
daemon's say), and reads only pages already cached (preadv2 RWF_NOWAIT). A file that is
not, and any file that fails, goes to the pool as before, which names the error. Only
folders on a local file system (readpath.LOCAL_FILE_SYSTEMS) are asked; a kernel or file
system that does not take these flags is not asked again; and after a group none of whose
files were cached (a cold disk) the next groups go straight to the pool, a run that
doubles up to BACKOFF_MAX groups, so a cold disk pays the failed tries on few groups.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from . import native, readpath

log = logging.getLogger("croupier.storage")

#: Larger files go to the pool: copying megabytes would hold the loop.
MAX_FILE_BYTES = 256 << 10
#: Groups sent straight to the pool after one with nothing cached: doubling, at most this.
BACKOFF_MAX = 64


class InlineFiles:
    """The loop's reads of small cached files under a dataset's roots (the folders are
    opened on the first group, kept open until `close`)."""

    def __init__(self, roots: Sequence[str], enabled: bool = True):
        self._roots = tuple(roots)
        self._folders: dict[str, int] | None = None  # "root/" -> an O_PATH descriptor, local roots only
        self._skip = 0  # groups to send to the pool without trying
        self._backoff = 1
        self.off = not enabled or native.files_nowait is None

    def _open_folders(self) -> dict[str, int]:
        folders: dict[str, int] = {}
        for root in self._roots:
            try:
                fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                local = readpath.mount_of(os.fstat(fd).st_dev, root).is_local
            except OSError:
                local = False
            if local:
                folders[root.rstrip("/") + "/"] = fd
            else:
                os.close(fd)
        return folders

    def read_now(self, paths: Sequence[str], kind: int, roots: bytes | None) -> tuple[list, list[int], int] | None:
        """The files of `paths` read now where they can be: ([(position, value, None)] with
        the pool's values, the positions of the rest, the bytes read); None where the group
        is not tried."""
        if self.off or not paths:
            return None
        if self._skip > 0:
            self._skip -= 1
            return None
        if self._folders is None:
            self._folders = self._open_folders()
            if not self._folders:
                self.off = True
                return None
        prefix = next((p for p in self._folders if paths[0].startswith(p)), None)
        if prefix is None:
            return None
        try:
            got = native.files_nowait(self._folders[prefix], os.fsencode(prefix), paths, kind, roots,  # type: ignore[misc]
                                      MAX_FILE_BYTES)
        except OSError as exc:
            log.info("storage: small files under %s are read on the pool only: %s", prefix, exc)
            self.off = True
            return None
        if got[0]:
            self._backoff = 1
        else:
            self._skip = self._backoff
            self._backoff = min(2 * self._backoff, BACKOFF_MAX)
        return got

    def close(self) -> None:
        for fd in (self._folders or {}).values():
            os.close(fd)
        self._folders = {}
        self.off = True
