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
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import torch
from torch.utils.data import default_collate

from croupier.protocol.options import StreamOptions
from croupier.protocol.security import ClientSecurity, check_address

from croupier.client.assemble import BatchAssembler, ProtocolError, RawBatch
from croupier.client.connection import (FINAL_LIMITS, RETRYABLE, Connection, RetryPolicy, limit_of, size_limit_advice,
                                        transport_hint)
from croupier.client.decode_tuner import DecodeTuner
from croupier.client.samples import ImageDecoding, collate_table, raw_batch_samples

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
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _move(obj: Any, device: torch.device | None, pin: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        if pin:
            obj = obj.pin_memory()
        return obj.to(device, non_blocking=pin) if device is not None else obj
    if isinstance(obj, dict):
        return {k: _move(v, device, pin) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], (torch.Tensor, dict, list, tuple)):
        return type(obj)(_move(v, device, pin) for v in obj)
    return obj


class Loader:
    """Batches of one rank's part of a globally shuffled epoch, served by croupier.

    Args:
        dataset: the server's name for the dataset (or a path under its data root).
        servers: "host:port", or several replicas serving the same data; rank r starts
            on servers[r % len] and fails over to the next on errors.
        batch_size: samples per rank per batch.
        rank, world_size: default to torch.distributed's when initialised, else 0 and 1.
        seed, epoch: the plan is a pure function of (seed, epoch, dataset size).
        drop_last: as DistributedSampler + DataLoader (see croupier.protocol.epoch_plan).
        ordered: ask for the ordered ablation (one read at a time, in plan order).
        prefetch: batches the server reads ahead (0: the server's default; the server
            clamps it to its `--max-prefetch`).
        columns: table columns to fetch (default all).
        collate_fn: list of samples -> batch; default `torch.utils.data.default_collate`.
        transform: applied to every sample dict before collation.
        pin_memory, device: pin and move each batch (non-blocking when pinned).
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
        collate_fn: Callable[[list[Any]], Any] | None = None,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        pin_memory: bool = False,
        device: str | torch.device | None = None,
        in_order: bool = True,
        buffer_batches: int = 4,
        decoding: ImageDecoding = ImageDecoding(),
        retry: RetryPolicy = RetryPolicy(),
        security: ClientSecurity | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        if rank is None or world_size is None:
            d_rank, d_world = _distributed_default()
            rank = d_rank if rank is None else rank
            world_size = d_world if world_size is None else world_size
        self.servers = [servers] if isinstance(servers, str) else list(servers)
        if not self.servers:
            raise ValueError("Loader needs at least one server address")
        for address in self.servers:
            check_address(address)
        self.channel_options = list(channel_options)
        self.security = security if security is not None else ClientSecurity.resolve()
        for address in self.servers:
            self.security.metadata(address)  # refuses a token bound for clear text, now, not mid-epoch
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of size {world_size}")
        self.options = StreamOptions(
            dataset=dataset, batch_size=batch_size, seed=seed, epoch=epoch, rank=rank, world_size=world_size,
            drop_last=drop_last, ordered=ordered, prefetch=prefetch, columns=tuple(columns),
            decode_images=decoding.on_server,
        )
        self.collate_fn = collate_fn or default_collate
        self._default_collate = collate_fn is None or collate_fn is default_collate
        self.transform = transform
        self.decoding = decoding
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.device = torch.device(device) if device is not None else None
        self.in_order = in_order
        self.retry = retry
        self.buffer_batches = max(1, buffer_batches)
        self.stats = LoaderStats()
        self._next_batch = 0  # first batch not yet handed to the user
        self._ahead: set[int] = set()  # handed out already, beyond _next_batch (in_order=False)
        self._num_batches: int | None = None
        # This Loader handed out the epoch's last batch: the next pass starts over.
        self._epoch_done = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        #: Sets decode_workers as the Loader runs (None: decoding.workers was given, and is kept).
        self.decode_tuner = DecodeTuner(os.cpu_count() or 1) if decoding.workers is None else None
        self.decode_workers = self.decode_tuner.workers if self.decode_tuner is not None else decoding.workers
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    # ---- epoch and resume state -------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.options.epoch

    @property
    def rank(self) -> int:
        return self.options.rank

    @property
    def world_size(self) -> int:
        return self.options.world_size

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (its permutation); a new epoch starts at its first batch."""
        if epoch != self.options.epoch:
            self.options = self.options.with_(epoch=epoch)
            self._next_batch, self._ahead, self._epoch_done = 0, set(), False

    def state_dict(self) -> dict[str, Any]:
        """A few integers that resume this rank exactly where the user stopped."""
        return {
            "dataset": self.options.dataset,
            "seed": self.options.seed,
            "epoch": self.options.epoch,
            "next_batch": self._next_batch,
            "batches_ahead": sorted(self._ahead),
            "rank": self.options.rank,
            "world_size": self.options.world_size,
            "batch_size": self.options.batch_size,
            "drop_last": self.options.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("dataset", "rank", "world_size", "batch_size", "drop_last"):
            if key in state and state[key] != getattr(self.options, key):
                raise ValueError(
                    f"state_dict was saved with {key}={state[key]!r} but this Loader has "
                    f"{key}={getattr(self.options, key)!r}: resuming would change the plan"
                )
        self.options = self.options.with_(seed=int(state["seed"]), epoch=int(state["epoch"]))
        self._next_batch = int(state["next_batch"])
        self._ahead = set(int(b) for b in state.get("batches_ahead", ()))
        # Resume where the state says, even at the end of an epoch (then nothing is left).
        self._epoch_done = False

    def __len__(self) -> int:
        """Batches per epoch for this rank (asks the server for the dataset size once)."""
        if self._num_batches is None:
            from croupier.protocol.epoch_plan import EpochPlan, PlanError

            async def rows() -> int:
                # The first replica that answers, starting with this rank's own.
                errors = []
                for k in range(len(self.servers)):
                    address = self.servers[(self.rank + k) % len(self.servers)]
                    conn = Connection(address, self.security, self.channel_options)
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

            o = self.options
            n = asyncio.run_coroutine_threadsafe(rows(), self._network_loop()).result(60)
            try:
                plan = EpochPlan(n, o.seed, o.epoch, o.batch_size, o.world_size, o.drop_last)
            except PlanError as exc:  # what the server answers a stream of this plan
                raise LoaderError(f"INVALID_ARGUMENT: {exc}", grpc.StatusCode.INVALID_ARGUMENT) from None
            self._num_batches = plan.num_batches
        return self._num_batches

    # ---- producing batches --------------------------------------------------------
    async def _raw_batches(self, start: int, ahead: frozenset[int]) -> AsyncIterator[RawBatch]:
        """RawBatches of the current epoch from `start`, reconnecting as needed."""
        opts = self.options
        next_batch, ahead = start, set(ahead)
        server_i = opts.rank % len(self.servers)
        failures = 0
        num_batches: int | None = None
        while num_batches is None or next_batch < num_batches:
            address = self.servers[server_i]
            conn = Connection(address, self.security, self.channel_options)
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
                        num_batches = self._num_batches = header.num_batches
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
                error = f"{address}: {code.name}: {exc.details()}{transport_hint(self.security, exc.details() or '')}"
                self.stats.errors.append(error)
                if failures > self.retry.max_retries:
                    raise LoaderError(f"gave up after {self.retry.max_retries} retries; last error from {error}",
                                      code) from None
                self.stats.reconnects += 1
                server_i = (server_i + 1) % len(self.servers)
                delay = self.retry.delay(failures, limit)
                # Said at once, each time: a trainer pointed at the wrong address learns it
                # in seconds, not when the retries run out.
                log.warning("%s; retry %d of %d in %.1fs (on %s)", error, failures, self.retry.max_retries, delay,
                            self.servers[server_i])
                await asyncio.sleep(delay)
            finally:
                await conn.close()

    def _account(self, assembler: BatchAssembler) -> None:
        s = assembler.stats
        self.stats.samples += s.samples
        self.stats.bytes += s.bytes
        self.stats.out_of_order += s.out_of_order
        s.samples = s.bytes = s.out_of_order = 0

    def _collate(self, raw: RawBatch) -> Batch:
        data = None
        if raw.table is not None and self._default_collate and self.transform is None:
            data = collate_table(raw.table)  # same result as default_collate, column-wise
        if data is None:
            t0 = time.perf_counter()
            samples = raw_batch_samples(raw, self.decoding.output, self._decode_pool())
            if self.decode_tuner is not None:
                self.decode_tuner.batch_done(len(samples), time.perf_counter() - t0)
            if self.transform is not None:
                samples = [self.transform(s) for s in samples]
            data = self.collate_fn(samples)
        data = _move(data, self.device, self.pin_memory)
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

    def _start(self) -> tuple[int, frozenset[int]]:
        if self._epoch_done:  # a finished epoch iterated again starts over, as a DataLoader
            self._next_batch, self._ahead, self._epoch_done = 0, set(), False
        return self._next_batch, frozenset(self._ahead)

    def _pass_ended(self) -> None:
        """A pass ran to the end of the epoch (maybe yielding nothing, from a final state)."""
        self._epoch_done = True

    def _handed_out(self, batch: Batch, t0: float) -> None:
        """Record, on the consumer's side, that the user now holds `batch`."""
        self.stats.batches += 1
        if self.stats.first_batch_s is None:
            self.stats.first_batch_s = time.perf_counter() - t0
        if batch.batch == self._next_batch:
            self._next_batch += 1
            while self._next_batch in self._ahead:
                self._ahead.discard(self._next_batch)
                self._next_batch += 1
        else:
            self._ahead.add(batch.batch)
        if self._num_batches is not None and self._next_batch >= self._num_batches:
            self._epoch_done = True  # even if the user stops before the stream's end

    async def abatches(self) -> AsyncIterator[Batch]:
        """Async iteration over `Batch`es (collated data plus plan metadata)."""
        t0 = time.perf_counter()
        start, ahead = self._start()
        if start == 0:
            self._next_batch, self._ahead = 0, set()
        gen = self._raw_batches(start, ahead)
        try:
            while True:
                w = time.perf_counter()
                try:
                    raw = await gen.__anext__()
                except StopAsyncIteration:
                    self._pass_ended()
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
        start, ahead = self._start()
        if start == 0:
            self._next_batch, self._ahead = 0, set()
        loop = self._network_loop()
        q: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        # Free places in the hand-off buffer, counted on the loop's side so that a full
        # buffer suspends the producer instead of blocking the Loader's event loop.
        free = asyncio.run_coroutine_threadsafe(_make_semaphore(self.buffer_batches), loop).result(30)

        async def run() -> None:
            gen = self._raw_batches(start, ahead)
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
                    self._pass_ended()
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
