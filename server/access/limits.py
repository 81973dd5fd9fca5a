"""Fair limits: how many streams a client, a connection and the server may hold open.

A refusal is a `LimitExceeded` naming the limit, its value and the flag that raises it;
the service answers it with RESOURCE_EXHAUSTED and the limit's name in the trailing
metadata key `croupier-limit`, so a client can tell a refusal from a failure.
Nothing here knows about gRPC: identities are plain strings (server/access/identity.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

#: Trailing-metadata key that carries the name of the limit a call ran into.
LIMIT_METADATA_KEY = "croupier-limit"


class LimitExceeded(Exception):
    """A request would go past a configured limit."""

    def __init__(self, limit: str, value: float | int, flag: str, what: str):
        self.limit, self.value, self.flag = limit, value, flag
        super().__init__(f"{what} (limit {limit}={value:g}; raise it with `croupier serve {flag}`)")


class StreamIdleError(LimitExceeded):
    """The client read nothing for the idle timeout while the stream had data ready."""


@dataclass(frozen=True)
class StreamTicket:
    """One admitted stream; hand it back with `StreamAdmission.release`."""

    client: str
    connection: str


class StreamAdmission:
    """Counts open streams per client, per connection and in all; 0 turns a limit off.

    O(1) per stream; counters drop keys at zero so churn does not grow them.
    """

    def __init__(self, max_streams: int, per_client: int, per_connection: int):
        self.max_streams = max_streams
        self.per_client = per_client
        self.per_connection = per_connection
        self.total = 0
        self.clients: Counter[str] = Counter()
        self.connections: Counter[str] = Counter()

    def admit(self, client: str, connection: str) -> StreamTicket:
        if self.per_connection and self.connections[connection] >= self.per_connection:
            self._drop_zero(client, connection)
            raise LimitExceeded(
                "max_streams_per_connection", self.per_connection, "--max-streams-per-connection",
                f"too many streams on one connection: {self.per_connection} open from {connection}",
            )
        if self.per_client and self.clients[client] >= self.per_client:
            self._drop_zero(client, connection)
            raise LimitExceeded(
                "max_streams_per_client", self.per_client, "--max-streams-per-client",
                f"too many streams from client {client!r}: {self.per_client} open",
            )
        if self.max_streams and self.total >= self.max_streams:
            self._drop_zero(client, connection)
            raise LimitExceeded(
                "max_streams", self.max_streams, "--max-streams",
                f"too many streams on this server: {self.total} open",
            )
        self.total += 1
        self.clients[client] += 1
        self.connections[connection] += 1
        return StreamTicket(client, connection)

    def release(self, ticket: StreamTicket) -> None:
        self.total -= 1
        self.clients[ticket.client] -= 1
        self.connections[ticket.connection] -= 1
        self._drop_zero(ticket.client, ticket.connection)

    def _drop_zero(self, client: str, connection: str) -> None:
        if self.clients[client] <= 0:
            del self.clients[client]
        if self.connections[connection] <= 0:
            del self.connections[connection]
