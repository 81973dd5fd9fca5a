"""TLS material for the gRPC port and the metrics endpoint, checked before anything binds.

Certificates and keys are read and paired with the `ssl` module first, so that a wrong
file or a key that does not match its certificate is refused with the flag and file
named, not as an opaque handshake failure on the first client's call.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
from pathlib import Path

import grpc

log = logging.getLogger("croupier.server")


class SecurityConfigError(ValueError):
    """A certificate, key or bind setting that cannot work; the message names the flag."""


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable only from this machine (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:  # a host name: loopback only if every address it names is
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return False
        return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def check_plaintext_bind(host: str, tls: bool, insecure: bool) -> None:
    """Refuse plaintext on a host other machines can reach, unless the operator insists."""
    if tls or is_loopback(host):
        return
    if not insecure:
        raise SecurityConfigError(
            f"--host {host} is reachable from other machines but no --tls-cert/--tls-key were given: "
            "datasets and tokens would cross the network in clear text. Give a certificate "
            "(README, Security), or --insecure to serve plaintext anyway (behind a TLS proxy, or "
            "in a private network)"
        )
    log.warning("SERVING PLAINTEXT on %s (--insecure): anyone on the network can read the streams "
                "and any token sent", host)


def read_pem(path: str, flag: str, kind: str = "CERTIFICATE") -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SecurityConfigError(f"{flag} {path}: cannot read: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data or (kind == "CERTIFICATE" and b"CERTIFICATE-----" not in data):
        raise SecurityConfigError(f"{flag} {path}: not a PEM {kind.lower()} (no '-----BEGIN {kind}' line)")
    return data


def check_pair(cert: str, key: str, flag: str) -> None:
    """The certificate and key load and belong together."""
    read_pem(cert, f"{flag}-cert")
    read_pem(key, f"{flag}-key", "PRIVATE KEY")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise SecurityConfigError(
            f"{flag}-cert {cert} and {flag}-key {key} do not load as a pair: {exc.reason or exc}"
        ) from None


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS for the gRPC port; with `client_ca`, every client must present a certificate it signed."""
    check_pair(cert, key, "--tls")
    roots = read_pem(client_ca, "--tls-client-ca") if client_ca else None
    return grpc.ssl_server_credentials(
        [(read_pem(key, "--tls-key", "PRIVATE KEY"), read_pem(cert, "--tls-cert"))],
        root_certificates=roots,
        require_client_auth=roots is not None,
    )


def metrics_ssl_context(cert: str, key: str) -> ssl.SSLContext:
    check_pair(cert, key, "--metrics-tls")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context
