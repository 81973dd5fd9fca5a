"""The /metrics HTTP endpoint: loopback by default, optionally TLS and HTTP basic auth.

Basic-auth credentials come from a file holding one "user:password" line
(`--metrics-auth-file`) or the CROUPIER_METRICS_AUTH variable, never from argv (which
every user of the machine can read in `ps`).
"""

from __future__ import annotations

import base64
import errno
import hmac
import logging
import ssl
import threading
from collections.abc import Mapping
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family

from croupier.server.access.tls import SecurityConfigError

log = logging.getLogger("croupier.server")


def basic_auth_credentials(path: str | None, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """("user", "password") from the file, else from CROUPIER_METRICS_AUTH; None when neither."""
    if path:
        try:
            text = Path(path).read_text().strip()
        except OSError as exc:
            raise SecurityConfigError(f"--metrics-auth-file {path}: cannot read: {exc.strerror or exc}") from None
        source = f"--metrics-auth-file {path}"
    elif environ.get("CROUPIER_METRICS_AUTH"):
        text, source = environ["CROUPIER_METRICS_AUTH"].strip(), "CROUPIER_METRICS_AUTH"
    else:
        return None
    user, sep, password = text.partition(":")
    if not sep or not user or not password or "\n" in text:
        raise SecurityConfigError(f"{source}: expected one line 'user:password'")
    return user, password


def _with_basic_auth(app, user: str, password: str):
    expected = b"Basic " + base64.b64encode(f"{user}:{password}".encode())

    def guarded(environ, start_response):
        given = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if not hmac.compare_digest(given, expected):
            start_response("401 Unauthorized", [("WWW-Authenticate", 'Basic realm="croupier metrics"'),
                                                ("Content-Type", "text/plain")])
            return [b"401: credentials needed (HTTP basic auth)\n"]
        return app(environ, start_response)

    return guarded


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # no line per scrape
        pass


class _Server(ThreadingWSGIServer):
    def handle_error(self, request, client_address) -> None:
        # A plain-HTTP client on the TLS port, a dropped connection: one line, no traceback.
        import sys

        exc = sys.exc_info()[1]
        log.info("metrics endpoint: request from %s failed: %s", client_address[0], exc)


def serve_metrics(
    registry: CollectorRegistry,
    port: int,
    host: str = "127.0.0.1",
    *,
    tls: ssl.SSLContext | None = None,
    credentials: tuple[str, str] | None = None,
) -> tuple[ThreadingWSGIServer, int]:
    """Start the endpoint in a daemon thread; returns the server and its bound port."""
    app = make_wsgi_app(registry)
    if credentials is not None:
        app = _with_basic_auth(app, *credentials)

    class Server(_Server):
        pass

    try:
        Server.address_family, addr = _get_best_family(host, port)
        httpd = make_server(addr, port, app, Server, handler_class=_QuietHandler)
    except OSError as exc:
        why = f"port {port} is already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise OSError(f"cannot listen for metrics on {host}:{port}: {why} (--metrics-port)") from None
    if tls is not None:
        # The handshake happens on the first read, in the request's own thread: a client
        # that connects and says nothing cannot stall the accepting thread.
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True, do_handshake_on_connect=False)
    threading.Thread(target=httpd.serve_forever, name="croupier-metrics", daemon=True).start()
    log.debug("metrics on %s:%d (tls %s, basic auth %s)", host, httpd.server_port, tls is not None,
              credentials is not None)
    return httpd, httpd.server_port


__all__ = ["basic_auth_credentials", "serve_metrics"]
