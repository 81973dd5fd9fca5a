"""Round-robin turns at a shared resource between clients, not between streams.

The encode executor is where a stream's CPU work queues: first come, first served,
a client with 256 streams got 256 turns for another client's one (a 4,000-row epoch
went from 0.24 s to 26 s beside 256 never-read streams). With `FairShare`, each
client identity (a lane) waits its turn in rotation, so two clients get about half
each however many streams either holds. Event-loop only; no locks.
"""

from __future__ import annotations

import asyncio
import collections


class FairShare:
    """`slots` turns at once; when all are taken, waiting lanes are served in rotation."""

    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError(f"a fair share needs at least 1 slot, got {slots}")
        self.slots = slots
        self.free = slots
        self._queues: dict[str, collections.deque[asyncio.Future[None]]] = {}
        self._order: collections.deque[str] = collections.deque()  # lanes with waiters, next first

    async def acquire(self, lane: str) -> None:
        if self.free > 0 and not self._order:
            self.free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        queue = self._queues.get(lane)
        if queue is None:
            queue = self._queues[lane] = collections.deque()
            self._order.append(lane)
        queue.append(fut)
        try:
            await fut  # release() handed this waiter its turn
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the turn arrived as we were cancelled: pass it on
            raise

    def release(self) -> None:
        while self._order:
            lane = self._order.popleft()
            queue = self._queues[lane]
            fut = queue.popleft()
            if queue:
                self._order.append(lane)  # back of the rotation
            else:
                del self._queues[lane]
            if not fut.done():  # a cancelled waiter is skipped
                fut.set_result(None)
                return
        self.free += 1
