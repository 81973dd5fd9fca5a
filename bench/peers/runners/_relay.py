"""A byte relay between TCP and a Unix socket, so the tf.data service's network namespace reaches the S3 server.

The tf.data service runs in a network namespace that has only its own loopback (`unshare --net`,
see run_tfdata.py), and the loopback S3 server listens on the host's loopback, which that
namespace cannot see. A Unix socket named by a path crosses network namespaces (it lives in the
file system), so the way in is two relays of bytes, nothing parsed or delayed:

    inside the namespace                      outside (the harness's machine)
    tensorflow-io's S3 client -> 127.0.0.1:P -> relay -> /tmp/.../s3.sock -> relay -> 127.0.0.1:P (S3 server)

`P` is the S3 server's own port, so the endpoint URL (S3_ENDPOINT) is the same on both sides.
Every request still reaches the one S3 server, which waits out its per-request latency and
counts it as for every other system; a relay adds two loopback copies per connection.

    python _relay.py unix-to-tcp FD HOST PORT   # the outer relay: FD is a listening Unix socket it inherits

`tcp_to_unix(host, port, path)` is the inner relay, a thread in the process that runs the
service. Standard library only (it runs in the peers' venvs and in croupier's).
"""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Callable

CHUNK = 256 * 1024


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """src -> dst until src's end of stream (or an error), then end dst's writing side."""
    try:
        while True:
            data = src.recv(CHUNK)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _pair(a: socket.socket, b: socket.socket) -> None:
    back = threading.Thread(target=_pump, args=(b, a), daemon=True)
    back.start()
    _pump(a, b)
    back.join()
    a.close()
    b.close()


def _nodelay(s: socket.socket) -> None:
    if s.family in (socket.AF_INET, socket.AF_INET6):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle wait on a relayed request


def serve(listener: socket.socket, connect: Callable[[], socket.socket]) -> None:
    """Accept on `listener` until it is closed; each connection is joined to a fresh `connect()`."""
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        try:
            upstream = connect()
        except OSError:
            client.close()
            continue
        _nodelay(client)
        _nodelay(upstream)
        threading.Thread(target=_pair, args=(client, upstream), daemon=True).start()


def tcp_to_unix(host: str, port: int, path: str) -> socket.socket:
    """Listen on host:port (here: the namespace's loopback) and relay each connection to the Unix socket `path`,
    on a daemon thread; returns the listening socket (listening already when this returns)."""
    listener = socket.create_server((host, port), backlog=256)

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        return s

    threading.Thread(target=serve, args=(listener, connect), name="s3-relay", daemon=True).start()
    return listener


def unix_to_tcp(listener: socket.socket, host: str, port: int) -> None:
    """Relay each connection to the listening Unix socket `listener` to host:port (the S3 server); runs until killed."""
    serve(listener, lambda: socket.create_connection((host, port)))


def main() -> int:
    cmd, fd, host, port = sys.argv[1:5]
    if cmd != "unix-to-tcp":
        raise SystemExit(f"unknown command {cmd!r}")
    unix_to_tcp(socket.socket(fileno=int(fd)), host, int(port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
