"""How a client reaches a croupier server: address checks, TLS credentials, bearer token.

Shared by the Loader (client/connection.py) and the CLI commands that connect (demo,
loadtest, health), and importable without torch. Settings not given are read from the
environment:

    CROUPIER_TOKEN        bearer token sent with every call
    CROUPIER_TLS_CA       CA file (PEM) that signed the server's certificate; turns TLS on
    CROUPIER_CLIENT_CERT  client certificate (PEM), for servers that require mutual TLS
    CROUPIER_CLIENT_KEY   its private key (PEM)
    CROUPIER_TLS          "1": TLS with the system's CAs (no CA file)

The token travels as `authorization: Bearer TOKEN` metadata on each call, over TLS, or
over plaintext to a loopback address (the server's default bind). Over plaintext to any
other address it would cross the network readable by anyone, so it is refused unless
`insecure_token=True` (a private network, or a TLS-terminating sidecar).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("croupier.client")


class AddressError(ValueError):
    """A server address that cannot be dialled as written."""


def check_address(address: str) -> str:
    """`address` if it is HOST:PORT ([V6]:PORT) with a port in 1..65535, or a gRPC target
    with a scheme (dns:///h:p, unix:/path, ipv4:...); else AddressError saying what to write."""
    if not address or address != address.strip():
        raise AddressError(f"server address {address!r} is empty or has spaces: write HOST:PORT, e.g. 127.0.0.1:50051")
    if address.startswith(("unix:", "unix-abstract:", "vsock:")):
        return address
    target = address
    if "://" in address:  # dns:///host:port, ipv4:///...
        target = address.split("://", 1)[1].lstrip("/").rsplit("/", 1)[-1]
    elif address.startswith(("ipv4:", "ipv6:", "dns:")):
        target = address.split(":", 1)[1]
    host, port = _split(target)
    if port is None:
        raise AddressError(
            f"server address {address!r} has no port: write HOST:PORT, e.g. {host or '127.0.0.1'}:50051"
            + (" (an IPv6 address goes in brackets: [::1]:50051)" if host.count(":") > 1 else "")
        )
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise AddressError(f"server address {address!r}: port {port!r} is not a number in 1..65535")
    if not host:
        raise AddressError(f"server address {address!r} has no host: write HOST:PORT, e.g. 127.0.0.1:{port}")
    return address


def _split(target: str) -> tuple[str, str | None]:
    if target.startswith("["):
        host, _, rest = target[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else None
    if target.count(":") != 1:  # no colon, or a bare IPv6 address
        return target, None
    host, port = target.split(":")
    return host, port


def address_host(address: str) -> str:
    target = address.split("://", 1)[-1].lstrip("/")
    return _split(target)[0] if not address.startswith("unix") else "localhost"


def is_loopback_address(address: str) -> bool:
    host = address_host(address)
    if host == "localhost" or address.startswith("unix"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {path}: cannot read: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path}: not a PEM file (no '-----BEGIN' line)")
    return data


@dataclass(frozen=True)
class ClientSecurity:
    """TLS and token settings of a client's channels."""

    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token: str | None = None
    #: The name the server's certificate must carry, when it differs from the address's host.
    server_name: str | None = None
    #: Send the token over plaintext to a non-loopback address anyway.
    insecure_token: bool = False

    def __post_init__(self) -> None:
        # Built directly (the Loader takes one as `security=`), a CA or certificate without
        # tls=True would otherwise connect in plaintext without a word.
        given = [n for n in ("tls_ca", "tls_cert", "tls_key") if getattr(self, n)]
        if given and not self.tls:
            raise ValueError(f"ClientSecurity: {', '.join(given)} given without tls=True would connect in "
                             "plaintext: pass tls=True, or build it with ClientSecurity.resolve(...)")

    @classmethod
    def resolve(
        cls,
        *,
        tls: bool | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        token: str | None = None,
        server_name: str | None = None,
        insecure_token: bool = False,
        environ: Mapping[str, str] | None = None,
    ) -> "ClientSecurity":
        """Arguments first, then the CROUPIER_* environment (module docstring)."""
        env = os.environ if environ is None else environ
        tls_ca = tls_ca or env.get("CROUPIER_TLS_CA") or None
        tls_cert = tls_cert or env.get("CROUPIER_CLIENT_CERT") or None
        tls_key = tls_key or env.get("CROUPIER_CLIENT_KEY") or None
        token = token or env.get("CROUPIER_TOKEN") or None
        if tls is None:
            tls = bool(tls_ca or tls_cert or env.get("CROUPIER_TLS", "") in ("1", "true", "yes"))
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key (CROUPIER_CLIENT_CERT, CROUPIER_CLIENT_KEY) go together")
        if tls_cert and not tls:
            raise ValueError("a client certificate (tls_cert) needs TLS: do not pass tls=False with it")
        if not tls:
            tls_ca = None  # tls=False chosen over a CA from the environment: plaintext, as asked
        return cls(bool(tls), tls_ca, tls_cert, tls_key, token, server_name, insecure_token)

    def channel_credentials(self):
        """grpc.ChannelCredentials for TLS, or None for plaintext."""
        import grpc

        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca, "tls_ca") if self.tls_ca else None,
            private_key=_read(self.tls_key, "tls_key") if self.tls_key else None,
            certificate_chain=_read(self.tls_cert, "tls_cert") if self.tls_cert else None,
        )

    def channel_options(self) -> list[tuple[str, object]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name and self.tls else []

    def metadata(self, address: str) -> tuple[tuple[str, str], ...]:
        """The call metadata for `address`: the bearer token, where it may be sent."""
        if not self.token:
            return ()
        if not self.tls and not self.insecure_token and not is_loopback_address(address):
            raise ValueError(
                f"refusing to send the token to {address} in clear text: give the server's CA "
                "(tls_ca / CROUPIER_TLS_CA) so the channel uses TLS, or insecure_token=True"
            )
        return (("authorization", f"Bearer {self.token}"),)


def add_client_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The connection flags of every command that talks to a server."""
    parser.add_argument("--tls-ca", metavar="PEM", help="CA that signed the server's certificate; turns TLS on "
                        "(env CROUPIER_TLS_CA)")
    parser.add_argument("--tls", action="store_true", default=None,
                        help="TLS with the system's CAs (implied by --tls-ca; env CROUPIER_TLS=1)")
    parser.add_argument("--tls-cert", metavar="PEM", help="client certificate for mutual TLS (env CROUPIER_CLIENT_CERT)")
    parser.add_argument("--tls-key", metavar="PEM", help="its private key (env CROUPIER_CLIENT_KEY)")
    parser.add_argument("--tls-server-name", metavar="NAME",
                        help="name the server's certificate carries, when not the address's host")
    parser.add_argument("--token-file", metavar="FILE",
                        help="file holding the bearer token (else env CROUPIER_TOKEN; never on the command line)")


def security_from_args(args: argparse.Namespace) -> ClientSecurity:
    token = None
    if getattr(args, "token_file", None):
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"--token-file {args.token_file}: cannot read: {exc.strerror or exc}") from None
    return ClientSecurity.resolve(tls=args.tls, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                                  token=token, server_name=args.tls_server_name)
