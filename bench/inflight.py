"""A closed loop of operations on the running event loop: `in_flight` at once, a new one as
each lands, until `total` have landed (the micro-benchmarks' driver)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

#: start(landed) begins one operation; it calls landed(None) when done, landed(error) if it failed.
Start = Callable[[Callable[[BaseException | None], None]], None]


async def keep_in_flight(start: Start, total: int, in_flight: int) -> float:
    """Seconds until `total` operations have landed, `in_flight` kept going; the first error raises."""
    finished = asyncio.get_running_loop().create_future()
    state = {"issued": 0, "done": 0}

    def landed(err: BaseException | None) -> None:
        if err is not None:
            if not finished.done():
                finished.set_exception(err)
            return
        state["done"] += 1
        issue()
        if state["done"] == total and not finished.done():
            finished.set_result(None)

    def issue() -> None:
        if state["issued"] < total:
            state["issued"] += 1
            start(landed)

    t0 = time.perf_counter()
    for _ in range(min(in_flight, total)):
        issue()
    if total > 0:
        await finished
    return time.perf_counter() - t0
