"""`croupier health`: the container health check as a command."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def _health(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "croupier.cli", "health", *args], capture_output=True, text=True,
                          timeout=60)


def test_health_exits_0_for_a_serving_server_and_1_for_a_service_it_does_not_have(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=["a=synthetic:10"])
    assert _health(srv.address).returncode == 0
    assert _health(srv.address, "").returncode == 0  # the whole server
    unknown = _health(srv.address, "no.such.Service")
    assert unknown.returncode == 1
    assert srv.address in unknown.stderr and "NOT_FOUND" in unknown.stderr


def test_health_fails_cleanly_where_nothing_listens() -> None:
    # a port nobody listens on: the probe fails with the address in its message, not a traceback
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = _health(f"127.0.0.1:{port}")
    assert out.returncode == 1
    assert f"127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr


def test_health_without_an_address_asks_127_0_0_1_on_croupier_port(serve_inprocess) -> None:
    # As the images' HEALTHCHECK runs it: no arguments, the port from the environment.
    srv = serve_inprocess(datasets=["a=synthetic:10"])
    port = srv.address.rsplit(":", 1)[1]
    out = subprocess.run([sys.executable, "-m", "croupier.cli", "health"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "CROUPIER_PORT": port})
    assert out.returncode == 0, out.stderr
