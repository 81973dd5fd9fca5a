"""The memory tier: blocks held as bytes, admitted while the budget has room, then kept.

A pinned subset, not an LRU: with a uniform shuffle every sample is wanted once an epoch,
so any set of cached blocks gives the same hit ratio (the cached share), and an LRU would
only trade blocks in and out, a refill from storage for every eviction. Blocks leave only
when no open dataset reads their file any more, or when their file changed.
"""

from __future__ import annotations

import threading


class MemoryTier:
    """Blocks by (file version id, block number), within `budget` bytes. Lookups run on the
    event loop without a lock (a dict read); admissions come from fill threads and the
    loop, under a lock that guards the byte count."""

    def __init__(self, budget: int):
        self.budget = budget
        self._blocks: dict[tuple[str, int], bytes] = {}
        self._of: dict[str, set[int]] = {}  # version id -> its blocks held
        self._lock = threading.Lock()
        self._reserved = 0  # bytes promised to reads in flight, counted as used
        self.resident = 0
        self.filled = 0  # bytes admitted, ever
        self.evictions = 0  # blocks dropped, ever

    def get(self, vid: str, block: int) -> bytes | None:
        return self._blocks.get((vid, block))

    def has(self, vid: str, block: int) -> bool:
        return (vid, block) in self._blocks

    def reserve(self, nbytes: int) -> bool:
        """Room for `nbytes` more, held until `admit` or `cancel`; False once full."""
        with self._lock:
            if self.resident + self._reserved + nbytes > self.budget:
                return False
            self._reserved += nbytes
            return True

    def cancel(self, nbytes: int) -> None:
        with self._lock:
            self._reserved -= nbytes

    def admit(self, vid: str, block: int, data: bytes, reserved: int) -> None:
        """Keep `data` as block `block` of `vid`, in the room `reserve(reserved)` held."""
        with self._lock:
            self._reserved -= reserved
            if (vid, block) in self._blocks:
                return
            self._blocks[(vid, block)] = data
            self._of.setdefault(vid, set()).add(block)
            self.resident += len(data)
            self.filled += len(data)

    def try_admit(self, vid: str, block: int, data: bytes) -> bool:
        """Reserve and admit at once, under one lock (a block a direct read fetched whole, an
        image): False if it is held already or the budget has no room."""
        n = len(data)
        with self._lock:
            if (vid, block) in self._blocks or self.resident + self._reserved + n > self.budget:
                return False
            self._blocks[(vid, block)] = data
            self._of.setdefault(vid, set()).add(block)
            self.resident += n
            self.filled += n
            return True

    def drop(self, vid: str) -> int:
        """Evict every block of `vid`; how many there were."""
        with self._lock:
            blocks = self._of.pop(vid, set())
            for b in blocks:
                self.resident -= len(self._blocks.pop((vid, b)))
            self.evictions += len(blocks)
            return len(blocks)

    def held(self, vid: str) -> int:
        return len(self._of.get(vid, ()))

    @property
    def free(self) -> int:
        with self._lock:
            return max(0, self.budget - self.resident - self._reserved)
