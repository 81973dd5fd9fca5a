"""What all streams of a server share: turns at the encoder, read slots, buffered bytes.

`FairShare` is the one hand-off counter: `slots` turns, and when all are taken a
released turn goes straight to a waiter (never back to the pool while one waits), the
waiting lanes served in rotation. `ReadBudget` is the same counter with one lane, so
its waiters are served first come, first served. `BufferBudget` counts bytes against a
limit instead of handing over turns. Event-loop only; no locks.
"""

from __future__ import annotations

import asyncio
import collections


class FairShare:
    """`slots` turns at once; when all are taken, waiting lanes are served in rotation.

    A lane is a client identity, not a stream: the encode executor is where a stream's
    CPU work queues, and first come, first served gave a client with 256 streams 256
    turns for another client's one (a 4,000-row epoch went from 0.24 s to 26 s beside 256
    never-read streams). In rotation, two clients get about half each however many
    streams either holds.
    """

    #: How an error names the counter (the subclass says what it counts).
    _what = "a fair share"

    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError(f"{self._what} needs at least 1 slot, got {slots}")
        self.slots = slots
        self.free = slots
        self._queues: dict[str, collections.deque[asyncio.Future[None]]] = {}
        self._order: collections.deque[str] = collections.deque()  # lanes with waiters, next first

    def try_acquire(self) -> bool:
        """Take a turn if one is free now and nobody waits, without awaiting."""
        if self.free > 0 and not self._order:
            self.free -= 1
            return True
        return False

    async def acquire(self, lane: str = "") -> None:
        """Take a turn, waiting behind the other lanes' waiters in rotation."""
        if self.try_acquire():
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

    def release(self, count: int = 1) -> None:
        """Give `count` turns back: each to the next lane's first waiter, else to the pool."""
        for _ in range(count):
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
                    break
            else:
                self.free += 1


class ReadBudget(FairShare):
    """Reads in flight over all streams of a server: a `FairShare` with one lane, so
    waiters are served first come, first served.

    asyncio.Semaphore would do, but its `acquire` costs several times more on a path
    taken once per sample read.
    """

    _what = "a read budget"

    def __init__(self, limit: int):
        super().__init__(limit)

    @property
    def limit(self) -> int:
        return self.slots

    @property
    def available(self) -> int:
        return self.free

    #: Take a slot if one is free now, without awaiting (the hot path's common case;
    #: an alias, not a wrapper: it runs once per sample read).
    try_take = FairShare.try_acquire

    def try_take_many(self, want: int) -> int:
        """Take up to `want` slots that are free now, if nobody waits, without awaiting:
        how many were taken (0: await `take`). One call for a group of reads."""
        if self._order or self.free <= 0:
            return 0
        got = min(want, self.free)
        self.free -= got
        return got

    async def take(self) -> None:
        """Take a slot, waiting behind earlier waiters."""
        await self.acquire()

    #: Give `count` slots back (an alias too: once per sample read).
    give = FairShare.release


class BufferBudget:
    """Completed-but-unsent bytes over all streams of a server, against one limit.

    Streams add what their reads complete (to `used`, directly: once per read) and
    release what they send; a stream that waits for room registers its wake-up event,
    set once the total is back under the limit.
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"a buffer budget needs at least 1 byte, got {limit}")
        self.limit = limit
        self.used = 0
        self._waiters: set[asyncio.Event] = set()

    def release(self, nbytes: int) -> None:
        self.used -= nbytes
        if self._waiters and self.used <= self.limit:
            waiters, self._waiters = self._waiters, set()
            for event in waiters:
                event.set()

    def wait_for_room(self, event: asyncio.Event) -> None:
        self._waiters.add(event)

    def forget(self, event: asyncio.Event) -> None:
        self._waiters.discard(event)
