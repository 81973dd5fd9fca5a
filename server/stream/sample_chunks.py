"""What a stream hands to the service: samples grouped into chunks, each sample tagged
with where it goes; and the chunk being filled before it is encoded."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from croupier.server.readers.base import Payload
from croupier.server.stream.fetch_limits import FetchLimits


class SampleRef(NamedTuple):
    """Where a sample goes: (batch, position in batch) of this rank, and its global index."""

    batch: int
    position: int
    index: int
    padding: bool = False


@dataclass
class SampleChunk:
    """Encoded samples, in the order of `refs`: one message of a stream (the service
    turns it into a `croupier.v1.Chunk`)."""

    refs: list[SampleRef]
    payload: Payload
    # Batches whose every sample has been sent once this chunk is.
    completed_batches: list[int] = field(default_factory=list)


class PendingChunk:
    """Completed samples waiting to be flushed as one chunk."""

    def __init__(self) -> None:
        self.refs: list[SampleRef] = []
        self.items: list[Any] = []
        self.nbytes = 0
        self.completed: list[int] = []
        #: The oldest batch not yet whole became whole: the trainer waits on it, send now.
        self.urgent = False
        self.deadline = 0.0

    def add(self, ref: SampleRef, item: Any, nbytes: int, flush_delay_s: float) -> None:
        if not self.refs:
            self.deadline = time.monotonic() + flush_delay_s
        self.refs.append(ref)
        self.items.append(item)
        self.nbytes += nbytes

    def take(self, arrivals: list, t: int, limits: FetchLimits) -> int:
        """`add` arrivals[t], arrivals[t + 1], ... ((ref, item, nbytes, error) each) until
        the chunk is at its size limits or they run out: the index of the first not taken. The first
        error met is raised, the arrivals before it taken. One call per run of samples, not
        two per sample (the shared epoch's subscribers take every sample this way)."""
        refs, items = self.refs, self.items
        if not refs and t < len(arrivals):
            self.deadline = time.monotonic() + limits.flush_delay_s
        most_samples, most_bytes = limits.chunk_samples, limits.chunk_bytes
        nbytes, n = self.nbytes, len(arrivals)
        try:
            while t < n:
                ref, item, size, err = arrivals[t]
                if err is not None:
                    raise err
                t += 1
                refs.append(ref)
                items.append(item)
                nbytes += size
                if len(refs) >= most_samples or nbytes >= most_bytes:
                    break
        finally:
            self.nbytes = nbytes
        return t

    def full(self, limits: FetchLimits) -> bool:
        """Due now: at its size limits, or urgent."""
        return self.at_limits(limits) or self.urgent

    def at_limits(self, limits: FetchLimits) -> bool:
        """No room for another sample. Urgent is not full: batches that have wholly arrived
        by the time an urgent chunk is sent ride along in it, up to the size limits, not in
        messages of their own (a message costs the loop about 100 us in grpc's write, whatever
        its size; at batch 16 a batch completed while the last was written, and each went
        alone). A batch only partly arrived does not: split over more messages, it costs the
        client more to put together (batch 256: 2-15% fewer samples/s in three alternated pairs)."""
        return len(self.refs) >= limits.chunk_samples or self.nbytes >= limits.chunk_bytes
