"""Which of one rank's batches a stream covers, and planning them without holding the loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from croupier.protocol.epoch_plan import BatchRangeError, EpochPlan

#: Batches this large are planned in the executor (with their index lists), off the loop.
OFFLOAD_BATCH_SIZE = 4096


@dataclass(frozen=True)
class StreamRange:
    """Which of one rank's batches a stream covers."""

    rank: int
    start_batch: int
    end_batch: int

    @classmethod
    def of(cls, plan: EpochPlan, rank: int, start_batch: int = 0, end_batch: int = 0) -> "StreamRange":
        plan.check_rank(rank)
        end = plan.num_batches if end_batch == 0 else end_batch
        if not 0 <= start_batch <= plan.num_batches:
            raise BatchRangeError(
                f"start_batch {start_batch} is outside 0..{plan.num_batches} (batches in this epoch)"
            )
        if not start_batch <= end <= plan.num_batches:
            raise BatchRangeError(f"end_batch {end_batch} is outside {start_batch}..{plan.num_batches}")
        return cls(rank, start_batch, end)


def _to_list(a: Any) -> list:
    """ndarray.tolist() in slices, so a worker thread lets go of the GIL between them."""
    step = 1 << 16
    return a.tolist() if len(a) <= step else [v for i in range(0, len(a), step) for v in a[i : i + step].tolist()]


async def plan_batches(plan: EpochPlan, rank: int, start: int, end: int,
                       executor: concurrent.futures.Executor | None) -> AsyncIterator[tuple[int, list[int], list[bool]]]:
    """(batch, indices, padding) of `rank`'s batches start..end, as plain lists.

    Small batches are planned inline (a planner block is at most 64 Ki indices); large
    ones in the executor, one batch per hop, so the loop never waits on them.
    """
    batches = plan.rank_batches(rank, start, end)
    if plan.batch_size < OFFLOAD_BATCH_SIZE:
        for rb in batches:
            yield rb.batch, rb.indices.tolist(), rb.padding.tolist()
        return
    loop = asyncio.get_running_loop()

    def plan_next() -> tuple[int, list[int], list[bool]] | None:
        rb = next(batches, None)
        return None if rb is None else (rb.batch, _to_list(rb.indices), _to_list(rb.padding))

    while (item := await loop.run_in_executor(executor, plan_next)) is not None:
        yield item
