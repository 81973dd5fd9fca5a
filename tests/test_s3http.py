"""S3 GETs on the event loop (server/storage/s3http.py): signed as the AWS SDK signs, done
against real S3 servers on loopback, and every GET it does not complete handed to obstore,
whose answers and errors then apply unchanged."""

from __future__ import annotations

import asyncio
import calendar
import random
import ssl
import time
from pathlib import Path
from urllib.parse import quote

import pytest
from certs import make_certs, needs_openssl
from s3_fixtures import CREDENTIALS, S3Backend, moto_backend, own_backend, s3  # noqa: F401

from croupier.bench.faults import CuttableProxy
from croupier.bench.s3server import Latency, running
from croupier.server.storage.objectstore import BucketNotFoundError, ObjectStore
from croupier.server.storage.s3http import RangeGetClient, SigV4, StaticCredentials

DATA = random.Random(3).randbytes(200_000)


def _botocore_authorization(url: str, headers: dict[str, str], creds: StaticCredentials, region: str) -> tuple[str, float]:
    """botocore's Authorization header for a GET of `url`, and the time it signed at."""
    botocore = pytest.importorskip("botocore")
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    del botocore
    req = AWSRequest(method="GET", url=url, headers=dict(headers))
    S3SigV4Auth(Credentials(creds.access_key_id, creds.secret_access_key, creds.session_token), "s3", region).add_auth(req)
    when = calendar.timegm(time.strptime(req.headers["X-Amz-Date"], "%Y%m%dT%H%M%SZ"))
    return req.headers["Authorization"], float(when)


@pytest.mark.parametrize(
    "endpoint,key,rng,token,virtual",
    [
        ("https://s3.eu-west-1.amazonaws.com", "data/part-0.arrow", (100, 1124), None, False),
        ("https://s3.eu-west-1.amazonaws.com", "data/part-0.arrow", (0, -1), "FwoGZX-session", False),
        ("https://minio.example:9443", "images/a cat+dog/ünï €.jpg", (5, -1), None, False),
        ("https://s3.eu-west-1.amazonaws.com", "x/y.tar", (7, 8), None, True),
    ],
)
def test_requests_are_signed_as_botocore_signs_them(endpoint: str, key: str, rng: tuple[int, int], token: str | None,
                                                    virtual: bool) -> None:
    creds = StaticCredentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    client = RangeGetClient(endpoint, "my-bucket", "eu-west-1", creds, virtual_hosted=virtual)
    start, end = rng
    headers = {}
    if not (start == 0 and end < 0):
        headers["Range"] = f"bytes={start}-" if end < 0 else f"bytes={start}-{end - 1}"
    # keys percent-encoded as botocore's S3 serializer encodes them before signing
    url = f"{endpoint.replace('://', '://my-bucket.') if virtual else endpoint + '/my-bucket'}/{quote(key, safe='/~')}"
    want, when = _botocore_authorization(url, headers, creds, "eu-west-1")
    request = client.request(key, start, end, now=when).decode()
    lines = dict(line.split(": ", 1) for line in request.split("\r\n")[1:] if ": " in line)
    assert lines["Authorization"] == want
    assert (lines.get("x-amz-security-token")) == token
    assert lines["Host"] == client.host_header == (("my-bucket." if virtual else "") + endpoint.split("://")[1].replace(":443", ""))


def test_a_signing_key_is_made_once_a_day() -> None:
    signer = SigV4(StaticCredentials("k", "s"), "us-east-1")
    signer.headers("h", "/b/k", None, now=86400 * 20000 + 5)
    first = signer._key
    signer.headers("h", "/b/k", None, now=86400 * 20000 + 80000)
    assert signer._key is first
    signer.headers("h", "/b/k", None, now=86400 * 20001 + 1)
    assert signer._key != first


def test_range_and_whole_gets_are_done_on_the_loop_with_no_obstore_call(s3: S3Backend) -> None:
    bucket = s3.make_bucket({"d/blob.bin": DATA, "d/empty.bin": b""})
    store = ObjectStore(bucket, options=s3.options())
    assert store.fast is not None, store.fast_off_reason
    n = len(DATA)
    cases = [(0, 10), (1000, 4096), (n - 5, 100), (n, 10), (0, -1), (n - 7, -1), (123, 0)]

    async def go() -> None:
        for offset, size in cases:
            want = DATA[offset:] if size < 0 else DATA[offset:offset + size]
            assert await store.read("d/blob.bin", offset, size) == want, (offset, size)
        assert await store.read("d/empty.bin", 0, -1) == b""
        # the callback path, with neighbours merged into one GET and a far range apart
        got: list = []
        landed = asyncio.get_running_loop().create_future()
        assert store.submit_ranges("d/blob.bin", [(10, 5), (20, 5), (150_000, 3), (7, 0)],
                                   lambda parts, err: (got.append((parts, err)), landed.set_result(None)))
        await landed
        assert got == [([DATA[10:15], DATA[20:25], DATA[150_000:150_003], b""], None)]

    asyncio.run(go())
    assert store.fast.done >= len(cases) + 2 and store.fast.handed_back == 0
    assert store.stats.errors == 0 and store.stats.in_flight == 0


def test_errors_come_from_obstore_unchanged(s3: S3Backend) -> None:
    bucket = s3.make_bucket({"d/blob.bin": DATA})
    store = ObjectStore(bucket, options=s3.options(max_retries=0))

    async def missing_key() -> None:
        await store.read("d/nope.bin", 0, 10)

    with pytest.raises(FileNotFoundError, match=f"s3://{bucket}/d/nope.bin"):
        asyncio.run(missing_key())
    assert store.fast.handed_back == 1
    s3.drop_bucket(bucket)
    errors: list = []

    async def gone() -> None:
        landed = asyncio.get_running_loop().create_future()
        store.submit_ranges("d/blob.bin", [(0, 10)], lambda parts, err: (errors.append(err), landed.set_result(None)))
        await landed

    asyncio.run(gone())
    assert isinstance(errors[0], BucketNotFoundError) and bucket in str(errors[0])


def test_a_get_whose_connection_drops_is_done_by_obstore() -> None:
    # 300 ms in the server: the GET is cut while it waits there, counted in flight
    with running(None, latency=Latency.fixed(300)) as srv:
        bucket = S3Backend("s3server", srv.endpoint, srv).make_bucket({"d/blob.bin": DATA})
        proxy = CuttableProxy(int(srv.endpoint.rsplit(":", 1)[1]))
        store = ObjectStore(bucket, options={**CREDENTIALS, "endpoint": f"http://{proxy.address}"})

        async def go() -> tuple[bytes, int]:
            read = asyncio.ensure_future(store.read("d/blob.bin", 500, 1000))
            for _ in range(500):  # bounded: 5 s
                if (await asyncio.to_thread(srv.stats))["in_flight"] >= 1:
                    break
                await asyncio.sleep(0.01)
            cut = await asyncio.to_thread(proxy.cut)
            return await read, cut

        try:
            data, cut = asyncio.run(go())
        finally:
            proxy.close()
    assert data == DATA[500:1500] and cut == 2  # the client's side and the server's
    assert store.fast.handed_back == 1 and store.fast.done == 0


@needs_openssl
def test_https_endpoints_are_read_directly_and_their_certificates_checked(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(certs.server_cert, certs.server_key)
    with running(None) as srv:
        bucket = S3Backend("s3server", srv.endpoint, srv).make_bucket({"d/blob.bin": DATA})
        proxy = CuttableProxy(int(srv.endpoint.rsplit(":", 1)[1]), tls=tls)

        async def go(**extra):
            store = ObjectStore(bucket, options={**CREDENTIALS, "endpoint": f"https://{proxy.address}",
                                                 "max_retries": 0, **extra})
            return await store.read("d/blob.bin", 100, 50), store

        try:
            # a certificate no system CA signed: neither way reads through it
            with pytest.raises(OSError):
                asyncio.run(go())
            data, store = asyncio.run(go(allow_invalid_certificates=True))
        finally:
            proxy.close()
    assert data == DATA[100:150] and store.fast.done == 1 and store.fast.handed_back == 0


def test_the_direct_path_is_used_only_where_it_signs_as_obstore_would(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "CROUPIER_S3_FAST_GET"):
        monkeypatch.delenv(name, raising=False)
    endpoint = "http://127.0.0.1:9"
    assert ObjectStore("b1", options={**CREDENTIALS, "endpoint": endpoint}).fast is not None
    assert ObjectStore("b1", options={"endpoint": endpoint, "skip_signature": True}).fast is not None
    off = ObjectStore("b1", options={"endpoint": endpoint})  # no keys: obstore's provider chain
    assert off.fast is None and "static keys" in off.fast_off_reason
    for value in (False, "false", "0"):  # --storage-option fast_get=false gives the string
        off = ObjectStore("b1", options={**CREDENTIALS, "endpoint": endpoint, "fast_get": value})
        assert off.fast is None and "turned off" in off.fast_off_reason
    off = ObjectStore("b1", options={**CREDENTIALS, "endpoint": endpoint, "proxy_url": "http://127.0.0.1:3128"})
    assert off.fast is None and "proxy" in off.fast_off_reason
    monkeypatch.setenv("CROUPIER_S3_FAST_GET", "0")
    assert ObjectStore("b1", options={**CREDENTIALS, "endpoint": endpoint}).fast is None
    monkeypatch.setenv("CROUPIER_S3_FAST_GET", "1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    assert ObjectStore("b1", options={"endpoint": endpoint}).fast is not None


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.state = "open"

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.state = "closed"

    def abort(self) -> None:
        self.state = "aborted"


class _Pool:
    def __init__(self) -> None:
        self.released: list = []

    def release(self, conn) -> None:
        self.released.append(conn)

    def lost(self, conn) -> None:
        pass


def _answer(chunks: list[bytes], ranged=(10, 15)):
    from croupier.server.storage.s3http import _Connection

    pool, transport, got = _Pool(), _Transport(), []
    conn = _Connection(pool)  # type: ignore[arg-type]
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.send(b"GET ...", lambda body, reason: got.append((body, reason)), ranged)
    for c in chunks:
        conn.data_received(c)
    return got, transport.state, bool(pool.released)


def test_answers_are_parsed_whatever_their_pieces_and_anything_odd_is_handed_back() -> None:
    ok = b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 10-14/99\r\nContent-Length: 5\r\n\r\nhello"
    for cut in (1, 20, len(ok) - 5, len(ok) - 1):  # split anywhere: head, body
        assert _answer([ok[:cut], ok[cut:]]) == ([(b"hello", None)], "open", True)
    assert _answer([b"HTTP/1.1 200 OK\r\ncontent-length:20\r\n\r\n" + bytes(range(65, 85))]) == \
        ([(bytes(range(75, 80)), None)], "open", True)  # Range ignored: the slice is cut here
    assert _answer([b"HTTP/1.1 416 Range Not Satisfiable\r\nContent-Length: 3\r\n\r\nxyz"])[0] == [(b"", None)]
    assert _answer([b"HTTP/1.1 206 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\nz"]) == ([(b"z", None)], "closed", False)
    assert _answer([b"HTTP/1.0 206 OK\r\nContent-Length: 1\r\n\r\nz"])[1] == "closed"
    assert _answer([b"HTTP/1.0 206 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\nz"])[1] == "open"
    assert _answer([b"HTTP/1.1 206 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\nz"])[1] == "open"
    # handed back: errors, chunked bodies, no length, garbage; the connection is not reused
    assert _answer([b"HTTP/1.1 503 Slow Down\r\nContent-Length: 2\r\n\r\nno"])[0] == [(None, "HTTP 503")]
    for bad in (b"HTTP/1.1 206 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
                b"HTTP/1.1 206 OK\r\n\r\nhello", b"SPAM\r\n\r\n", b"HTTP/1.1 2x6 OK\r\nContent-Length: 1\r\n\r\nz"):
        got, state, reused = _answer([bad])
        assert got[0][0] is None and state == "aborted" and not reused, bad
    # the connection, released, takes the next GET at once: this answer keeps its own range
    from croupier.server.storage.s3http import _Connection

    class Busy(_Pool):
        def release(self, conn) -> None:
            conn.send(b"GET next", lambda body, reason: None, (0, 1))

    got: list = []
    conn = _Connection(Busy())  # type: ignore[arg-type]
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    conn.send(b"GET ...", lambda body, reason: got.append(body), (10, 15))
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n" + bytes(range(65, 85)))
    assert got == [bytes(range(75, 80))]
    got, state, reused = _answer([ok + b"HTTP/1.1 206"])  # more than was asked: not trusted
    assert got == [(b"hello", None)] and state == "closed" and not reused


def test_gets_past_the_connection_cap_wait_for_a_free_connection_and_all_land(s3: S3Backend) -> None:
    bucket = s3.make_bucket({"d/blob.bin": DATA})
    store = ObjectStore(bucket, options=s3.options())
    store.fast.max_connections = 3
    offsets = [i * 997 for i in range(40)]

    async def go() -> list[bytes]:
        out = await asyncio.gather(*(store.read("d/blob.bin", o, 100) for o in offsets))
        pool = store.fast._pool()
        assert len(pool.idle) + len(pool.busy) <= 3 and not pool.waiting
        return out

    assert asyncio.run(go()) == [DATA[o:o + 100] for o in offsets]
    assert store.fast.done == 40 and store.fast.handed_back == 0


def test_an_endpoint_that_refuses_connections_is_handed_to_obstore_which_names_it() -> None:
    import socket

    from croupier.server.storage.objectstore import ObjectStoreConnectionError

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = ObjectStore("bench", options={**CREDENTIALS, "endpoint": f"http://127.0.0.1:{port}", "max_retries": 0})

    async def go() -> bytes:
        return await store.read("d/blob.bin", 0, 10)

    with pytest.raises(ObjectStoreConnectionError, match=f"127.0.0.1:{port}"):
        asyncio.run(go())
    assert store.fast.handed_back == 1 and store.fast.done == 0
