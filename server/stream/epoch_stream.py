"""One call sets up a rank's stream of an epoch: `open_epoch_stream(reader, options, streams)`.

The service (server/service/servicer.py) translates a request into this call, and the
stream's chunks into messages. Everything between is here: the epoch's plan, the
stream's range of batches, its dealer with the budgets every stream of the server
shares, a shared epoch or its own reads, and its tuner.

Nothing here knows about gRPC.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from croupier.protocol.epoch_plan import EpochPlan
from croupier.protocol.options import StreamOptions
from croupier.server.readers.base import DatasetInfo, Reader, UnknownColumnError
from croupier.server.stream.budgets import BufferBudget, FairShare, ReadBudget
from croupier.server.stream.dealer import Dealer
from croupier.server.stream.fetch_limits import FetchLimits
from croupier.server.stream.rank_batches import StreamRange
from croupier.server.stream.read_observer import FetchObserver, NoObserver
from croupier.server.stream.sample_chunks import SampleChunk
from croupier.server.stream.shared_epochs import DEFAULT_WINDOW_BYTES, SharedEpochs
from croupier.server.stream.tuner import Autotuner, StreamTuner, job_key


@dataclass
class ServerStreams:
    """What every stream of one server shares: built once, at start."""

    limits: FetchLimits
    executor: concurrent.futures.Executor
    #: Reads in flight over all streams (`--max-reads`).
    server_reads: ReadBudget
    #: Encode turns, taken by client (a stream's `lane`), not by stream.
    fair: FairShare
    observer: FetchObserver
    #: Completed-but-unsent bytes over all streams (None: no total, `--max-buffered-total-mb` 0).
    server_buffer: BufferBudget | None = None
    #: The server's gRPC send limit: chunks are split to stay under it.
    max_message_bytes: int | None = None
    #: Per-stream tuning of reads in flight, prefetch, chunks (None: --no-autotune).
    autotuner: Autotuner | None = None
    #: Streams of the same rank of the same epoch share reads (server/stream/shared_epochs.py).
    shared: SharedEpochs | None = None

    @classmethod
    def build(
        cls,
        limits: FetchLimits,
        *,
        max_reads: int,
        executor: concurrent.futures.Executor,
        observer: FetchObserver | None = None,
        max_total_buffered_bytes: int = 0,
        max_message_bytes: int | None = None,
        shared_epochs: bool = True,
        shared_window_bytes: int = DEFAULT_WINDOW_BYTES,
        autotuner: Autotuner | None = None,
    ) -> "ServerStreams":
        """The budgets from the server's settings; a bad setting raises ValueError naming it."""
        server_buffer = BufferBudget(max_total_buffered_bytes) if max_total_buffered_bytes else None
        # Encode turns by client: as many as the executor has threads.
        fair = FairShare(getattr(executor, "_max_workers", 4))
        server_reads = ReadBudget(max_reads)
        shared = SharedEpochs(
            window_bytes=shared_window_bytes, limits=limits, server_reads=server_reads,
            server_buffer=server_buffer, executor=executor, observer=observer, autotuner=autotuner,
        ) if shared_epochs else None
        return cls(limits, executor, server_reads, fair, observer or NoObserver(), server_buffer,
                   max_message_bytes, autotuner, shared)


class EpochStream:
    """One rank's stream of one epoch, set up and not yet read: the plan and range its
    header describes, and its chunks. Iterate it once; `aclose()` (always: it ends the
    stream's reads and its tuner) may come at any point."""

    def __init__(self, reader: Reader, plan: EpochPlan, span: StreamRange,
                 chunks: AsyncIterator[SampleChunk], tuner: StreamTuner | None):
        self.reader = reader
        self.plan = plan
        self.span = span
        self.tuner = tuner
        self._chunks = chunks

    def __aiter__(self) -> AsyncIterator[SampleChunk]:
        return self._chunks

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()
        finally:
            if self.tuner is not None:
                self.tuner.close()


def check_columns(info: DatasetInfo, columns: Sequence[str]) -> None:
    """Refuse unknown columns before the stream starts, not at its first chunk."""
    if not columns:
        return
    if info.kind != "table":
        raise UnknownColumnError(f"{info.kind} dataset {info.name!r} has no columns to select")
    names = [c.name for c in info.columns]
    missing = [c for c in columns if c not in names]
    if missing:
        raise UnknownColumnError(f"dataset {info.name!r} has no column {missing[0]!r}; columns: {names}")


def open_epoch_stream(reader: Reader, options: StreamOptions, streams: ServerStreams, *,
                      lane: str = "", name: str = "") -> EpochStream:
    """The stream `options` asks for, of the dataset `reader` reads.

    `lane` is the client it takes encode turns as; `name` names it in the tuner's log.
    Raises before any read: PlanError (the plan's parameters), BatchRangeError (the
    rank or the batch range), UnknownColumnError, BatchSizeLimitError (over the
    server's max_batch_size).
    """
    plan = EpochPlan(
        num_rows=len(reader),
        seed=options.seed,
        epoch=options.epoch,
        batch_size=options.batch_size,
        world_size=options.world_size,
        drop_last=options.drop_last,
        start=options.plan_start,
    )
    span = StreamRange.of(plan, options.rank, options.start_batch, options.end_batch)
    check_columns(reader.info(), options.columns)
    prefetch = options.prefetch or None  # 0: the server's choice
    tuner = None
    if streams.autotuner is not None and not options.ordered:
        tuner = streams.autotuner.stream(batch_size=plan.batch_size, requested_prefetch=prefetch, name=name,
                                         job=job_key(reader.name, plan), epoch=plan.epoch)
        tuner.delivered = span.start_batch * plan.batch_size  # a rank resumed mid-epoch is that far into it
    try:
        dealer = Dealer(
            reader, plan, span, ordered=options.ordered, prefetch=prefetch, columns=options.columns,
            decode_images=options.decode_images, limits=streams.limits, server_reads=streams.server_reads,
            server_buffer=streams.server_buffer, executor=streams.executor, observer=streams.observer,
            max_message_bytes=streams.max_message_bytes, fair=streams.fair, lane=lane, tuner=tuner,
        )
    except BaseException:
        if tuner is not None:
            tuner.close()
        raise
    chunks = aiter(dealer) if streams.shared is None else streams.shared.stream(dealer)
    return EpochStream(reader, plan, span, chunks, tuner)
