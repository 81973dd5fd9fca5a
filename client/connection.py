"""The client's only gRPC code: channels, calls, which failures are worth a retry, and
how long to wait before one."""

from __future__ import annotations

import ipaddress
import random
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from croupier.protocol.options import StreamOptions
from croupier.protocol.security import AddressError, ClientSecurity, check_address
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


#: (host, port) -> every "HOST:PORT" the name stands for; raises OSError when it has none.
Resolver = Callable[[str, int], Sequence[str]]


def resolve_host(host: str, port: int) -> list[str]:
    """Every address of `host` (its A and AAAA records, by getaddrinfo) as HOST:PORT
    ([V6]:PORT), IPv4 first, in numeric order."""
    ips = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    return sorted((f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips), key=address_order)


def address_order(address: str) -> tuple[int, Any, str]:
    """Sort key of HOST:PORT: IPv4 before IPv6, numerically, then names. Every rank sorts a
    name's addresses alike, so rank r lands on the same replica whichever process resolved it
    and in whatever order the DNS server answered."""
    host = address.rpartition(":")[0].strip("[]").split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return (7, 0, address)
    return (ip.version, int(ip), address)


def dns_name(target: str) -> tuple[str, int] | None:
    """(host, port) of a `dns:///HOST:PORT` or `dns:HOST:PORT` target (gRPC's spelling), None
    for any other address. A DNS server named in the authority (dns://8.8.8.8/h:p) is
    refused: names are resolved by this host's resolver (getaddrinfo)."""
    if not target.startswith("dns:"):
        return None
    rest = target[len("dns:"):]
    if rest.startswith("//"):
        authority, _, rest = rest[2:].partition("/")
        if authority:
            raise AddressError(f"server address {target!r}: a DNS server in the authority ({authority}) is not "
                               "supported; write dns:///HOST:PORT (resolved by this host's resolver)")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise AddressError(f"server address {target!r}: write dns:///HOST:PORT, e.g. dns:///croupier.ns.svc:50051")
    return host.strip("[]"), int(port)


class Servers:
    """The replicas a Loader streams from: HOST:PORT addresses as given, and each
    `dns:///NAME:PORT` expanded to every address the name resolves to (the pods behind a
    headless Service). `refresh()` resolves again; the Loader calls it at each epoch's
    start and before each reconnect, so replicas that left the name are dropped and
    replicas that joined take ranks. A name that does not resolve keeps its last
    addresses (a DNS blip must not stop training); with none, refresh raises OSError."""

    def __init__(self, servers: str | Sequence[str], resolve: Resolver = resolve_host):
        self.targets = [servers] if isinstance(servers, str) else list(servers)
        if not self.targets:
            raise ValueError("Loader needs at least one server address")
        for target in self.targets:
            check_address(target)
            dns_name(target)  # a malformed dns: target is refused now, not at the first epoch
        self._resolve = resolve
        self._last: dict[str, list[str]] = {}
        #: Address -> the DNS name it came from (TLS checks the certificate against the name).
        self.names: dict[str, str] = {}
        self.addresses: list[str] = [t for t in self.targets if dns_name(t) is None]

    def refresh(self) -> list[str]:
        """Resolve every name again; the addresses, in the order ranks are spread over."""
        addresses: list[str] = []
        for target in self.targets:
            name = dns_name(target)
            if name is None:
                addresses.append(target)
                continue
            try:
                self._last[target] = sorted(self._resolve(*name), key=address_order) or self._last.get(target, [])
            except OSError:
                if not self._last.get(target):
                    raise
            for address in self._last[target]:
                self.names[address] = name[0]
            addresses += self._last[target]
        if not addresses:
            raise OSError(f"{', '.join(self.targets)} resolved to no address")
        self.addresses = list(dict.fromkeys(addresses))  # one replica behind two names counts once
        return self.addresses

    def channel_options(self, address: str, security: ClientSecurity) -> list[tuple[str, Any]]:
        """Over TLS to an address found by name, the certificate is checked against the name
        (the pod's IP is not in it), unless the caller named the server already."""
        name = self.names.get(address)
        if name is None or not security.tls or security.server_name:
            return []
        return [("grpc.ssl_target_name_override", name)]


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
