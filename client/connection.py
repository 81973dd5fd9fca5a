"""The client's only gRPC code: channels, calls, which failures are worth a retry, and
how long to wait before one."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from croupier.protocol.options import StreamOptions
from croupier.protocol.security import ClientSecurity, check_address
from croupier.v1 import croupier_pb2 as pb
from croupier.v1 import croupier_pb2_grpc as pb_grpc

#: Failures of the connection or of the server process, not of the request.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)

#: Trailing-metadata key a croupier server sets when a call ran into one of its fair
#: limits (croupier.server.access.limits.LIMIT_METADATA_KEY); the value names the limit.
LIMIT_METADATA_KEY = "croupier-limit"
#: Limits that the same request would hit again: retrying cannot help.
FINAL_LIMITS = frozenset({"max_batch_size"})
#: A limit refusal is retried no sooner than this: the limit frees up as streams end.
LIMIT_BACKOFF_S = 1.0

MAX_RECEIVE_BYTES = 256 << 20

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
    ("grpc.max_send_message_length", 16 << 20),
    # At least the server's --min-client-ping-interval (default 10 s), or the server
    # answers GOAWAY too_many_pings; tests/test_limits.py checks the pair.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    # Fail fast and let the Loader's own backoff decide when to try again.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.enable_retries", 0),
]


@dataclass(frozen=True)
class RetryPolicy:
    """How a Loader retries a stream that failed for a reason worth a retry (RETRYABLE):
    at most `max_retries` failures in a row (a batch received resets the count), each
    followed by a backoff that starts at `initial_backoff_s` and doubles up to
    `max_backoff_s`. A failure the same request would meet again (a size limit, a final
    server limit, a refused request) is never retried, whatever the policy.
    """

    max_retries: int = 10
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0

    def delay(self, failures: int, limit: str | None = None) -> float:
        """Seconds to wait after the `failures`-th failure in a row: the doubled backoff,
        capped, at least LIMIT_BACKOFF_S after a server limit other than the idle timeout,
        then jittered to between half and all of that so that clients spread out."""
        delay = min(self.max_backoff_s, self.initial_backoff_s * 2 ** (failures - 1))
        if limit is not None and limit != "stream_idle_timeout_s":
            delay = max(delay, LIMIT_BACKOFF_S)  # the limit frees up as streams end, not in ms
        return delay * (0.5 + random.random() / 2)


def limit_of(exc: grpc.aio.AioRpcError) -> str | None:
    """The name of the server limit a failed call ran into (its RESOURCE_EXHAUSTED
    carries it in the trailing metadata), or None."""
    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == LIMIT_METADATA_KEY:
            return value if isinstance(value, str) else value.decode()
    return None


def size_limit_advice(code: grpc.StatusCode, details: str) -> str | None:
    """For a message that broke a size limit (the same message would break it again,
    so a retry cannot help): which limit it broke and how to change it. None for any
    other failure."""
    if code != grpc.StatusCode.RESOURCE_EXHAUSTED or "larger than max" not in details:
        return None
    if details.startswith("Received message"):  # grpc's own check, on this side
        return (
            f"{details}: a message exceeded this client's grpc.max_receive_message_length "
            f"({MAX_RECEIVE_BYTES >> 20} MiB); start the server with `--max-message-mb` at most that "
            "(it splits chunks to fit)"
        )
    if details.startswith("SERVER: Received message"):  # the server's grpc refused the request
        return f"{details}: the request is over the server's `croupier serve --max-request-kb`"
    if details.startswith("Sent message"):  # the server's grpc refused to send it
        return f"{details}: raise the server's `croupier serve --max-message-mb`"
    return details  # croupier's own message names the limit


def channel_arguments(security: ClientSecurity, extra_options: Sequence[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    """croupier's channel arguments, then `extra_options`, which replace those of the same
    name (gRPC would keep both, and which one wins is not documented)."""
    replaced = {name for name, _ in extra_options}
    ours = CHANNEL_OPTIONS + security.channel_options()
    return [o for o in ours if o[0] not in replaced] + list(extra_options)


def open_channel(address: str, security: ClientSecurity | None = None,
                 extra_options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A TLS channel when `security` says so, else plaintext. `extra_options` (gRPC
    channel arguments) replace croupier's own of the same name."""
    check_address(address)
    security = security or ClientSecurity()
    credentials = security.channel_credentials()
    options = channel_arguments(security, extra_options)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)


def transport_hint(security: ClientSecurity, details: str) -> str:
    """Why a connection that never got going probably failed, when the cause is a TLS
    mismatch (gRPC itself only says the connection failed or the socket closed)."""
    d = details.lower()
    if not security.tls and ("socket closed" in d or "connection reset" in d or "eof" in d):
        return " (is the server using TLS? then pass tls_ca=... or set CROUPIER_TLS_CA)"
    if security.tls and ("handshake" in d or "ssl" in d or "wrong_version" in d):
        return " (TLS handshake failed: the server may be plaintext, or its certificate not signed by tls_ca, " \
               "or it requires a client certificate)"
    return ""


class Connection:
    """One channel to one server."""

    def __init__(self, address: str, security: ClientSecurity | None = None,
                 channel_options: Sequence[tuple[str, Any]] = ()):
        self.address = address
        #: None: from the environment (CROUPIER_TOKEN, CROUPIER_TLS_CA, ...).
        self.security = security if security is not None else ClientSecurity.resolve()
        self.metadata = self.security.metadata(address)
        self.channel = open_channel(address, self.security, channel_options)
        self.stub = pb_grpc.CroupierStub(self.channel)

    async def describe(self, dataset: str, timeout: float | None = 30.0) -> pb.DatasetInfo:
        return await self.stub.DescribeDataset(pb.DescribeDatasetRequest(name=dataset), timeout=timeout,
                                               metadata=self.metadata)

    async def list_datasets(self, timeout: float | None = 30.0) -> list[pb.DatasetInfo]:
        return list((await self.stub.ListDatasets(pb.ListDatasetsRequest(), timeout=timeout,
                                                  metadata=self.metadata)).datasets)

    def stream(self, options: StreamOptions) -> AsyncIterator[pb.StreamEpochResponse]:
        """The StreamEpoch call: a header message, then chunks."""
        return self.stub.StreamEpoch(options.to_proto(), wait_for_ready=False, metadata=self.metadata)

    async def close(self) -> None:
        await self.channel.close()
