"""Who is calling: the identity that per-client limits count against.

"token:NAME" when the call carries a bearer token, "cert:CN" for a verified client
certificate, else "peer:ADDRESS" (the peer's IP address, without the port): see
`client_identity`. A connection is the full peer (address and port). Tokens themselves
are server/access/auth.py's; this module only names the caller they authenticate.
"""

from __future__ import annotations

from typing import Any, Protocol

from croupier.server.access.auth import TokenStore, principal_of


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


def client_identity(context: Any, tokens: TokenStore | None = None) -> str:
    """A stable name for the caller, to key per-client limits and logs on:
    "token:NAME" when tokens are on (`tokens`: the server's TokenStore), else "cert:CN"
    for a verified client certificate (mutual TLS), else "peer:HOST" (the client's
    address without its port)."""
    principal = principal_of(context, tokens)
    if principal is not None:
        return f"token:{principal.name}"
    try:
        auth = context.auth_context() or {}
    except Exception:  # not every context type has one
        auth = {}
    cn = auth.get("x509_common_name") or []
    if cn:
        value = cn[0]
        return "cert:" + (value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value))
    return f"peer:{peer_host(context.peer() or 'unknown')}"  # the address without its port


def connection_identity(context: _HasPeer) -> str:
    """The key per-connection limits count against: the full peer (address and port)."""
    return context.peer() or "unknown"
