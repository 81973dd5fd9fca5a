"""Injected storage latency: a wrapper that makes any reader behave like network storage.

Each read first waits a delay drawn from a stated distribution, then does the inner
read. Benchmarks apply the same wrapper (same distribution, same seed) to every system
they compare, so a local disk stands in for remote storage fairly.

Distributions (median m milliseconds):
  * "fixed": exactly m.
  * "uniform": uniform on [0, 2m].
  * "lognormal": exp(N(ln m, sigma^2)); median m, mean m * exp(sigma^2 / 2), a long tail
    like object-store latencies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .base import DatasetInfo, Payload, Reader

DISTRIBUTIONS = ("fixed", "uniform", "lognormal")


#: Injected delays end on the nearest tick of the loop's clock, so that reads due within
#: the same millisecond complete in one loop wake-up (rounding to the nearest tick leaves
#: the mean delay unchanged).
TICK_S = 0.001


def on_tick(when: float) -> float:
    """`when` (loop time) rounded to the nearest tick."""
    return round(when / TICK_S) * TICK_S


async def wait(delay: float) -> None:
    """Sleep `delay` seconds, waking on the nearest tick (the scheduler's timer wheel, for
    reads without I/O, does the same)."""
    now = asyncio.get_running_loop().time()
    await asyncio.sleep(max(on_tick(now + delay) - now, 0))


class LatencySampler:
    """Seeded draws of read delays in seconds, in blocks (one numpy call per 4096 reads)."""

    def __init__(self, distribution: str = "lognormal", median_ms: float = 5.0, sigma: float = 0.5, seed: int = 0):
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"latency distribution {distribution!r} is not one of {DISTRIBUTIONS}")
        if median_ms < 0 or sigma < 0:
            raise ValueError(f"latency median_ms ({median_ms}) and sigma ({sigma}) must not be negative")
        self.distribution = distribution
        self.median_s = median_ms / 1000
        self.sigma = sigma
        self.rng = np.random.default_rng(seed)
        self._block: list[float] = []

    def _draw(self, n: int) -> np.ndarray:
        if self.distribution == "fixed" or self.median_s == 0:
            return np.full(n, self.median_s)
        if self.distribution == "uniform":
            return self.rng.uniform(0, 2 * self.median_s, n)
        return self.rng.lognormal(math.log(self.median_s), self.sigma, n)

    def __call__(self) -> float:
        if not self._block:
            self._block = self._draw(4096).tolist()
        return self._block.pop()

    def mean_s(self) -> float:
        if self.distribution == "lognormal":
            return self.median_s * math.exp(self.sigma**2 / 2)
        return self.median_s


class LatencyInjected(Reader):
    """`inner` with a simulated storage delay awaited before every read.

    The delay of each read is drawn, in call order, from a numpy RNG seeded with `seed`:
    "fixed" waits `median_ms`; "uniform" is uniform on [0, 2 * median_ms]; "lognormal"
    is exp(N(ln median_ms, sigma^2)) ms (median `median_ms`, mean
    median_ms * exp(sigma^2 / 2)). `overrides` maps a global index to a fixed delay in
    seconds for every read of it (to make one read slow on purpose). Everything else
    (len, info, encode, close) is the inner reader's.
    """

    read_does_io = True

    def __init__(
        self,
        inner: Reader,
        *,
        distribution: str = "lognormal",
        median_ms: float,
        sigma: float = 0.5,
        seed: int = 0,
        overrides: dict[int, float] | None = None,
    ):
        super().__init__(inner.name, inner.path, inner.executor, inner.store)
        self.inner = inner
        self.format = inner.format  # type: ignore[misc]
        self.sampler = LatencySampler(distribution, median_ms, sigma, seed)
        self.overrides = dict(overrides or {})

    def bind_executor(self, executor: concurrent.futures.Executor) -> None:
        super().bind_executor(executor)
        self.inner.bind_executor(executor)

    def __len__(self) -> int:
        return len(self.inner)

    def info(self) -> DatasetInfo:
        return self.inner.info()

    async def read(self, index: int, columns: Sequence[str] = ()) -> Any:
        delay = self.overrides.get(index)
        await wait(self.sampler() if delay is None else delay)
        return await self.inner.read(index, columns)

    def read_later(self, index: int) -> tuple[float, Callable[[int], Any]] | None:
        # Over a reader without I/O (memory-mapped Arrow) a read is just the delay:
        # let the scheduler use a timer instead of a task per sample.
        if self.inner.read_does_io:
            return None
        delay = self.overrides.get(index)
        return (self.sampler() if delay is None else delay), self.inner.read_now

    def item_sizer(self, columns: Sequence[str] = ()) -> Callable[[Any], int]:
        return self.inner.item_sizer(columns)

    def encode(self, items: Sequence[Any], columns: Sequence[str] = (), decode_images: bool = False) -> Payload:
        return self.inner.encode(items, columns, decode_images)

    def encodes_on_loop(self, decode_images: bool, nbytes: int) -> bool:
        return self.inner.encodes_on_loop(decode_images, nbytes)

    def close(self) -> None:
        self.inner.close()
