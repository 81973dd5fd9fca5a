"""Who is calling: the identity that per-client limits count against.

"token:NAME" when the call carries a bearer token, "cert:CN" for a verified client
certificate, else "peer:ADDRESS" (the peer's IP address, without the port): see
`auth.caller_identity`. A connection is the full peer (address and port).
"""

from __future__ import annotations

from typing import Any, Protocol


class _HasPeer(Protocol):
    def peer(self) -> str: ...


def peer_host(peer: str) -> str:
    """'ipv4:10.0.0.5:41234' -> '10.0.0.5'; 'ipv6:[::1]:41234' -> '::1'; 'unix:/p' -> 'unix:/p'.

    Percent-escapes grpc puts in IPv6 zone ids ('%25') are left as they are: the
    result is a key, not an address to connect to.
    """
    kind, sep, rest = peer.partition(":")
    if not sep:
        return peer
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        if rest.startswith("["):
            return rest[1:].partition("]")[0]
        return rest.rpartition(":")[0] or rest
    return peer  # unix sockets and other transports: the whole peer names the client


def client_identity(context: Any, tokens: Any = None) -> str:
    """The key per-client limits count against (`tokens`: the server's TokenStore)."""
    from croupier.server.access.auth import caller_identity

    return caller_identity(context, tokens)


def connection_identity(context: _HasPeer) -> str:
    """The key per-connection limits count against: the full peer (address and port)."""
    return context.peer() or "unknown"
