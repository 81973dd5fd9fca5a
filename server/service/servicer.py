"""The gRPC servicer: translates requests into calls on the catalog and the stream layer
(server/stream/epoch_stream.py), and what they return into messages (messages.py).

Every failure a client can cause maps to a status whose message names the value, file
or index at fault; the server and its other streams carry on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from croupier.protocol.options import StreamOptions
from croupier.v1 import croupier_pb2 as pb
from croupier.v1 import croupier_pb2_grpc as pb_grpc

from croupier.server.access.auth import Principal, ScopeError, TokenStore, check_scope, path_under_roots, principal_of
from croupier.server.access.identity import client_identity, connection_identity
from croupier.server.access.limits import LIMIT_METADATA_KEY, LimitExceeded, StreamAdmission, StreamIdleError
from croupier.server.access.redact import PathRedactor
from croupier.server.catalog import Catalog, DatasetUnavailableError, UnknownDatasetError
from croupier.server.metrics import ServerMetrics
from croupier.server.readers.base import DatasetError, DatasetInfo, MemberOutsideRootsError, OutsideRootsError, Reader, UnknownColumnError
from croupier.server.service.messages import chunk_to_proto, dataset_info_to_proto, header_to_proto
from croupier.server.stream.budgets import BufferBudget
from croupier.server.stream.dealer import ChunkTooLargeError
from croupier.server.stream.epoch_stream import EpochStream, ServerStreams, open_epoch_stream
from croupier.server.stream.memory_trim import MemoryTrimmer
from croupier.server.stream.rank_batches import StreamRange
from croupier.server.stream.shared_epochs import SharedEpochs
from croupier.server.stream.tuner import Autotuner
from croupier.protocol.epoch_plan import BatchRangeError, EpochPlan, PlanError

log = logging.getLogger("croupier.server")


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status a failure maps to."""
    for kind, code in (
        (UnknownDatasetError, grpc.StatusCode.NOT_FOUND),
        (DatasetUnavailableError, grpc.StatusCode.FAILED_PRECONDITION),  # named at start, failed to open
        (OutsideRootsError, grpc.StatusCode.PERMISSION_DENIED),
        (MemberOutsideRootsError, grpc.StatusCode.PERMISSION_DENIED),
        (ScopeError, grpc.StatusCode.PERMISSION_DENIED),
        (BatchRangeError, grpc.StatusCode.OUT_OF_RANGE),
        (PlanError, grpc.StatusCode.INVALID_ARGUMENT),
        (UnknownColumnError, grpc.StatusCode.INVALID_ARGUMENT),
        (DatasetError, grpc.StatusCode.DATA_LOSS),  # corrupt or truncated files and samples
        (ChunkTooLargeError, grpc.StatusCode.RESOURCE_EXHAUSTED),  # a sample over the message limit
        (LimitExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),  # a fair limit (server/access/limits.py)
        (FileNotFoundError, grpc.StatusCode.NOT_FOUND),
    ):
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


#: Longest dataset name or path a request may carry (Linux's PATH_MAX).
MAX_NAME_CHARS = 4096
#: Status details and log lines are cut to this: a client's 8 KiB metadata limit would
#: otherwise turn a long message into RESOURCE_EXHAUSTED on its side, and every refused
#: request would cost the log twice its name.
MAX_DETAIL_CHARS = 1024


class RequestTooLargeError(PlanError):
    """A field of the request is larger than any real one (INVALID_ARGUMENT)."""


def shorten(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit:,} more characters)"


def _check_name(name: str) -> None:
    if len(name) > MAX_NAME_CHARS:
        raise RequestTooLargeError(f"dataset name of {len(name):,} characters is too long (at most {MAX_NAME_CHARS:,})")


@dataclass
class _StreamCall:
    """One StreamEpoch call's bookkeeping: its name in logs, the dataset it asked for,
    the reader it holds, and how it ended (None: a failure, counted when reported)."""

    what: str
    asked: str
    reader: Reader | None = None
    outcome: str | None = "CANCELLED"  # unless the stream ends or aborts


class _IdleWatch:
    """Writes a stream's messages, ending the stream when one waits too long.

    A write waits on HTTP/2 flow control, so a write pending for `timeout_s` means
    the client read nothing for that long while the server had data ready. One loop
    timer per write, cancelled when it lands: a stalled stream has exactly one timer,
    which fires once.
    """

    def __init__(self, context: grpc.aio.ServicerContext, timeout_s: float):
        self.context = context
        self.timeout_s = timeout_s
        self.task = asyncio.current_task()
        self.fired = False

    def _fire(self) -> None:
        self.fired = True
        self.task.cancel()

    async def write(self, message) -> None:
        if not self.timeout_s or self.task is None:
            await self.context.write(message)
            return
        handle = asyncio.get_running_loop().call_later(self.timeout_s, self._fire)
        try:
            await self.context.write(message)
        except asyncio.CancelledError:
            if not self.fired:
                raise  # the client went away or the server is stopping
            self.task.uncancel()
            raise StreamIdleError(
                "stream_idle_timeout_s", self.timeout_s, "--stream-idle-timeout",
                f"the client read nothing for {self.timeout_s:g}s while data was ready; "
                "the stream was ended to free its reads and buffers (resume at the next batch)",
            ) from None
        finally:
            handle.cancel()


class CroupierService(pb_grpc.CroupierServicer):
    #: Bearer tokens in force (the interceptor checks them; this class checks their scope).
    tokens: TokenStore | None = None
    #: Server paths out of replies and error messages (server/access/redact.py).
    redact: PathRedactor = PathRedactor(disclose=True)

    def __init__(
        self,
        catalog: Catalog,
        streams: ServerStreams,
        *,
        metrics: ServerMetrics,
        admission: StreamAdmission | None = None,
        stream_idle_timeout_s: float = 0.0,
    ):
        self.catalog = catalog
        #: What every stream shares: budgets, shared epochs, the autotuner (server/stream/epoch_stream.py).
        self.streams = streams
        self.admission = admission or StreamAdmission(0, 0, 0)
        self.stream_idle_timeout_s = stream_idle_timeout_s
        self.trimmer = MemoryTrimmer(streams.executor)
        # limit name -> (monotonic time of its last log line, refusals not logged since)
        self._refusal_log: dict[str, tuple[float, int]] = {}
        self.metrics = metrics
        self.active: set[asyncio.Task] = set()
        #: Set by a graceful stop: open streams finish, new ones go to another replica.
        self.draining = False

    # The stream layer's server-wide parts, as the servicer's (metrics and tests read them).
    @property
    def shared(self) -> SharedEpochs | None:
        return self.streams.shared

    @property
    def server_buffer(self) -> BufferBudget | None:
        return self.streams.server_buffer

    @property
    def autotuner(self) -> Autotuner | None:
        return self.streams.autotuner

    async def _abort(self, context: grpc.aio.ServicerContext, exc: BaseException, what: str,
                     asked: str = "") -> None:
        code = self._failed(context, exc, what)
        await context.abort(code, shorten(self._client_message(exc, context, asked)))

    def _end(self, context: grpc.aio.ServicerContext, exc: BaseException, what: str, asked: str = "") -> None:
        """Set the status and let the handler return: unlike `abort`, which waits for
        the status to be sent (never, to a client that reads nothing), the handler and
        what it holds go now; grpc sends the status once the client reads or the
        connection is reaped (keepalive, connection age)."""
        context.set_code(self._failed(context, exc, what))
        context.set_details(shorten(self._client_message(exc, context, asked)))

    def _failed(self, context: grpc.aio.ServicerContext, exc: BaseException, what: str) -> grpc.StatusCode:
        """Count and log a failure; returns its status."""
        code = status_for(exc)
        self.metrics.streams_total.labels(code.name).inc()
        if isinstance(exc, LimitExceeded):
            self.metrics.limit_refusals.labels(exc.limit).inc()
            context.set_trailing_metadata(((LIMIT_METADATA_KEY, exc.limit),))
            self._log_refusal(exc, what)
        elif code is grpc.StatusCode.INTERNAL:
            log.exception("%s failed", what, exc_info=exc)
        else:
            log.warning("%s: %s: %s", what, code.name, shorten(str(exc)))
        return code

    def _log_refusal(self, exc: LimitExceeded, what: str) -> None:
        """One line per limit per 10 s: an abusive client must not flood the log."""
        now = time.monotonic()
        last, quiet = self._refusal_log.get(exc.limit, (float("-inf"), 0))
        if now - last < 10.0:
            self._refusal_log[exc.limit] = (last, quiet + 1)
            return
        self._refusal_log[exc.limit] = (now, 0)
        more = f" ({quiet} more refusals of this limit in the last {now - last:.0f}s)" if quiet else ""
        log.warning("%s: RESOURCE_EXHAUSTED: %s%s", what, exc, more)

    def _client_message(self, exc: BaseException, context: grpc.aio.ServicerContext, asked: str = "") -> str:
        """What the client is told: no server paths (unless disclosed), and a scoped token
        hears only of the datasets it may read."""
        principal = principal_of(context, self.tokens)
        if isinstance(exc, UnknownDatasetError) and principal is not None and principal.datasets is not None:
            names = [n for n in self.catalog.names() if principal.may_read(n)]
            return f"no such dataset; datasets this token may read: {names}"
        return self.redact(str(exc), keep=asked)

    async def _open(self, name: str, context: grpc.aio.ServicerContext, hold: bool = False) -> Reader:
        """The dataset `name`, if the caller's token may read it; with `hold`, a dataset
        opened by path stays open until `catalog.release` (a stream's lifetime)."""
        principal = principal_of(context, self.tokens)
        check_scope(principal, name)  # before opening: the answer must not say whether it exists
        reader = await (self.catalog.acquire(name) if hold else self.catalog.get(name))
        try:
            if principal is not None and principal.datasets is not None and name not in self.catalog.names():
                # Opened by path: the folder it really is (after symlinks) must be in scope too.
                rel = path_under_roots(reader.path, self.catalog.data_roots)
                check_scope(principal, rel if rel is not None else reader.path)
        except BaseException:
            if hold:
                self.catalog.release(reader)
            raise
        return reader

    def _info(self, info: DatasetInfo) -> pb.DatasetInfo:
        msg = dataset_info_to_proto(info)
        msg.path = self.redact.info_path(msg.path)
        return msg

    def _header(self, reader: Reader, plan: EpochPlan, span: StreamRange) -> pb.StreamEpochResponse:
        msg = header_to_proto(reader.info(), plan, span)
        msg.header.dataset.path = self.redact.info_path(msg.header.dataset.path)
        return msg

    async def ListDatasets(self, request: pb.ListDatasetsRequest, context) -> pb.ListDatasetsResponse:
        principal: Principal | None = principal_of(context, self.tokens)
        infos = [i for i in self.catalog.infos() if principal is None or principal.may_read(i.name)]
        return pb.ListDatasetsResponse(datasets=[self._info(i) for i in infos])

    async def DescribeDataset(self, request: pb.DescribeDatasetRequest, context) -> pb.DatasetInfo:
        try:
            _check_name(request.name)
            reader = await self._open(request.name, context)
        except (LookupError, DatasetError, OSError, PlanError, LimitExceeded) as exc:
            await self._abort(context, exc, f"DescribeDataset({shorten(repr(request.name), 200)})", request.name)
        return self._info(reader.info())

    async def StreamEpoch(self, request: pb.StreamEpochRequest, context: grpc.aio.ServicerContext) -> None:
        """request -> an epoch stream (server/stream/epoch_stream.py) -> a header, then its chunks.

        Written with context.write (not a generator) so that a write blocked on a client
        that stopped reading can time out and end the stream with a status."""
        if self.draining:
            self.metrics.streams_total.labels("UNAVAILABLE").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is draining (shutting down): "
                                "ask another replica, or this one once it is back")
        opts = StreamOptions.from_proto(request)
        call = _StreamCall(f"StreamEpoch({shorten(repr(opts.dataset), 200)} rank {opts.rank}/{opts.world_size} "
                           f"epoch {opts.epoch})", opts.dataset)
        try:
            ticket = self.admission.admit(client_identity(context, self.tokens), connection_identity(context))
        except LimitExceeded as exc:
            await self._abort(context, exc, call.what)
        self.metrics.active_streams.inc()
        task = asyncio.current_task()
        if task is not None:
            self.active.add(task)
        try:
            stream = await self._open_stream(context, opts, ticket.client, call)
            await self._send(context, stream, call)
        finally:
            # A client that goes away cancels this task; the stream's own cleanup
            # (aclose in _send) has then cancelled this stream's reads, nothing else.
            if call.reader is not None:
                self.catalog.release(call.reader)
            self.admission.release(ticket)
            self.trimmer.released()
            if call.outcome is not None:
                self.metrics.streams_total.labels(call.outcome).inc()
            if call.outcome == "CANCELLED":
                log.info("%s: cancelled by the client or by shutdown", call.what)
            self.metrics.active_streams.dec()
            if task is not None:
                self.active.discard(task)

    async def _open_stream(self, context: grpc.aio.ServicerContext, opts: StreamOptions, lane: str,
                           call: _StreamCall) -> EpochStream:
        """The dataset (held for the stream's lifetime) and the stream on it; a failure
        ends the call with its status."""
        try:
            _check_name(opts.dataset)
            call.reader = await self._open(opts.dataset, context, hold=True)
            return open_epoch_stream(call.reader, opts, self.streams, lane=lane, name=call.what)
        except (LookupError, DatasetError, PlanError, OSError, LimitExceeded) as exc:
            call.outcome = None
            await self._abort(context, exc, call.what, call.asked)
            raise  # not reached: abort raises

    async def _send(self, context: grpc.aio.ServicerContext, stream: EpochStream, call: _StreamCall) -> None:
        """The header, then every chunk, each counted; a failure while sending ends the
        call with its status, a client that reads nothing for too long with its own."""
        name = stream.reader.name
        writer = _IdleWatch(context, self.stream_idle_timeout_s)
        try:
            await writer.write(self._header(stream.reader, stream.plan, stream.span))
            async for chunk in stream:
                await writer.write(chunk_to_proto(chunk, stream.plan.epoch))
                self.metrics.samples.labels(name).inc(len(chunk.refs))
                self.metrics.bytes.labels(name).inc(chunk.payload.nbytes)
                self.metrics.chunks.labels(name).inc()
                self.metrics.batches.labels(name).inc(len(chunk.completed_batches))
        except StreamIdleError as exc:
            call.outcome = None
            self._end(context, exc, call.what)
            return
        except grpc.aio.InternalError as exc:
            # A write issued after grpc's core ended the call (the client cancelled) but
            # before this task's cancellation arrived: the client is gone, as when the
            # cancellation comes first. Raised on, grpc logged it as an ERROR with a traceback.
            log.info("%s: the client went away while a chunk was being written (%s)", call.what, type(exc).__name__)
            return
        except (DatasetError, OSError, ChunkTooLargeError) as exc:
            call.outcome = None
            await self._abort(context, exc, call.what, call.asked)
        finally:
            await stream.aclose()
        call.outcome = "OK"
