"""`croupier health`: the container health check as a command."""

from __future__ import annotations

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
