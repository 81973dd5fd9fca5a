"""A group of objects read whole by one call (an image folder's group on s3://).

Why: read one by one, an image on S3 cost the server's loop a task and a chain of six
coroutines (the reader's read, the cache's, the store's, its GET's future), about 190-220 us
of CPU an image against 40-70 on a FUSE mount, where a group of images is one storage call
(`Store.submit_files`). Here each object is one GET on the loop (s3http.py) whose answer is
a callback, and the objects landed while the loop was away are handed over by one call on
its next turn. A GET the direct client hands back (an error status, a dropped connection)
is done again through obstore by a task, as `ObjectStore.read` would do it, so an error
names the object the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

Landed = list[tuple[int, Any, BaseException | None]]


class _Landing:
    """Objects landed since the loop last handed any over: (position, bytes, None) or
    (position, None, error), handed to `callback` together on the loop's next turn."""

    __slots__ = ("loop", "stats", "callback", "pending")

    def __init__(self, loop: asyncio.AbstractEventLoop, stats: Any, callback: Callable[[Landed], None]):
        self.loop, self.stats, self.callback = loop, stats, callback
        self.pending: Landed = []

    def land(self, i: int, data: bytes | None, err: BaseException | None) -> None:
        if not self.pending:
            self.loop.call_soon(self.flush)
        self.pending.append((i, data, err))

    def flush(self) -> None:
        done, self.pending = self.pending, []
        bad = sum(err is not None for _, _, err in done)
        if bad < len(done):
            self.stats.finished(sum(len(d) for _, d, err in done if err is None), len(done) - bad)
        if bad:
            self.stats.finished(0, bad, ok=False)
        self.callback(done)


def start_objects(store: Any, paths: Sequence[str], callback: Callable[[Landed], None]) -> None:
    """`paths` of `store` (an ObjectStore with its direct GET client) each read whole by one
    GET on the loop; `callback(done)` once per turn of the loop with the objects landed
    since, each named exactly once over the calls; counted in `store.stats` as one read each."""
    loop = asyncio.get_running_loop()
    landing = _Landing(loop, store.stats, callback)
    store.stats.started(len(paths))
    get, key_of = store.fast.get, store._key
    for i, path in enumerate(paths):
        get(key_of(path), 0, -1, _answered(store, landing, i, path))


def _answered(store: Any, landing: _Landing, i: int, path: str) -> Callable[[bytes | None, str | None], None]:
    def done(body: bytes | None, _reason: str | None) -> None:
        if body is not None:
            landing.land(i, body, None)
            return
        task = landing.loop.create_task(store._obstore_get(path, 0, -1))  # handed back: obstore's retries
        task.add_done_callback(lambda t: _settled(landing, i, t))

    return done


def _settled(landing: _Landing, i: int, task: asyncio.Task) -> None:
    if task.cancelled():
        landing.land(i, None, asyncio.CancelledError())
        return
    exc = task.exception()
    if exc is not None:
        landing.land(i, None, exc)
    else:
        data = task.result()
        landing.land(i, data if type(data) is bytes else bytes(data), None)
