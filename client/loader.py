"""The trainer-side Loader: `for batch in Loader(...)` or `async for batch in Loader(...)`.

It streams this rank's part of each epoch from a croupier server, rebuilds every batch
by sample position (so it is identical whatever the arrival order), collates it like a
DataLoader, and survives dropped connections and restarted servers: it reconnects with
backoff, to the next server address if several are given, and resumes at the first
batch it has not yet handed out, so no sample is lost or repeated.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from croupier.protocol.epoch_plan import EpochPlan, PlanError
from croupier.protocol.options import StreamOptions
from croupier.protocol.security import ClientSecurity

from croupier.client.assemble import BatchAssembler, ProtocolError, RawBatch
from croupier.client.connection import (FINAL_LIMITS, RETRYABLE, Connection, Resolver, RetryPolicy, Servers, limit_of,
                                        resolve_host, size_limit_advice, transport_hint)
from croupier.client.decode_tuner import DecodeTuner
from croupier.client.device_copy import DeviceCopier
from croupier.client.resume import Cursor, Shape, resume_cursor, state_of
from croupier.client.samples import BatchFormat, ImageDecoding, collate_table, numpy_collate, raw_batch_samples

if TYPE_CHECKING:
    import torch

log = logging.getLogger("croupier.client")


class LoaderError(RuntimeError):
    """The server refused the request, or every retry failed; the message says which and why."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


@dataclass
class Batch:
    """A collated batch with where it came from in the epoch plan."""

    data: Any
    epoch: int
    batch: int
    indices: np.ndarray
    padding: np.ndarray


@dataclass
class LoaderStats:
    batches: int = 0
    samples: int = 0
    bytes: int = 0
    out_of_order: int = 0
    reconnects: int = 0
    #: Seconds the consumer spent blocked waiting for the next batch.
    wait_s: float = 0.0
    first_batch_s: float | None = None
    errors: list[str] = field(default_factory=list)
    #: The address each stream was opened on, in order (a dns:/// name shows its replicas).
    streams: list[str] = field(default_factory=list)


async def _make_semaphore(value: int) -> asyncio.Semaphore:
    return asyncio.Semaphore(value)  # created on the loop that will use it


async def _cancel_all() -> None:
    """Cancel every task of the running loop but this one, and wait for them to finish."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


#: Loaders with a network thread, closed at interpreter exit (before daemon threads die).
_LIVE: "weakref.WeakSet[Loader]" = weakref.WeakSet()


@atexit.register
def _close_live_loaders() -> None:
    for loader in list(_LIVE):
        loader.close()


def _distributed_default() -> tuple[int, int]:
    # Only a process that imported torch can have initialised torch.distributed: the
    # "numpy" format never imports it.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Loader:
    """Batches of one rank's part of a globally shuffled epoch, served by croupier.

    Args:
        dataset: the server's name for the dataset (or a path under its data root).
        servers: "host:port", or several replicas serving the same data; rank r starts
            on servers[r % len] and fails over to the next on errors. "dns:///NAME:PORT"
            stands for every address NAME resolves to (A and AAAA records: the pods of a
            headless Service), resolved again at each epoch's start and before each
            reconnect, so the ranks spread over the replicas there are then.
        batch_size: samples per rank per batch.
        rank, world_size: default to torch.distributed's when initialised, else 0 and 1.
        seed, epoch: the plan is a pure function of (seed, epoch, dataset size).
        drop_last: as DistributedSampler + DataLoader (see croupier.protocol.epoch_plan).
        ordered: ask for the ordered ablation (one read at a time, in plan order).
        prefetch: batches the server reads ahead (0: the server's default; the server
            clamps it to its `--max-prefetch`).
        columns: table columns to fetch (default all).
        format: "torch" (default: tensors, images uint8 CHW) or "numpy": dicts of NumPy
            arrays (images uint8 HWC, stacked [B, H, W, C]), collated by
            `numpy_collate`, and torch is never imported (pin_memory and device are torch's).
        collate_fn: list of samples -> batch; None: `torch.utils.data.default_collate`,
            or `numpy_collate` for format="numpy" (None means the default, as in a DataLoader).
        transform: applied to every sample dict before collation.
        pin_memory, device: where batches go. device="cuda" (or "cuda:i"): each batch is
            pinned and copied with non-blocking copies on a side stream in the Loader's
            thread, so batch n+1's copy overlaps the compute on batch n; the consumer's
            current stream waits for it on the GPU as the batch is handed out
            (`client/device_copy.py`). Without CUDA it raises `NoCudaError` at once.
            pin_memory alone: batches pinned in host memory, for your own copy.
        in_order: yield batches in batch order (default); False yields a later batch
            first when it completes first (resume still loses and repeats nothing).
        buffer_batches: collated batches the sync iterator keeps ready ahead of the user.
        decoding: what images become, and where and in how many threads they are decoded
            (`ImageDecoding`; default: uint8 CHW tensors, decoded here, threads tuned).
        retry: how often and how patiently a failed stream is retried (`RetryPolicy`;
            default: 10 failures in a row, backoff from 0.1 s doubling up to 5 s). A
            message over a size limit is not retried (the LoaderError names the limit).
        security: TLS and bearer token (`ClientSecurity.resolve(tls_ca=..., token=...)`,
            which fills what it is not given from CROUPIER_TLS_CA, CROUPIER_CLIENT_CERT,
            CROUPIER_CLIENT_KEY, CROUPIER_TOKEN, CROUPIER_TLS). Default: from the
            environment alone. A token goes in clear text only to loopback addresses.
        resolve: (host, port) -> the "HOST:PORT" addresses of a dns:/// name (default:
            getaddrinfo, `client.connection.resolve_host`).
        channel_options: extra gRPC channel arguments, e.g. `[("grpc.http2.bdp_probe", 0)]`
            to keep each stream's flow-control window at 64 KiB; they replace croupier's
            own of the same name (client/connection.py CHANNEL_OPTIONS).
    """

    def __init__(
        self,
        dataset: str,
        *,
        batch_size: int,
        servers: str | Sequence[str] = "127.0.0.1:50051",
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        epoch: int = 0,
        drop_last: bool = False,
        ordered: bool = False,
        prefetch: int = 0,
        columns: Sequence[str] = (),
        format: BatchFormat = "torch",
        collate_fn: Callable[[list[Any]], Any] | None = None,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        pin_memory: bool = False,
        device: "str | torch.device | None" = None,
        in_order: bool = True,
        buffer_batches: int = 4,
        decoding: ImageDecoding = ImageDecoding(),
        retry: RetryPolicy = RetryPolicy(),
        security: ClientSecurity | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        resolve: Resolver = resolve_host,
    ) -> None:
        if rank is None or world_size is None:
            d_rank, d_world = _distributed_default()
            rank = d_rank if rank is None else rank
            world_size = d_world if world_size is None else world_size
        self.servers = Servers(servers, resolve)
        self.channel_options = list(channel_options)
        self.security = security if security is not None else ClientSecurity.resolve()
        for address in self.servers.targets:
            self.security.metadata(address)  # refuses a token bound for clear text, now, not mid-epoch
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of size {world_size}")
        # The stream's shape; the seed and epoch of each stream are the cursor's (_cursor).
        self.options = StreamOptions(
            dataset=dataset, batch_size=batch_size, seed=seed, epoch=epoch, rank=rank, world_size=world_size,
            drop_last=drop_last, ordered=ordered, prefetch=prefetch, columns=tuple(columns),
            decode_images=decoding.on_server,
        )
        self.transform = transform
        self._set_format(format, collate_fn, decoding, pin_memory, device)
        self.in_order = in_order
        self.retry = retry
        self.buffer_batches = max(1, buffer_batches)
        self.stats = LoaderStats()
        #: Where the next batch comes from; moved only on the consumer's side, as batches
        #: are handed out (client/resume.py).
        self._cursor = Cursor(seed, epoch)
        #: Rows of the dataset, once a header or DescribeDataset said (the plan's N).
        self._num_rows: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        #: Sets decode_workers as the Loader runs (None: decoding.workers was given, and is kept).
        self.decode_tuner = DecodeTuner(os.cpu_count() or 1) if decoding.workers is None else None
        self.decode_workers = self.decode_tuner.workers if self.decode_tuner is not None else decoding.workers
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _set_format(self, format: BatchFormat, collate_fn: Callable[[list[Any]], Any] | None,
                    decoding: ImageDecoding, pin_memory: bool, device: "str | torch.device | None") -> None:
        """What batches are made of: torch tensors (torch imported only for these) or NumPy arrays."""
        self.format = format
        if format == "numpy":
            if pin_memory or device is not None:
                raise ValueError("pin_memory and device move torch tensors: a Loader with format='numpy' takes "
                                 "neither (put its arrays on an accelerator with your framework, e.g. "
                                 "jax.device_put)")
            self.collate_fn = collate_fn or numpy_collate
            self._default_collate = collate_fn is None or collate_fn is numpy_collate
            self.decoding = replace(decoding, output="numpy") if decoding.output == "tensor" else decoding
            self._copier = None
            self.pin_memory, self.device = False, None
        elif format == "torch":
            import torch
            from torch.utils.data import default_collate

            self.collate_fn = collate_fn or default_collate
            self._default_collate = collate_fn is None or collate_fn is default_collate
            self.decoding = decoding
            copier = DeviceCopier(device, pin_memory)
            self._copier = copier if copier.active else None
            self.pin_memory, self.device = copier.pin_memory, copier.device
        else:
            raise ValueError(f"format must be 'torch' or 'numpy', got {format!r}")

    # ---- epoch and resume state -------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._cursor.epoch

    @property
    def rank(self) -> int:
        return self.options.rank

    @property
    def world_size(self) -> int:
        return self.options.world_size

    @property
    def _shape(self) -> Shape:
        o = self.options
        return Shape(o.rank, o.world_size, o.batch_size, o.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Pin the epoch of the next pass, as `DistributedSampler.set_epoch` does.

        Another epoch than the Loader's starts at its first batch; the Loader's own epoch
        keeps its place (so a loop that calls set_epoch after load_state_dict resumes), and
        a finished epoch named again is dealt again from its start."""
        if epoch != self._cursor.epoch or self._finished():
            self._cursor = Cursor(self._cursor.seed, epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where this rank stands, in a few integers: seed, epoch, `position` (where in the
        epoch's permutation the ranks stand together), `step` (batches handed out of this
        epoch's plan), `next_batch` and `batches_ahead` (in_order=False), the plan's start
        (after an elastic resume) and the shape. After the last batch of an epoch it still
        names that epoch, with next_batch == its batches: the next pass (here, or of a
        Loader that loads it) starts the next epoch."""
        return state_of(self._cursor, self.options.dataset, self._shape, self._num_rows)

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Resume from a state saved by any rank of any shape, or from every rank's states.

        At this Loader's own shape, its rank's state resumes exactly; another rank's state
        resumes at the step all ranks reached. At another world size, batch size or
        drop_last, the samples of the epoch that no old rank delivered are cut anew into
        this shape's batches (numbered from 0); the next epoch is a whole one. States
        handed out ahead (in_order=False) or of ranks at different steps: see
        client/resume.py; the ResumeError (a ValueError) names the ranks and steps."""
        states = [state] if isinstance(state, Mapping) else list(state)
        cursor = resume_cursor(states, self.options.dataset, self._shape)
        num_rows = states[0].get("num_rows")
        if num_rows is not None:
            self._num_rows = int(num_rows)
        self._cursor = cursor

    def _rows(self) -> int:
        """The dataset's rows: from a header seen, else asked of the first replica that answers."""
        if self._num_rows is not None:
            return self._num_rows

        async def rows() -> int:
            errors = []
            try:
                addresses = await asyncio.to_thread(self.servers.refresh)
            except OSError as exc:
                raise LoaderError(f"{', '.join(self.servers.targets)}: {exc}", grpc.StatusCode.UNAVAILABLE) from None
            for k in range(len(addresses)):  # starting with this rank's own replica
                address = addresses[(self.rank + k) % len(addresses)]
                conn = self._connect(address)
                try:
                    return (await conn.describe(self.options.dataset)).num_rows
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in RETRYABLE:
                        raise LoaderError(f"{address}: {exc.code().name}: {exc.details()}", exc.code()) from None
                    errors.append(f"{address}: {exc.code().name}: {exc.details()}"
                                  f"{transport_hint(self.security, exc.details() or '')}")
                finally:
                    await conn.close()
            raise LoaderError(f"no server answered for dataset {self.options.dataset!r}: {errors}",
                              grpc.StatusCode.UNAVAILABLE)

        self._num_rows = asyncio.run_coroutine_threadsafe(rows(), self._network_loop()).result(60)
        return self._num_rows

    def _plan(self) -> EpochPlan:
        """The plan of the cursor's epoch (asks the server for the dataset size once)."""
        o, c = self.options, self._cursor
        try:
            return EpochPlan(self._rows(), c.seed, c.epoch, o.batch_size, o.world_size, o.drop_last, c.start)
        except PlanError as exc:  # what the server answers a stream of this plan
            raise LoaderError(f"INVALID_ARGUMENT: {exc}", grpc.StatusCode.INVALID_ARGUMENT) from None

    def _finished(self) -> bool:
        """This epoch's last batch was handed out: the next pass starts the next epoch.
        (Asks nothing of a server while no batch was handed out, from a fresh start.)"""
        c = self._cursor
        return bool(c.next_batch or c.start) and c.next_batch >= self._plan().num_batches

    def __len__(self) -> int:
        """Batches this rank gets in the epoch the next pass yields (after an elastic
        resume, in the rest of that epoch)."""
        if self._finished():
            o, c = self.options, self._cursor
            return EpochPlan(self._rows(), c.seed, c.epoch + 1, o.batch_size, o.world_size, o.drop_last).num_batches
        return self._plan().num_batches

    # ---- producing batches --------------------------------------------------------
    async def _raw_batches(self, cursor: Cursor) -> AsyncIterator[RawBatch]:
        """RawBatches of the cursor's epoch from its next batch, reconnecting as needed."""
        opts = self.options.with_(seed=cursor.seed, epoch=cursor.epoch, plan_start=cursor.start)
        next_batch, ahead = cursor.next_batch, set(cursor.ahead)
        failures, attempt = 0, 0  # the rank's k-th stream goes to addresses[(rank + k) % n]
        addresses: list[str] = []
        num_batches: int | None = None
        while num_batches is None or next_batch < num_batches:
            if not addresses:  # at the epoch's start and after each failure: the names resolved again
                try:
                    addresses = await asyncio.to_thread(self.servers.refresh)
                except OSError as exc:
                    failures += 1
                    await asyncio.sleep(self._retry_delay(f"{', '.join(self.servers.targets)}: {exc}",
                                                          grpc.StatusCode.UNAVAILABLE, None, failures))
                    continue
            address = addresses[(opts.rank + attempt) % len(addresses)]
            conn = self._connect(address)
            self.stats.streams.append(address)
            pending: dict[int, RawBatch] = {}
            try:
                call = conn.stream(opts.with_(start_batch=next_batch))
                assembler: BatchAssembler | None = None
                async for msg in call:
                    if msg.HasField("header"):
                        header = msg.header
                        if num_batches is not None and header.num_batches != num_batches:
                            raise ProtocolError(
                                f"{address} plans {header.num_batches} batches for this epoch, "
                                f"another server planned {num_batches}: are they serving the same data?"
                            )
                        self._check_header(address, header, opts, resumed=next_batch > 0 or bool(ahead))
                        num_batches = header.num_batches
                        assembler = BatchAssembler(header, skip_batches=frozenset(ahead))
                        continue
                    if assembler is None:
                        raise ProtocolError(f"{address} sent a chunk before the stream header")
                    for raw in assembler.add(msg.chunk):
                        failures = 0
                        if self.in_order:
                            pending[raw.batch] = raw
                            while next_batch in pending:
                                next_batch += 1
                                yield pending.pop(next_batch - 1)
                        else:
                            ahead.add(raw.batch)
                            yield raw
                            while next_batch in ahead:
                                ahead.discard(next_batch)
                                next_batch += 1
                    self._account(assembler)
                if assembler is None:
                    raise ProtocolError(f"{address} ended the stream without a header")
                if next_batch < num_batches:
                    raise ProtocolError(f"{address} ended the stream at batch {next_batch} of {num_batches}")
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                advice = size_limit_advice(code, exc.details() or "")
                if advice is not None:  # the same message would break the limit again
                    raise LoaderError(f"{address}: {code.name}: {advice}", code) from None
                limit = limit_of(exc)
                if code not in RETRYABLE or limit in FINAL_LIMITS:
                    raise LoaderError(f"{address}: {code.name}: {exc.details()}", code) from None
                failures += 1
                attempt += 1  # the next replica, in the order the names resolve to then
                addresses = []
                error = f"{address}: {code.name}: {exc.details()}{transport_hint(self.security, exc.details() or '')}"
                await asyncio.sleep(self._retry_delay(error, code, limit, failures))
            finally:
                await conn.close()

    def _connect(self, address: str) -> Connection:
        return Connection(address, self.security,
                          self.servers.channel_options(address, self.security) + self.channel_options)

    def _retry_delay(self, error: str, code: grpc.StatusCode, limit: str | None, failures: int) -> float:
        """Seconds to wait before the retry after the `failures`-th failure in a row, or a
        LoaderError when the retries are spent."""
        self.stats.errors.append(error)
        if failures > self.retry.max_retries:
            raise LoaderError(f"gave up after {self.retry.max_retries} retries; last error from {error}",
                              code) from None
        self.stats.reconnects += 1
        delay = self.retry.delay(failures, limit)
        # Said at once, each time: a trainer pointed at the wrong address learns it
        # in seconds, not when the retries run out.
        log.warning("%s; retry %d of %d in %.1fs", error, failures, self.retry.max_retries, delay)
        return delay

    def _check_header(self, address: str, header: Any, opts: StreamOptions, resumed: bool) -> None:
        """Refuse a stream that would not follow the plan this Loader resumes in."""
        start = opts.plan_start
        if (header.plan_position, tuple(header.plan_delivered)) != (start.position, start.delivered):
            raise LoaderError(
                f"{address} streamed epoch {opts.epoch} from plan position {header.plan_position}, not the "
                f"{start.position} this elastic resume asked for: the server predates elastic resume; upgrade it",
                grpc.StatusCode.FAILED_PRECONDITION)
        rows = header.dataset.num_rows
        if self._num_rows is not None and rows != self._num_rows and (resumed or start):
            raise LoaderError(
                f"{address} serves {opts.dataset!r} with {rows} rows, but this epoch was resumed with "
                f"{self._num_rows}: the permutation depends on the row count, so the resume would lose and "
                "repeat samples; serve the dataset the state was saved with", grpc.StatusCode.FAILED_PRECONDITION)
        self._num_rows = rows

    def _account(self, assembler: BatchAssembler) -> None:
        s = assembler.stats
        self.stats.samples += s.samples
        self.stats.bytes += s.bytes
        self.stats.out_of_order += s.out_of_order
        s.samples = s.bytes = s.out_of_order = 0

    def _collate(self, raw: RawBatch) -> Batch:
        data = None
        if raw.table is not None and self._default_collate and self.transform is None:
            data = collate_table(raw.table, self.format)  # the default collation's result, column-wise
        if data is None:
            t0 = time.perf_counter()
            samples = raw_batch_samples(raw, self.decoding.output, self._decode_pool(), self.format)
            if self.decode_tuner is not None:
                self.decode_tuner.batch_done(len(samples), time.perf_counter() - t0)
            if self.transform is not None:
                samples = [self.transform(s) for s in samples]
            data = self.collate_fn(samples)
        if self._copier is not None:
            data = self._copier.send(data)  # copies issued, not awaited: `_handed_out` orders them
        return Batch(data, raw.epoch, raw.batch, raw.indices, raw.padding)

    def _decode_pool(self) -> concurrent.futures.ThreadPoolExecutor | None:
        """Threads that decode a batch's images in parallel (a DataLoader uses worker processes)."""
        if self.decode_tuner is not None:
            self.decode_workers = self.decode_tuner.workers
        if self.decode_workers <= 1:
            return None
        if self._pool is not None and self._pool._max_workers != self.decode_workers:
            self._pool.shutdown(wait=False)  # resized by the tuner: its tasks are done, threads exit
            self._pool = None
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.decode_workers, thread_name_prefix="croupier-decode")
        return self._pool

    def _start(self) -> Cursor:
        """The cursor a pass starts from: at the end of its epoch, the next epoch's start
        (the epoch advances by itself, as Mosaic's StreamingDataset's does)."""
        c = self._cursor
        if self._finished():
            c.next_epoch()
        return Cursor(c.seed, c.epoch, c.start, c.next_batch, set(c.ahead))

    def _handed_out(self, batch: Batch, t0: float) -> None:
        """Record, on the consumer's side, that the user now holds `batch`."""
        if self._copier is not None:
            batch.data = self._copier.receive(batch.data)  # on the consumer's thread and stream
        self.stats.batches += 1
        if self.stats.first_batch_s is None:
            self.stats.first_batch_s = time.perf_counter() - t0
        self._cursor.handed_out(batch.batch)

    async def abatches(self) -> AsyncIterator[Batch]:
        """Async iteration over `Batch`es (collated data plus plan metadata)."""
        t0 = time.perf_counter()
        gen = self._raw_batches(self._start())
        try:
            while True:
                w = time.perf_counter()
                try:
                    raw = await gen.__anext__()
                except StopAsyncIteration:
                    break
                waited = time.perf_counter() - w
                self.stats.wait_s += waited
                if self.decode_tuner is not None:
                    self.decode_tuner.trainer_waited(waited)
                batch = self._collate(raw)
                self._handed_out(batch, t0)
                yield batch
        finally:
            await gen.aclose()

    def __aiter__(self) -> AsyncIterator[Any]:
        async def data() -> AsyncIterator[Any]:
            async for b in self.abatches():
                yield b.data

        return data()

    def batches(self) -> Iterator[Batch]:
        """Sync iteration over `Batch`es; an event loop in a thread does the network work."""
        t0 = time.perf_counter()
        cursor = self._start()
        loop = self._network_loop()
        q: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        # Free places in the hand-off buffer, counted on the loop's side so that a full
        # buffer suspends the producer instead of blocking the Loader's event loop.
        free = asyncio.run_coroutine_threadsafe(_make_semaphore(self.buffer_batches), loop).result(30)

        async def run() -> None:
            gen = self._raw_batches(cursor)
            try:
                async for raw in gen:
                    await free.acquire()
                    # Collate here, in the network thread: it overlaps the training step.
                    q.put(("batch", self._collate(raw)))
                q.put(("end", None))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # handed to the consumer, which raises it
                q.put(("error", exc))
            finally:
                await gen.aclose()

        future = asyncio.run_coroutine_threadsafe(run(), loop)
        try:
            while True:
                w = time.perf_counter()
                kind, value = q.get()
                waited = time.perf_counter() - w
                self.stats.wait_s += waited
                if self.decode_tuner is not None:
                    self.decode_tuner.trainer_waited(waited)  # a float add, from the trainer's thread
                if kind == "end":
                    return
                if kind == "error":
                    raise value
                loop.call_soon_threadsafe(free.release)
                self._handed_out(value, t0)
                yield value
        finally:
            future.cancel()
            try:
                future.result(timeout=30)
            except BaseException:  # cancelled, already reported through the queue, or torn down
                pass

    def _network_loop(self) -> asyncio.AbstractEventLoop:
        """The Loader's own event loop, in a daemon thread, reused by every epoch.

        grpc.aio binds its completion queue to a loop, so one long-lived loop per
        Loader is both cheaper and safer than a fresh loop per epoch.
        """
        if self._loop is None or self._loop.is_closed():
            import uvloop

            loop = uvloop.new_event_loop()
            self._thread = threading.Thread(target=loop.run_forever, name="croupier-loader", daemon=True)
            self._thread.start()
            self._loop = loop
            _LIVE.add(self)
        return self._loop

    def close(self) -> None:
        """Stop the network thread: its streams cancelled, channels closed, thread joined.

        Also done when the Loader is garbage-collected, and for every Loader still open
        when the interpreter exits: a network thread left running into interpreter exit
        dies wherever it stands, and inside native code that aborts the process
        ("terminate called without an active exception", exit -6)."""
        loop, self._loop = self._loop, None
        thread, self._thread = self._thread, None
        if loop is not None and not loop.is_closed():
            if thread is not None and thread.is_alive() and thread is not threading.current_thread():
                try:
                    asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result(timeout=10)
                except Exception:  # a stuck stream: the thread is still stopped below
                    pass
                loop.call_soon_threadsafe(loop.stop)
                thread.join(timeout=10)
                if not thread.is_alive():
                    loop.close()
            else:
                loop.call_soon_threadsafe(loop.stop)
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __iter__(self) -> Iterator[Any]:
        for b in self.batches():
            yield b.data
