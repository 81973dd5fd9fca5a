"""Online tuning of the Loader's image-decode threads (`decode_workers` left unset).

A small feedback rule, like the server's (server/stream/tuner.py), decided every
DECIDE_EVERY batches from what the Loader measures anyway: how long the trainer
waited for a batch, and how long decoding its samples took.

* Grow by one thread while the trainer waits (over WAIT_GROW of the time) and decoding
  fills most of the Loader's time (over BUSY_GROW): decode is the bottleneck.
* A growth that did not raise the decode rate (samples per decode-second) by
  GAIN is undone, and the count before it becomes the cap (the cores, or the GIL, are
  the limit): more threads would only contend.
* Shrink by one after SHRINK_AFTER periods in a row where the trainer did not wait and
  decoding was mostly idle: threads nobody needs go back.

Pillow releases the GIL while it decodes, so threads scale to about the free cores;
the ceiling is the CPU count.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger("croupier.client")

DECIDE_EVERY = 8
WAIT_GROW = 0.1
BUSY_GROW = 0.5
GAIN = 1.1
WAIT_IDLE = 0.02
BUSY_IDLE = 0.3
SHRINK_AFTER = 3


class DecodeTuner:
    """Decode threads for one Loader; `workers` is the count to use now."""

    def __init__(self, ceiling: int | None = None, start: int = 2, clock: Callable[[], float] = time.perf_counter):
        self.ceiling = max(1, ceiling if ceiling is not None else (os.cpu_count() or 1))
        self.workers = min(start, self.ceiling)
        self.clock = clock
        self.cap: int | None = None
        self.changes = 0
        self._batches = 0
        self._samples = 0
        self._decode_s = 0.0
        self._waited_s = 0.0
        self._t = clock()
        self._grew_from: tuple[int, float] | None = None  # (workers, decode rate) before growing
        self._idle_votes = 0

    def trainer_waited(self, seconds: float) -> None:
        self._waited_s += seconds

    def batch_done(self, samples: int, decode_s: float) -> None:
        """A batch was decoded (in `decode_s` seconds); decides every DECIDE_EVERY batches."""
        self._batches += 1
        self._samples += samples
        self._decode_s += decode_s
        if self._batches >= DECIDE_EVERY:
            self._decide()

    def _decide(self) -> None:
        now = self.clock()
        elapsed = max(now - self._t, 1e-9)
        wait = self._waited_s / elapsed
        busy = self._decode_s / elapsed
        rate = self._samples / max(self._decode_s, 1e-9)
        self._batches = self._samples = 0
        self._decode_s = self._waited_s = 0.0
        self._t = now
        old = self.workers
        if self._grew_from is not None:
            before, before_rate = self._grew_from
            self._grew_from = None
            if rate < before_rate * GAIN:
                self.cap = before
                self._set(before, f"decode rate {rate:.0f}/s did not rise with {old} threads")
                return
        top = self.ceiling if self.cap is None else self.cap
        if wait > WAIT_GROW and busy > BUSY_GROW and old < top:
            self._idle_votes = 0
            self._grew_from = (old, rate)
            self._set(old + 1, f"trainer waited {100 * wait:.0f}% of the time, decoding {100 * busy:.0f}%")
        elif wait < WAIT_IDLE and busy < BUSY_IDLE and old > 1:
            self._idle_votes += 1
            if self._idle_votes >= SHRINK_AFTER:
                self._idle_votes = 0
                self._set(old - 1, f"decoding busy {100 * busy:.0f}% of the time, trainer never waited")
        else:
            self._idle_votes = 0

    def _set(self, workers: int, why: str) -> None:
        if workers != self.workers:
            log.info("autotune: decode workers %d -> %d (%s)", self.workers, workers, why)
            self.workers = workers
            self.changes += 1
