"""A small, fast S3-protocol server on loopback, serving a local folder, with a stated latency.

For tests and benchmarks of object-store reads: each top-level folder of `root` is a
bucket and each file below it an object (key = its path under the bucket folder, with
'/' separators). Every request waits a latency drawn from a seeded distribution before
it is answered, in the server, the way a remote store makes its clients wait; the k-th
request gets the k-th draw. Nothing here verifies signatures or permissions, and it
binds loopback addresses only.

Why not moto's server mode: on a 2-core machine it serves ~200 range GETs/s whatever the
concurrency (a thread per request, Flask and a full S3 model on each), while a data server
reading 1 KB rows wants thousands of 20 ms GETs in flight. This one is an asyncio HTTP/1.1
protocol on uvloop: a request costs a parse, an open/pread/close and one write, and
waiting out its latency costs a timer, not a thread. Tests check it against moto too.

Operations (path-style addressing, what obstore and boto3 send to an http endpoint):

* GetObject (Range: bytes=a-b, a-, -n; 206 + Content-Range; 416 InvalidRange when the
  range starts at or past the end, as S3 does), HeadObject, PutObject (plain,
  `Transfer-Encoding: chunked` and `aws-chunked` bodies; `If-None-Match: *`), CopyObject,
  DeleteObject, DeleteObjects;
* ListObjectsV2 (prefix, delimiter, max-keys, continuation-token, start-after,
  encoding-type=url) and ListObjects (v1, marker), ListBuckets, CreateBucket,
  HeadBucket, DeleteBucket (BucketNotEmpty when it holds objects), GetBucketLocation;
* errors as S3 writes them (XML <Error><Code>NoSuchKey</Code>... with 404/409/412/416);
  HEAD errors have no body. Multipart uploads, versions, ACLs, tagging: 501 NotImplemented.

Keys must be representable as file paths: no empty, '.' or '..' segments, no trailing
'/', and a key cannot be both an object and a "folder" of other keys (409).

    python -m croupier.bench.s3server --root DIR --port 9000 --median-ms 20 --sigma 0.5
    AWS_ENDPOINT_URL=http://127.0.0.1:9000 croupier serve ... s3://bucket/dataset

In Python:

    with running(None, latency=Latency.fixed(20)) as s3:   # a fresh temporary root
        s3.create_bucket("data"); s3.put("data", "x.bin", b"...")
        ... s3.endpoint ... s3.stats()["max_in_flight"]

`GET /_s3server/stats` returns the counters as JSON (`POST /_s3server/reset` zeroes
them); those control requests are neither delayed nor counted.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import email.utils
import ipaddress
import json
import math
import os
import random
import re
import shutil
import signal
import stat
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from xml.etree import ElementTree
from xml.sax.saxutils import escape

# ---------------------------------------------------------------------------------------
# latency
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Latency:
    """Per-request latency: fixed, uniform or lognormal, in milliseconds, seeded.

    `sampler()` returns a function giving the next draw in seconds; a server calls it once
    per request, in arrival order, so the k-th request waits the k-th draw of `draws()`."""

    kind: str = "fixed"  # fixed | uniform | lognormal
    ms: float = 0.0  # fixed: the latency; uniform: the low end; lognormal: the median
    high_ms: float = 0.0  # uniform: the high end
    sigma: float = 0.0  # lognormal: sigma of the underlying normal
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"latency kind must be fixed, uniform or lognormal, not {self.kind!r}")
        if self.ms < 0 or self.high_ms < 0 or self.sigma < 0:
            raise ValueError(f"latency parameters must not be negative: {self}")
        if self.kind == "uniform" and self.high_ms < self.ms:
            raise ValueError(f"uniform latency needs low <= high, got {self.ms} > {self.high_ms}")

    @classmethod
    def fixed(cls, ms: float) -> Latency:
        return cls("fixed", float(ms))

    @classmethod
    def uniform(cls, low_ms: float, high_ms: float, seed: int = 0) -> Latency:
        return cls("uniform", float(low_ms), float(high_ms), seed=seed)

    @classmethod
    def lognormal(cls, median_ms: float, sigma: float, seed: int = 0) -> Latency:
        return cls("lognormal", float(median_ms), sigma=float(sigma), seed=seed)

    @classmethod
    def of(cls, value: Latency | float | int | None) -> Latency:
        """A Latency from itself, a number of milliseconds (fixed) or None (none)."""
        if value is None:
            return cls()
        if isinstance(value, Latency):
            return value
        return cls.fixed(float(value))

    def sampler(self) -> Callable[[], float]:
        """The draws in order, in seconds."""
        if self.kind == "fixed" or (self.kind == "lognormal" and self.sigma == 0):
            value = self.ms / 1000.0
            return lambda: value
        rng = random.Random(self.seed)
        if self.kind == "uniform":
            lo, hi = self.ms / 1000.0, self.high_ms / 1000.0
            return lambda: rng.uniform(lo, hi)
        if self.ms == 0:
            return lambda: 0.0
        mu, sigma = math.log(self.ms / 1000.0), self.sigma
        return lambda: rng.lognormvariate(mu, sigma)

    def draws(self, n: int) -> list[float]:
        """The first `n` draws, in milliseconds."""
        draw = self.sampler()
        return [draw() * 1000.0 for _ in range(n)]

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed {self.ms:g} ms"
        if self.kind == "uniform":
            return f"uniform {self.ms:g}-{self.high_ms:g} ms (seed {self.seed})"
        return f"lognormal median {self.ms:g} ms sigma {self.sigma:g} (seed {self.seed})"

    def to_args(self) -> list[str]:
        if self.kind == "uniform":
            return ["--uniform-ms", str(self.ms), str(self.high_ms), "--seed", str(self.seed)]
        return ["--median-ms", str(self.ms), "--sigma", str(self.sigma if self.kind == "lognormal" else 0.0),
                "--seed", str(self.seed)]


# ---------------------------------------------------------------------------------------
# S3 responses
# ---------------------------------------------------------------------------------------

_S3_NS = "http://s3.amazonaws.com/doc/2006-03-01/"
_XML_HEAD = '<?xml version="1.0" encoding="UTF-8"?>\n'
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_TMP_DIR = ".s3server-tmp"
_CONTROL = "/_s3server/"
_REASONS = {200: "OK", 204: "No Content", 206: "Partial Content", 400: "Bad Request", 403: "Forbidden",
            404: "Not Found", 405: "Method Not Allowed", 409: "Conflict", 411: "Length Required",
            412: "Precondition Failed", 416: "Range Not Satisfiable", 500: "Internal Server Error",
            501: "Not Implemented"}
#: Bodies larger than this are streamed from the file in chunks, under flow control.
_STREAM_ABOVE = 1 << 20
_CHUNK = 256 << 10


class S3Error(Exception):
    def __init__(self, status: int, code: str, message: str, **extra: str):
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra


def _no_such_bucket(bucket: str) -> S3Error:
    return S3Error(404, "NoSuchBucket", "The specified bucket does not exist", BucketName=bucket)


def _no_such_key(bucket: str, key: str) -> S3Error:
    return S3Error(404, "NoSuchKey", "The specified key does not exist.", Key=key, BucketName=bucket)


@dataclass
class _FileBody:
    path: str
    offset: int
    length: int


@dataclass
class Response:
    status: int
    headers: list[tuple[str, str]]
    body: bytes | _FileBody = b""


def _http_date(t: float) -> str:
    return email.utils.formatdate(t, usegmt=True)


_date_cache: dict[int, str] = {}


def _http_date_cached(t: float) -> str:
    """`_http_date` at one-second resolution (what the header carries), memoised."""
    sec = int(t)
    text = _date_cache.get(sec)
    if text is None:
        if len(_date_cache) > 4096:
            _date_cache.clear()
        text = _date_cache[sec] = _http_date(sec)
    return text


def _iso_date(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def _etag(st: os.stat_result) -> str:
    # Not an MD5 (that would read whole files on every list): size and mtime, which change
    # when the content is rewritten, as an ETag must.
    return f'"{st.st_size:x}{st.st_mtime_ns:016x}"'


def _xml(root: str, body: str) -> bytes:
    return f'{_XML_HEAD}<{root} xmlns="{_S3_NS}">{body}</{root}>'.encode()


def _el(tag: str, value: Any) -> str:
    return f"<{tag}>{escape(str(value))}</{tag}>"


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """(start, end exclusive) of a `Range: bytes=...` header; None: serve the whole object."""
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None  # like S3: an unsupported or multiple range returns the whole object
    first, dash, last = spec.strip().partition("-")
    if not dash:
        return None
    try:
        if not first:  # suffix: the last n bytes
            n = int(last)
            if n <= 0:
                raise S3Error(416, "InvalidRange", "The requested range is not satisfiable",
                              ActualObjectSize=str(size), RangeRequested=header)
            return max(size - n, 0), size
        start = int(first)
        end = size if not last else min(int(last) + 1, size)
    except ValueError:
        return None
    if start >= size or (last and int(last) < start):
        raise S3Error(416, "InvalidRange", "The requested range is not satisfiable",
                      ActualObjectSize=str(size), RangeRequested=spec.strip())
    return start, end


def _dechunk(buf: bytearray | bytes, pos: int) -> tuple[bytes, int] | None:
    """Decode a chunked body (HTTP chunked or aws-chunked) from `pos`: (data, end), or None
    while incomplete. Chunk extensions (';chunk-signature=...') and trailers are skipped."""
    parts = []
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buf[pos:eol]).split(b";", 1)[0].strip() or b"0", 16)
        pos = eol + 2
        if size == 0:
            while True:  # trailers, up to an empty line
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    return None
                if eol == pos:
                    return b"".join(parts), eol + 2
                pos = eol + 2
        if len(buf) < pos + size + 2:
            return None
        parts.append(bytes(buf[pos:pos + size]))
        pos += size + 2


@dataclass
class Request:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


# ---------------------------------------------------------------------------------------
# the bucket folder
# ---------------------------------------------------------------------------------------


_UNSUPPORTED = frozenset({"uploads", "uploadId", "acl", "tagging", "versioning", "versionId", "policy", "cors",
                          "lifecycle", "website", "encryption", "object-lock", "retention", "legal-hold", "torrent",
                          "restore", "select", "attributes", "versions"})


class Backend:
    """S3 semantics over a folder: one subfolder per bucket, one file per object."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self.tmp = os.path.join(self.root, _TMP_DIR)
        # (bucket, prefix, delimiter) -> (generation, sorted listing), for the pages after the first
        self._generation = 0
        self._listing_cache: dict[tuple[str, str, str | None], tuple[int, list[tuple[str, Any]]]] = {}

    # ---- paths -----------------------------------------------------------------------
    def bucket_dir(self, bucket: str, must_exist: bool = True) -> str:
        if not _BUCKET_RE.match(bucket):
            if must_exist:
                raise _no_such_bucket(bucket)
            raise S3Error(400, "InvalidBucketName", "The specified bucket is not valid.", BucketName=bucket)
        path = os.path.join(self.root, bucket)
        if must_exist and not os.path.isdir(path):
            raise _no_such_bucket(bucket)
        return path

    def object_path(self, bucket: str, key: str) -> str:
        """The file of `bucket`/`key` (the bucket's existence is not checked)."""
        parts = key.split("/")
        if not key or "\0" in key or "" in parts or "." in parts or ".." in parts or len(key) > 1024:
            raise S3Error(400, "InvalidArgument", f"this server stores keys as file paths and cannot store {key!r}",
                          Key=key)
        if not _BUCKET_RE.match(bucket):
            raise _no_such_bucket(bucket)
        return os.path.join(self.root, bucket, *parts)

    def _stat(self, bucket: str, key: str) -> tuple[str, os.stat_result]:
        path = self.object_path(bucket, key)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            self.bucket_dir(bucket)  # NoSuchBucket first
            raise _no_such_key(bucket, key)
        return path, st

    def _changed(self) -> None:
        self._generation += 1
        self._listing_cache.clear()

    # ---- buckets ---------------------------------------------------------------------
    def list_buckets(self) -> Response:
        names = sorted(n for n in os.listdir(self.root) if _BUCKET_RE.match(n) and os.path.isdir(os.path.join(self.root, n)))
        items = "".join(f"<Bucket>{_el('Name', n)}{_el('CreationDate', _iso_date(os.stat(os.path.join(self.root, n)).st_mtime))}</Bucket>"
                        for n in names)
        owner = "<Owner><ID>croupier</ID><DisplayName>croupier</DisplayName></Owner>"
        return Response(200, [("Content-Type", "application/xml")], _xml("ListAllMyBucketsResult", f"{owner}<Buckets>{items}</Buckets>"))

    def create_bucket(self, bucket: str) -> Response:
        path = self.bucket_dir(bucket, must_exist=False)
        if os.path.isdir(path):
            raise S3Error(409, "BucketAlreadyOwnedByYou",
                          "Your previous request to create the named bucket succeeded and you already own it.", BucketName=bucket)
        os.makedirs(path)
        self._changed()
        return Response(200, [("Location", f"/{bucket}")])

    def head_bucket(self, bucket: str) -> Response:
        self.bucket_dir(bucket)
        return Response(200, [("x-amz-bucket-region", "us-east-1")])

    def delete_bucket(self, bucket: str) -> Response:
        path = self.bucket_dir(bucket)
        for _, _, files in os.walk(path):
            if files:
                raise S3Error(409, "BucketNotEmpty", "The bucket you tried to delete is not empty", BucketName=bucket)
        shutil.rmtree(path)
        self._changed()
        return Response(204, [])

    def bucket_location(self, bucket: str) -> Response:
        self.bucket_dir(bucket)
        return Response(200, [("Content-Type", "application/xml")], _xml("LocationConstraint", ""))

    # ---- objects ---------------------------------------------------------------------
    def get_object(self, bucket: str, key: str, headers: dict[str, str], head: bool) -> Response:
        path, st = self._stat(bucket, key)
        size = st.st_size
        out = [("Last-Modified", _http_date_cached(st.st_mtime)), ("ETag", _etag(st)), ("Accept-Ranges", "bytes"),
               ("Content-Type", "application/octet-stream")]
        rng = headers.get("range")
        span = _parse_range(rng, size) if rng and not head else None
        if span is None:
            out.append(("Content-Length", str(size)))
            return Response(200, out, b"" if head else _FileBody(path, 0, size))
        start, end = span
        out += [("Content-Range", f"bytes {start}-{end - 1}/{size}"), ("Content-Length", str(end - start))]
        return Response(206, out, _FileBody(path, start, end - start))

    def put_object(self, bucket: str, key: str, headers: dict[str, str], body: bytes) -> Response:
        path = self.object_path(bucket, key)
        if headers.get("if-none-match", "").strip() == "*" and os.path.isfile(path):
            raise S3Error(412, "PreconditionFailed", "At least one of the pre-conditions you specified did not hold",
                          Condition="If-None-Match")
        source = headers.get("x-amz-copy-source")
        if source is not None:
            sbucket, _, skey = urllib.parse.unquote(source.split("?", 1)[0]).lstrip("/").partition("/")
            spath, _ = self._stat(sbucket, skey)
            with open(spath, "rb") as f:
                body = f.read()
        self._write_file(bucket, key, path, body)
        st = os.stat(path)
        if source is not None:
            result = _el("ETag", _etag(st)) + _el("LastModified", _iso_date(st.st_mtime))
            return Response(200, [("Content-Type", "application/xml")], _xml("CopyObjectResult", result))
        return Response(200, [("ETag", _etag(st))])

    def _write_file(self, bucket: str, key: str, path: str, body: bytes) -> None:
        bdir = self.bucket_dir(bucket)
        parent = os.path.dirname(path)
        # a key cannot be a file and a folder of keys at once on a file system
        probe = parent
        while len(probe) > len(bdir):
            if os.path.isfile(probe):
                raise S3Error(409, "KeyConflict", f"{os.path.relpath(probe, bdir)} is an object, so it cannot be a "
                              "folder of keys on this file-backed server", Key=key)
            probe = os.path.dirname(probe)
        if os.path.isdir(path):
            raise S3Error(409, "KeyConflict", f"{key} is a folder of keys, so it cannot be an object on this "
                          "file-backed server", Key=key)
        os.makedirs(parent, exist_ok=True)
        os.makedirs(self.tmp, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.tmp)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._changed()

    def delete_object(self, bucket: str, key: str) -> Response:
        path = self.object_path(bucket, key)
        self.bucket_dir(bucket)
        if os.path.isfile(path):
            os.unlink(path)
            self._prune(bucket, os.path.dirname(path))
            self._changed()
        return Response(204, [])

    def _prune(self, bucket: str, folder: str) -> None:
        """Remove folders left empty, as S3 has no empty "folders"."""
        bdir = self.bucket_dir(bucket)
        while len(folder) > len(bdir):
            try:
                os.rmdir(folder)
            except OSError:
                return
            folder = os.path.dirname(folder)

    def delete_objects(self, bucket: str, body: bytes) -> Response:
        self.bucket_dir(bucket)
        try:
            tree = ElementTree.fromstring(body)
        except ElementTree.ParseError:
            raise S3Error(400, "MalformedXML", "The XML you provided was not well-formed") from None
        quiet = False
        deleted, errors = [], []
        for el in tree.iter():
            tag = el.tag.rsplit("}", 1)[-1]
            if tag == "Quiet":
                quiet = (el.text or "").strip().lower() == "true"
            elif tag == "Object":
                key = next((c.text or "" for c in el if c.tag.rsplit("}", 1)[-1] == "Key"), "")
                try:
                    self.delete_object(bucket, key)
                    deleted.append(key)
                except S3Error as e:
                    errors.append((key, e))
        out = "" if quiet else "".join(f"<Deleted>{_el('Key', k)}</Deleted>" for k in deleted)
        out += "".join(f"<Error>{_el('Key', k)}{_el('Code', e.code)}{_el('Message', e.message)}</Error>" for k, e in errors)
        return Response(200, [("Content-Type", "application/xml")], _xml("DeleteResult", out))

    # ---- listing ---------------------------------------------------------------------
    def _nonempty(self, folder: str) -> bool:
        for _, _, files in os.walk(folder):
            if files:
                return True
        return False

    def _entries(self, bucket: str, prefix: str, delimiter: str | None, fresh: bool) -> list[tuple[str, Any]]:
        """Sorted (key, stat) objects and (common prefix, None) under `prefix`. A first page
        (`fresh`) walks the folder; the pages after it reuse that walk unless the server wrote
        since (files changed under the server by others show up on the next first page)."""
        bdir = self.bucket_dir(bucket)
        folder_key, _, name_prefix = prefix.rpartition("/")
        folder = os.path.join(bdir, *folder_key.split("/")) if folder_key else bdir
        if folder_key and any(p in ("", ".", "..") for p in folder_key.split("/")):
            return []
        cache_key = (bucket, prefix, delimiter)
        cached = self._listing_cache.get(cache_key)
        if not fresh and cached is not None and cached[0] == self._generation:
            return cached[1]
        base = folder_key + "/" if folder_key else ""
        out: list[tuple[str, Any]] = []
        try:
            scan = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            scan = []
        if delimiter == "/":
            for e in scan:
                if not e.name.startswith(name_prefix):
                    continue
                if e.is_file():
                    out.append((base + e.name, e.stat()))
                elif e.is_dir() and self._nonempty(e.path):
                    out.append((base + e.name + "/", None))
        else:
            keys: list[tuple[str, Any]] = []
            for e in scan:
                if not e.name.startswith(name_prefix):
                    continue
                if e.is_file():
                    keys.append((base + e.name, e.stat()))
                elif e.is_dir():
                    for dirpath, _, files in os.walk(e.path):
                        rel = os.path.relpath(dirpath, bdir).replace(os.sep, "/")
                        keys.extend((f"{rel}/{f}", os.stat(os.path.join(dirpath, f))) for f in files)
            if delimiter:
                seen: set[str] = set()
                for key, st in keys:
                    cut = key.find(delimiter, len(prefix))
                    if cut < 0:
                        out.append((key, st))
                    elif (cp := key[:cut + len(delimiter)]) not in seen:
                        seen.add(cp)
                        out.append((cp, None))
            else:
                out = keys
        out.sort(key=lambda kv: kv[0])
        self._listing_cache[cache_key] = (self._generation, out)
        if len(self._listing_cache) > 64:
            self._listing_cache.pop(next(iter(self._listing_cache)))
        return out

    def list_objects(self, bucket: str, query: dict[str, str]) -> Response:
        v2 = query.get("list-type") == "2"
        prefix = query.get("prefix", "")
        delimiter = query.get("delimiter") or None
        try:
            max_keys = max(0, min(int(query.get("max-keys", "1000")), 1000))
        except ValueError:
            raise S3Error(400, "InvalidArgument", "max-keys must be an integer") from None
        url_encode = query.get("encoding-type") == "url"
        token = query.get("continuation-token")
        if v2:
            after = query.get("start-after", "")
            if token:
                try:
                    after = base64.urlsafe_b64decode(token.encode()).decode()
                except ValueError:
                    raise S3Error(400, "InvalidArgument", "The continuation token provided is incorrect") from None
        else:
            after = query.get("marker", "")
        entries = self._entries(bucket, prefix, delimiter, fresh=not after)
        page: list[tuple[str, Any]] = []
        truncated = False
        for key, st in entries:
            if after and (key <= after or (delimiter and after.endswith(delimiter) and key.startswith(after))):
                continue
            if len(page) == max_keys:
                truncated = True
                break
            page.append((key, st))

        def enc(s: str) -> str:
            return urllib.parse.quote(s, safe="/") if url_encode else s

        parts = [_el("Name", bucket), _el("Prefix", enc(prefix)), _el("MaxKeys", max_keys)]
        if delimiter:
            parts.append(_el("Delimiter", enc(delimiter)))
        if url_encode:
            parts.append(_el("EncodingType", "url"))
        parts.append(_el("IsTruncated", "true" if truncated else "false"))
        if v2:
            parts.append(_el("KeyCount", len(page)))
            if token:
                parts.append(_el("ContinuationToken", token))
            if query.get("start-after"):
                parts.append(_el("StartAfter", enc(query["start-after"])))
            if truncated and page:
                parts.append(_el("NextContinuationToken", base64.urlsafe_b64encode(page[-1][0].encode()).decode()))
        else:
            parts.append(_el("Marker", enc(after)))
            if truncated and page:
                parts.append(_el("NextMarker", enc(page[-1][0])))
        for key, st in page:
            if st is None:
                parts.append(f"<CommonPrefixes>{_el('Prefix', enc(key))}</CommonPrefixes>")
            else:
                parts.append(f"<Contents>{_el('Key', enc(key))}{_el('LastModified', _iso_date(st.st_mtime))}"
                             f"{_el('ETag', _etag(st))}{_el('Size', st.st_size)}<StorageClass>STANDARD</StorageClass></Contents>")
        return Response(200, [("Content-Type", "application/xml")], _xml("ListBucketResult", "".join(parts)))

    # ---- dispatch --------------------------------------------------------------------
    def handle(self, req: Request) -> Response:
        path, _, qs = req.target.partition("?")
        query = dict(urllib.parse.parse_qsl(qs, keep_blank_values=True)) if qs else {}
        if "%" in path:
            path = urllib.parse.unquote(path)
        bucket, _, key = path.lstrip("/").partition("/")
        m = req.method
        unsupported = _UNSUPPORTED & query.keys() if query else None
        if unsupported:
            raise S3Error(501, "NotImplemented", f"{', '.join(sorted(unsupported))} is not implemented by this server")
        if not bucket:
            if m == "GET":
                return self.list_buckets()
            raise S3Error(405, "MethodNotAllowed", "The specified method is not allowed against this resource.")
        if not key:
            if m == "GET":
                if "location" in query:
                    return self.bucket_location(bucket)
                return self.list_objects(bucket, query)
            if m == "PUT":
                return self.create_bucket(bucket)
            if m == "HEAD":
                return self.head_bucket(bucket)
            if m == "DELETE":
                return self.delete_bucket(bucket)
            if m == "POST" and "delete" in query:
                return self.delete_objects(bucket, req.body)
        else:
            if m in ("GET", "HEAD"):
                return self.get_object(bucket, key, req.headers, head=m == "HEAD")
            if m == "PUT":
                return self.put_object(bucket, key, req.headers, req.body)
            if m == "DELETE":
                return self.delete_object(bucket, key)
        raise S3Error(405, "MethodNotAllowed", "The specified method is not allowed against this resource.")


# ---------------------------------------------------------------------------------------
# HTTP/1.1 on asyncio
# ---------------------------------------------------------------------------------------


class Stats:
    """Counters of the S3 requests served (control requests excluded)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.requests = 0
        self.bytes_out = 0  # response body bytes
        self.bytes_in = 0  # request body bytes
        self.in_flight = 0
        self.max_in_flight = 0
        self.errors = 0  # 4xx/5xx answers (416 and 404 included)
        self.connections = 0
        self.max_connections = 0
        self.by_method: dict[str, int] = {}
        self.delay_s = 0.0  # latency drawn, summed over the requests
        self.started = time.monotonic()

    def snapshot(self, open_connections: int) -> dict[str, Any]:
        return {"requests": self.requests, "bytes": self.bytes_out, "bytes_in": self.bytes_in,
                "in_flight": self.in_flight, "max_in_flight": self.max_in_flight, "errors": self.errors,
                "connections": open_connections, "connections_total": self.connections, "max_connections": self.max_connections,
                "by_method": dict(self.by_method), "delay_ms": self.delay_s * 1000.0, "seconds": time.monotonic() - self.started}


class S3Server:
    """The server's state, shared by its connections; runs on one event loop."""

    def __init__(self, root: str, latency: Latency | float | None = None, access_key: str | None = None):
        self.backend = Backend(root)
        self.access_key = access_key
        self.latency = Latency.of(latency)
        self._draw = self.latency.sampler()
        self.stats = Stats()
        self.open_connections = 0
        self._date = (0, "")
        self._server: asyncio.base_events.Server | None = None

    def date(self) -> str:
        now = int(time.time())
        if now != self._date[0]:
            self._date = (now, _http_date(now))
        return self._date[1]

    def authorize(self, req: Request) -> None:
        """With an access key set, only requests signed with it pass (the signature itself is not
        checked): enough to test what clients do on 403s."""
        if self.access_key is None:
            return
        auth = req.headers.get("authorization", "")
        query = urllib.parse.parse_qs(req.target.partition("?")[2])
        credential = query.get("X-Amz-Credential", [""])[0]
        if not auth and not credential:
            raise S3Error(403, "AccessDenied", "Access Denied")
        if f"Credential={self.access_key}/" not in auth and not credential.startswith(self.access_key + "/"):
            raise S3Error(403, "InvalidAccessKeyId",
                          "The AWS Access Key Id you provided does not exist in our records.")

    def reset_stats(self) -> None:
        self.stats.reset()
        self.stats.max_connections = self.open_connections

    def snapshot(self) -> dict[str, Any]:
        snap = self.stats.snapshot(self.open_connections)
        snap["latency"] = self.latency.describe()
        return snap

    async def start(self, host: str, port: int) -> int:
        _check_loopback(host)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, backlog=4096,
                                                reuse_address=True)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in list(_Connection.open_by_server.get(id(self), ())):
                conn.abort()
            await self._server.wait_closed()

    def control(self, req: Request) -> Response:
        path = req.target.partition("?")[0]
        if path == _CONTROL + "stats":
            return Response(200, [("Content-Type", "application/json")], json.dumps(self.snapshot()).encode())
        if path == _CONTROL + "reset" and req.method == "POST":
            self.reset_stats()
            return Response(204, [])
        return _error_response(S3Error(404, "NoSuchControl", f"no control endpoint {path}"), "", False)


def _error_response(err: S3Error, resource: str, head: bool) -> Response:
    headers = [("Content-Type", "application/xml")]
    if head:
        return Response(err.status, headers)
    extra = "".join(_el(k, v) for k, v in err.extra.items())
    body = (f"{_XML_HEAD}<Error>{_el('Code', err.code)}{_el('Message', err.message)}{extra}"
            f"{_el('Resource', resource)}{_el('RequestId', uuid.uuid4().hex[:16])}</Error>").encode()
    return Response(err.status, headers, body)


_HEADER = re.compile(r"([^:\r\n]+):[ \t]*([^\r\n]*)")


class _Connection(asyncio.Protocol):
    """One client connection: requests parsed from the stream and answered one at a time
    (HTTP/1.1 without pipelining, which is what clients send), each after its latency."""

    open_by_server: dict[int, set[_Connection]] = {}

    def __init__(self, server: S3Server):
        self.server = server
        self.loop = asyncio.get_event_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.busy = False  # a request is being delayed or answered
        self.in_process = False
        self.closed = False
        self.paused = False
        self.timer: asyncio.TimerHandle | None = None
        self.stream: tuple[int, int, int, Request] | None = None  # fd, offset, remaining, request
        self.head: tuple[str, str, dict[str, str], int] | None = None  # parsed, body position
        self.continued = False

    # ---- asyncio callbacks ------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        s = self.server
        s.open_connections += 1
        s.stats.connections += 1
        s.stats.max_connections = max(s.stats.max_connections, s.open_connections)
        self.open_by_server.setdefault(id(s), set()).add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.open_connections -= 1
        self.open_by_server.get(id(self.server), set()).discard(self)
        if self.timer is not None:  # the client gave up during the latency
            self.timer.cancel()
            self.timer = None
            self.server.stats.in_flight -= 1
        if self.stream is not None:
            os.close(self.stream[0])
            self.stream = None
            self.server.stats.in_flight -= 1

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._process()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.stream is not None:
            self._pump()

    # ---- requests ---------------------------------------------------------------------
    def _parse(self) -> Request | None:
        buf = self.buf
        if self.head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > 65536:
                    self._fail(400, "request headers too large")
                return None
            text = buf[:end].decode("latin-1")
            first, _, rest = text.partition("\r\n")
            try:
                method, target, version = first.split(" ", 2)
            except ValueError:
                self._fail(400, f"bad request line {first!r}")
                return None
            headers = {name.lower(): value.rstrip() for name, value in _HEADER.findall(rest)}
            headers[":version"] = version
            self.head = (method, target, headers, end + 4)
            self.continued = False
        method, target, headers, pos = self.head
        if "chunked" in headers.get("transfer-encoding", "").lower():
            got = _dechunk(buf, pos)
            if got is None:
                self._continue(headers)
                return None
            body, end = got
        else:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                self._fail(400, "bad Content-Length")
                return None
            if len(buf) < pos + length:
                self._continue(headers)
                return None
            body, end = bytes(buf[pos:pos + length]), pos + length
        del buf[:end]
        self.head = None
        if "aws-chunked" in headers.get("content-encoding", "").lower():
            got = _dechunk(body, 0)
            if got is None:
                self._fail(400, "truncated aws-chunked body")
                return None
            body = got[0]
        conn = headers.get("connection", "").lower()
        keep = conn != "close" if headers[":version"] == "HTTP/1.1" else conn == "keep-alive"
        return Request(method, target, headers, body, keep)

    def _continue(self, headers: dict[str, str]) -> None:
        if not self.continued and headers.get("expect", "").lower() == "100-continue":
            self.continued = True
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _fail(self, status: int, message: str) -> None:
        body = message.encode()
        self.transport.write(f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Length: {len(body)}\r\n"
                             f"Connection: close\r\n\r\n".encode() + body)
        self.transport.close()
        self.closed = True

    def _process(self) -> None:
        self.in_process = True
        try:
            while not self.busy and not self.closed:
                req = self._parse()
                if req is None:
                    return
                self.busy = True
                if req.target.startswith(_CONTROL):
                    self._send(req, self.server.control(req), counted=False)
                    continue
                stats = self.server.stats
                stats.requests += 1
                stats.bytes_in += len(req.body)
                stats.by_method[req.method] = stats.by_method.get(req.method, 0) + 1
                stats.in_flight += 1
                if stats.in_flight > stats.max_in_flight:
                    stats.max_in_flight = stats.in_flight
                delay = self.server._draw()
                stats.delay_s += delay
                if delay > 0:
                    self.timer = self.loop.call_later(delay, self._answer, req)
                else:
                    self._answer(req)
        finally:
            self.in_process = False

    def _answer(self, req: Request) -> None:
        self.timer = None
        if self.closed:
            self.server.stats.in_flight -= 1
            return
        head = req.method == "HEAD"
        try:
            self.server.authorize(req)
            resp = self.server.backend.handle(req)
        except S3Error as e:
            resp = _error_response(e, req.target.partition("?")[0], head)
        except Exception as e:  # a bug or an OS error: the client sees a 500, the server lives on
            resp = _error_response(S3Error(500, "InternalError", f"{type(e).__name__}: {e}"),
                                   req.target.partition("?")[0], head)
        if resp.status >= 400:
            self.server.stats.errors += 1
        self._send(req, resp, counted=True)

    def _send(self, req: Request, resp: Response, counted: bool) -> None:
        body = resp.body
        length = body.length if isinstance(body, _FileBody) else len(body)
        head = req.method == "HEAD"
        lines = [f"HTTP/1.1 {resp.status} {_REASONS.get(resp.status, 'Unknown')}", f"Date: {self.server.date()}",
                 "Server: croupier-s3server", f"x-amz-request-id: {id(req) & 0xFFFFFFFF:08X}"]
        has_length = False
        for k, v in resp.headers:
            lines.append(f"{k}: {v}")
            has_length = has_length or k == "Content-Length"
        if not has_length and not (head and resp.status < 300) and resp.status != 204:
            lines.append(f"Content-Length: {length}")
        elif not has_length and head:
            lines.append("Content-Length: 0")
        if not req.keep_alive:
            lines.append("Connection: close")
        header = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if head or resp.status == 204:
            self.transport.write(header)
            self._done(req, 0, counted)
            return
        if isinstance(body, _FileBody):
            try:
                fd = os.open(body.path, os.O_RDONLY)
            except OSError as e:  # deleted in between
                self._send(req, _error_response(S3Error(500, "InternalError", str(e)), "", head), counted)
                return
            if body.length <= _STREAM_ABOVE:
                try:
                    data = os.pread(fd, body.length, body.offset) if body.length else b""
                finally:
                    os.close(fd)
                self.transport.write(header + data)
                self._done(req, len(data), counted)
                return
            self.transport.write(header)
            self.stream = (fd, body.offset, body.length, req)
            if counted:
                self.server.stats.bytes_out += body.length
            self._pump()
            return
        self.transport.write(header + body)
        self._done(req, len(body), counted)

    def _pump(self) -> None:
        fd, offset, remaining, req = self.stream  # type: ignore[misc]
        while remaining > 0 and not self.paused and not self.closed:
            data = os.pread(fd, min(_CHUNK, remaining), offset)
            if not data:  # truncated underneath us: the client sees a short body
                self.transport.close()
                self.closed = True  # connection_lost closes the file and ends the request
                break
            self.transport.write(data)
            offset += len(data)
            remaining -= len(data)
        if self.closed:
            return
        if remaining > 0:  # paused: resume_writing goes on
            self.stream = (fd, offset, remaining, req)
            return
        os.close(fd)
        self.stream = None
        self._done(req, 0, True)

    def _done(self, req: Request, nbytes: int, counted: bool) -> None:
        if counted:
            self.server.stats.in_flight -= 1
            self.server.stats.bytes_out += nbytes
        self.busy = False
        if not req.keep_alive:
            self.transport.close()
            self.closed = True
            return
        if not self.in_process and self.buf:
            self._process()


# ---------------------------------------------------------------------------------------
# running it
# ---------------------------------------------------------------------------------------


def _check_loopback(host: str) -> None:
    if host == "localhost":
        return
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"the S3 test server binds loopback addresses only (127.0.0.1, ::1), not {host!r}")


class RunningServer:
    """A started server: `endpoint`, `root`, `stats()`, plus helpers to make buckets and objects
    (they go through the folder, not HTTP, and are neither delayed nor counted)."""

    def __init__(self, root: str, endpoint: str, latency: Latency):
        self.root = root
        self.endpoint = endpoint
        self.latency = latency

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.endpoint + _CONTROL + "stats", timeout=30) as r:
            return json.loads(r.read())

    def reset_stats(self) -> None:
        req = urllib.request.Request(self.endpoint + _CONTROL + "reset", method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=30):
            pass

    def create_bucket(self, bucket: str) -> str:
        if not _BUCKET_RE.match(bucket):
            raise ValueError(f"invalid bucket name {bucket!r}")
        path = os.path.join(self.root, bucket)
        os.makedirs(path, exist_ok=True)
        return path

    def put(self, bucket: str, key: str, data: bytes) -> None:
        path = os.path.join(self.root, bucket, *key.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    def stop(self) -> None:
        raise NotImplementedError


class _ThreadServer(RunningServer):
    def __init__(self, root: str, latency: Latency, host: str, port: int, access_key: str | None):
        import uvloop

        self.server = S3Server(root, latency, access_key)
        self.loop = uvloop.new_event_loop()
        ready = threading.Event()
        failed: list[BaseException] = []
        bound: list[int] = []

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                bound.append(self.loop.run_until_complete(self.server.start(host, port)))
            except BaseException as e:
                failed.append(e)
                ready.set()
                return
            ready.set()
            self.loop.run_forever()
            self.loop.run_until_complete(self.server.stop())
            self.loop.close()

        self.thread = threading.Thread(target=main, name="s3server", daemon=True)
        self.thread.start()
        ready.wait()
        if failed:
            raise failed[0]
        super().__init__(root, f"http://{_url_host(host)}:{bound[0]}", latency)

    def stats(self) -> dict[str, Any]:
        done = threading.Event()
        out: list[dict[str, Any]] = []

        def snap() -> None:
            out.append(self.server.snapshot())
            done.set()

        self.loop.call_soon_threadsafe(snap)
        done.wait(30)
        return out[0]

    def reset_stats(self) -> None:
        done = threading.Event()

        def reset() -> None:
            self.server.reset_stats()
            done.set()

        self.loop.call_soon_threadsafe(reset)
        done.wait(30)

    def stop(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)


class _ProcessServer(RunningServer):
    def __init__(self, root: str, latency: Latency, host: str, port: int, access_key: str | None):
        argv = [sys.executable, "-m", "croupier.bench.s3server", "--root", root, "--host", host, "--port", str(port),
                *latency.to_args(), *(["--access-key", access_key] if access_key else [])]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        m = re.search(r"listening on (http://\S+)", line)
        if not m:
            rest = self.proc.communicate(timeout=30)[0]
            raise RuntimeError(f"the S3 server did not start: {line}{rest}")
        super().__init__(root, m.group(1), latency)
        self.output: collections.deque[str] = collections.deque(maxlen=200)  # what it printed since (errors)
        threading.Thread(target=self._drain, name="s3server-output", daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.output.append(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@contextlib.contextmanager
def running(root: str | os.PathLike[str] | None = None, *, latency: Latency | float | None = None,
            host: str = "127.0.0.1", port: int = 0, process: bool = False,
            access_key: str | None = None) -> Iterator[RunningServer]:
    """Serve `root` (None: a fresh temporary folder, removed afterwards) over S3 on loopback.

    `latency`: a Latency, or milliseconds (fixed). `process=True` runs the server in its own
    process (its own core and GIL: for benchmarks); otherwise it runs on a thread here.
    `access_key`: refuse (403) requests not signed with this access key id."""
    _check_loopback(host)
    lat = Latency.of(latency)
    tmp = tempfile.mkdtemp(prefix="s3server-") if root is None else None
    path = os.path.abspath(os.fspath(root if root is not None else tmp))
    server: RunningServer = (_ProcessServer if process else _ThreadServer)(path, lat, host, port, access_key)
    try:
        yield server
    finally:
        server.stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m croupier.bench.s3server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True, help="folder served: one subfolder per bucket (created if missing)")
    p.add_argument("--host", default="127.0.0.1", help="loopback address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=9000, help="port (0: any free one; default 9000)")
    p.add_argument("--median-ms", type=float, default=0.0,
                   help="per-request latency: fixed at this many ms, or the median with --sigma > 0")
    p.add_argument("--sigma", type=float, default=0.0, help="lognormal sigma (0: the latency is fixed)")
    p.add_argument("--uniform-ms", type=float, nargs=2, metavar=("LOW", "HIGH"), help="uniform latency in ms instead")
    p.add_argument("--seed", type=int, default=0, help="seed of the latency draws (default 0)")
    p.add_argument("--bucket", action="append", default=[], help="create this bucket (repeatable)")
    p.add_argument("--access-key", help="refuse (403) requests not signed with this access key id")
    args = p.parse_args(argv)
    if args.uniform_ms:
        lat = Latency.uniform(*args.uniform_ms, seed=args.seed)
    elif args.sigma > 0:
        lat = Latency.lognormal(args.median_ms, args.sigma, seed=args.seed)
    else:
        lat = Latency.fixed(args.median_ms)
    try:
        _check_loopback(args.host)
    except ValueError as e:
        p.error(str(e))
    root = os.path.abspath(args.root)
    server = S3Server(root, lat, args.access_key)
    for b in args.bucket:
        os.makedirs(server.backend.bucket_dir(b, must_exist=False), exist_ok=True)

    async def serve() -> None:
        port = await server.start(args.host, args.port)
        print(f"s3server listening on http://{_url_host(args.host)}:{port} root={root} latency={lat.describe()}",
              flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop()

    import uvloop

    uvloop.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
