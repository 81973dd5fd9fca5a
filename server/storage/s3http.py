"""S3 GETs on the event loop itself: HTTP/1.1 on pooled asyncio connections, signed with SigV4.

Why: through obstore each range GET of a text row cost the server 80-125 us of CPU on its
Tokio threads, plus a future handed back across threads to the loop; a 2-core server
spent more on that than on everything else a row needs. Here a GET is one `write` of a
signed request and one parse of the response on a connection the loop already watches:
22-23 us of CPU per GET against obstore's 101-115 in the same run
(bench/results/s3get.md). obstore stays for everything else: listings and HEADs at
open, credentials this module does not resolve (web identity, container and instance
credentials), and every GET this one does not complete.

The contract is "done, or hand it back": a GET answered 200/206 (or 416: nothing at that
offset) is done here. Anything else (an error status, a closed or timed-out connection,
a chunked or unparsable answer) calls back `None`, and the store does the same GET
through obstore, whose retries, backoff and error messages then apply unchanged. So this
module never retries and never names an error to the user.

Used when the credentials are static (an access key and secret, optionally a session
token, from the store's options or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
AWS_SESSION_TOKEN) or signing is off (skip_signature), the endpoint is http(s) without a
path, and no proxy or HTTP/2 is asked for. `fast_get=false` (or CROUPIER_S3_FAST_GET=0)
turns it off.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import re
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

#: The payload hash of a GET: that of an empty body (what the AWS SDKs send).
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
#: Connections per loop at most; more GETs wait for one to be free.
DEFAULT_MAX_CONNECTIONS = 4096
#: Largest response head accepted (S3's are well under 2 KB).
MAX_HEAD_BYTES = 64 << 10

# The response head, searched in place (a GET's answer is parsed on the loop, thousands a second).
_STATUS = re.compile(rb"HTTP/1\.([01]) (\d{3})[ \r]")
_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)[ \t]*\r\n", re.IGNORECASE)
_CLOSE = re.compile(rb"\r\nconnection:[ \t]*close", re.IGNORECASE)
_KEEP_ALIVE = re.compile(rb"\r\nconnection:[ \t]*keep-alive", re.IGNORECASE)
_CHUNKED = re.compile(rb"\r\ntransfer-encoding:", re.IGNORECASE)

#: callback(body, None) when done; callback(None, reason) to hand the GET back.
Done = Callable[[bytes | None, str | None], None]


@dataclass(frozen=True)
class StaticCredentials:
    access_key_id: str
    secret_access_key: str
    session_token: str | None = None


class SigV4:
    """AWS Signature Version 4 for S3 GETs (header-based; the empty body's hash)."""

    def __init__(self, credentials: StaticCredentials, region: str):
        self.credentials = credentials
        self.region = region
        self._day = ""
        self._key = b""
        self._second = -1
        self._amz = self._scope = ""

    def _signing_key(self, day: str) -> bytes:
        if day != self._day:
            k = hmac.digest(("AWS4" + self.credentials.secret_access_key).encode(), day.encode(), "sha256")
            for part in (self.region, "s3", "aws4_request"):
                k = hmac.digest(k, part.encode(), "sha256")
            self._key, self._day = k, day
        return self._key

    def headers(self, host: str, path: str, range_value: str | None, now: float | None = None) -> str:
        """The request's x-amz-* and Authorization header lines (CRLF-terminated) for a GET
        of `path` (already URI-encoded) with this Range (or none)."""
        second = int(time.time() if now is None else now)
        if second != self._second:  # the date strings change once a second
            amz = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(second))
            scope = f"{amz[:8]}/{self.region}/s3/aws4_request"
            self._second, self._amz, self._scope = second, amz, scope
            self._key = self._signing_key(amz[:8])
        amz, scope = self._amz, self._scope
        token = self.credentials.session_token
        rng = f"range:{range_value}\n" if range_value is not None else ""
        signed = ("host;range;" if range_value is not None else "host;") + "x-amz-content-sha256;x-amz-date"
        tok = ""
        if token:
            tok = f"x-amz-security-token:{token}\n"
            signed += ";x-amz-security-token"
        request = (f"GET\n{path}\n\nhost:{host}\n{rng}x-amz-content-sha256:{EMPTY_SHA256}\nx-amz-date:{amz}\n{tok}"
                   f"\n{signed}\n{EMPTY_SHA256}")
        to_sign = f"AWS4-HMAC-SHA256\n{amz}\n{scope}\n{hashlib.sha256(request.encode()).hexdigest()}"
        signature = hmac.digest(self._key, to_sign.encode(), "sha256").hex()
        out = (f"x-amz-content-sha256: {EMPTY_SHA256}\r\nx-amz-date: {amz}\r\n"
               f"Authorization: AWS4-HMAC-SHA256 Credential={self.credentials.access_key_id}/{scope}, "
               f"SignedHeaders={signed}, Signature={signature}\r\n")
        if token:
            out += f"x-amz-security-token: {token}\r\n"
        return out


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, one request at a time."""

    __slots__ = ("pool", "transport", "buf", "done", "want", "head", "status", "close_after", "started", "closed",
                 "ranged")

    def __init__(self, pool: _Pool):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.done: Done | None = None
        self.closed = False
        self.started = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes, done: Done, ranged: tuple[int, int | None] | None) -> None:
        self.done = done
        self.ranged = ranged
        self.buf.clear()
        self.want = -1
        self.started = time.monotonic()
        self.transport.write(request)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        if self.done is None:  # bytes nobody asked for: the connection cannot be trusted
            self.transport.abort()  # type: ignore[union-attr]
            return
        buf = self.buf
        buf += data
        if self.want < 0 and not self._parse_head():
            return
        if len(buf) < self.want:
            return
        body = bytes(memoryview(buf)[self.head:self.want])
        extra = len(buf) > self.want
        done, self.done = self.done, None
        status, ranged = self.status, self.ranged  # release() may start the next request here
        if self.close_after or extra:
            self.transport.close()  # type: ignore[union-attr]
            self.closed = True
        else:
            self.pool.release(self)
        if status == 206:
            done(body, None)
        elif status == 200:  # the Range was ignored: the whole object came
            done(body if ranged is None else body[ranged[0]:ranged[1]], None)
        elif status == 416:  # the range starts at or past the end: nothing there, as a pread
            done(b"", None)
        else:
            done(None, f"HTTP {status}")

    def _parse_head(self) -> bool:
        """Parse the status line and headers once they are all in; False to wait for more."""
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD_BYTES:
                self._fail("response head too long")
            return False
        status = _STATUS.match(buf)
        if status is None:
            self._fail("bad status line")
            return False
        self.status = int(status.group(2))
        if _CLOSE.search(buf, 0, end) is not None:
            close = True
        else:
            close = status.group(1) == b"0" and _KEEP_ALIVE.search(buf, 0, end) is None
        m = _LENGTH.search(buf, 0, end + 2)
        length = int(m.group(1)) if m is not None and _CHUNKED.search(buf, 0, end) is None else -1
        if length < 0:
            self._fail("no content-length")
            return False
        self.head = end + 4
        self.want = self.head + length
        self.close_after = close
        return True

    def _fail(self, reason: str) -> None:
        done, self.done = self.done, None
        self.closed = True
        self.transport.abort()  # type: ignore[union-attr]
        if done is not None:
            done(None, reason)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.lost(self)
        done, self.done = self.done, None
        if done is not None:
            done(None, f"connection lost ({exc or 'closed by the server'})")


class _Pool:
    """The connections of one event loop to one endpoint."""

    def __init__(self, client: RangeGetClient, loop: asyncio.AbstractEventLoop):
        self.client = client
        self.loop = loop
        self.idle: list[_Connection] = []
        self.busy: set[_Connection] = set()
        self.opening = 0
        self.waiting: collections.deque[tuple[bytes, Done, tuple[int, int | None] | None]] = collections.deque()
        self._sweep: asyncio.TimerHandle | None = None

    def submit(self, request: bytes, done: Done, ranged: tuple[int, int | None] | None) -> None:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                self._start(conn, request, done, ranged)
                return
        if len(self.busy) + self.opening >= self.client.max_connections:
            self.waiting.append((request, done, ranged))
            return
        self.opening += 1
        self.loop.create_task(self._open(request, done, ranged))

    async def _open(self, request: bytes, done: Done, ranged: tuple[int, int | None] | None) -> None:
        c = self.client
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: _Connection(self), c.host, c.port, ssl=c.ssl,
                                            server_hostname=c.host if c.ssl else None),
                c.connect_timeout_s)
        except Exception as exc:  # whatever it is, the GET is handed back, never left waiting
            self.opening -= 1
            done(None, f"cannot connect: {exc}")
            self._next()
            return
        self.opening -= 1
        self._start(conn, request, done, ranged)  # type: ignore[arg-type]

    def _start(self, conn: _Connection, request: bytes, done: Done, ranged: tuple[int, int | None] | None) -> None:
        self.busy.add(conn)
        conn.send(request, done, ranged)
        if self._sweep is None:
            self._sweep = self.loop.call_later(1.0, self._check_timeouts)

    def release(self, conn: _Connection) -> None:
        self.busy.discard(conn)
        if self.waiting:
            self._start(conn, *self.waiting.popleft())
        else:
            self.idle.append(conn)

    def lost(self, conn: _Connection) -> None:
        self.busy.discard(conn)
        self._next()

    def _next(self) -> None:
        if self.waiting and len(self.busy) + self.opening < self.client.max_connections:
            self.submit(*self.waiting.popleft())

    def _check_timeouts(self) -> None:
        """Once a second while GETs are out: abort those past the timeout (handed back)."""
        self._sweep = None
        limit = time.monotonic() - self.client.timeout_s
        for conn in [c for c in self.busy if c.started < limit and c.done is not None]:
            conn._fail(f"no answer in {self.client.timeout_s:g} s")
        if self.busy:
            self._sweep = self.loop.call_later(1.0, self._check_timeouts)

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
        for conn in [*self.idle, *self.busy]:
            if conn.transport is not None:
                conn.transport.abort()
        self.idle.clear()


def _open_files_limit() -> int:
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return soft if soft != resource.RLIM_INFINITY else 1 << 20
    except (ImportError, ValueError, OSError):
        return 1 << 20


class RangeGetClient:
    """GETs of one bucket's objects, whole or by byte range, on the calling loop."""

    def __init__(self, endpoint: str, bucket: str, region: str, credentials: StaticCredentials | None, *,
                 virtual_hosted: bool = False, timeout_s: float = 60.0, connect_timeout_s: float = 5.0,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, verify_tls: bool = True):
        u = urlsplit(endpoint)
        if u.scheme not in ("http", "https") or not u.hostname or u.path.strip("/") or u.query:
            raise ValueError(f"unsupported endpoint for direct GETs: {endpoint!r}")
        self.host = u.hostname if not virtual_hosted else f"{bucket}.{u.hostname}"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        default_port = (u.scheme == "https" and self.port == 443) or (u.scheme == "http" and self.port == 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if default_port else f"{host}:{self.port}"
        self.prefix = "/" if virtual_hosted else f"/{quote(bucket, safe='')}/"
        self.signer = SigV4(credentials, region) if credentials is not None else None
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        # GETs past this wait for a free connection instead of failing on "too many open files"
        self.max_connections = max(1, min(max_connections, _open_files_limit() // 2))
        self.ssl: ssl.SSLContext | None = None
        if u.scheme == "https":
            self.ssl = ssl.create_default_context()
            if not verify_tls:
                self.ssl.check_hostname = False
                self.ssl.verify_mode = ssl.CERT_NONE
        self._pools: dict[int, _Pool] = {}
        self._paths: dict[str, str] = {}  # key -> URI-encoded request path (a dataset's few files, read often)
        #: GETs done here, and GETs handed back to the caller (to obstore)
        self.done = 0
        self.handed_back = 0

    def _pool(self) -> _Pool:
        loop = asyncio.get_running_loop()
        pool = self._pools.get(id(loop))
        if pool is None or pool.loop is not loop:
            self._pools = {k: p for k, p in self._pools.items() if not p.loop.is_closed()}
            pool = self._pools[id(loop)] = _Pool(self, loop)
        return pool

    def request(self, key: str, start: int, end: int, now: float | None = None) -> bytes:
        """The request bytes of a GET of `key`, bytes [start, end) (end -1: to its end)."""
        path = self._paths.get(key)
        if path is None:
            if len(self._paths) > 65536:
                self._paths.clear()
            path = self._paths[key] = self.prefix + quote(key, safe="/")
        rng = None if end < 0 and start == 0 else (f"bytes={start}-" if end < 0 else f"bytes={start}-{end - 1}")
        head = f"GET {path} HTTP/1.1\r\nHost: {self.host_header}\r\n"
        if rng is not None:
            head += f"Range: {rng}\r\n"
        if self.signer is not None:
            head += self.signer.headers(self.host_header, path, rng, now)
        return (head + "\r\n").encode()

    def get(self, key: str, start: int, end: int, done: Done) -> None:
        """GET bytes [start, end) of `key` (end -1: to its end); `done(body, None)` on the
        loop, or `done(None, reason)`: not done here, do it another way."""
        def counted(body: bytes | None, reason: str | None) -> None:
            if body is None:
                self.handed_back += 1
            else:
                self.done += 1
            done(body, reason)

        ranged = None if end < 0 and start == 0 else (start, None if end < 0 else end)
        self._pool().submit(self.request(key, start, end), counted, ranged)

    def close(self) -> None:
        for pool in self._pools.values():
            if not pool.loop.is_closed():
                pool.close()
        self._pools.clear()
