"""The knobs of one stream's reads and chunks (server-wide ones live in server/stream/budgets.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FetchLimits:
    """Concurrency and buffering knobs of one stream (server-wide ones live in the service).

    `default_prefetch` is how far ahead reads may go (batches past the oldest one not
    yet sent); `max_reads_per_stream` is how many are in flight at once. A read-ahead
    horizon wider than the in-flight bound keeps the bound busy while a batch waits
    for its slowest read, instead of letting the pipeline drain behind the straggler.
    """

    max_reads_per_stream: int = 256
    max_buffered_bytes: int = 64 << 20
    chunk_samples: int = 64
    #: 1 MiB: well under grpc's default 4 MiB receive limit of clients built from stubs.
    chunk_bytes: int = 1 << 20
    flush_delay_s: float = 0.005
    default_prefetch: int = 16
    #: Largest prefetch a stream gets: larger requests (and defaults) are clamped to it.
    max_prefetch: int = 256
    #: Largest batch_size a stream may ask for (a batch is planned and tracked whole).
    max_batch_size: int = 1 << 18

    def __post_init__(self) -> None:
        for name in ("max_reads_per_stream", "max_buffered_bytes", "chunk_samples", "chunk_bytes", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.flush_delay_s < 0 or self.default_prefetch < 0 or self.max_prefetch < 0:
            raise ValueError("flush_delay_s, default_prefetch and max_prefetch must not be negative")
