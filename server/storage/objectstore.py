"""Object stores (S3 first; GCS and Azure as obstore builds them) behind the `Store` interface.

Built on obstore (Python bindings of Rust's object_store), with S3 GETs done on the event
loop itself where that is signed as obstore would sign it (s3http.py: static keys or no
signing, HTTP/1.1, no proxy): a GET is a write and a parse on a pooled connection, 3x less
CPU than through obstore's Tokio threads, and any GET it cannot complete (an error status,
a dropped connection, a timeout) is done again through obstore, whose retries and error
messages apply. Either way hundreds to thousands of GETs are in flight with no thread per
read. Open-time calls (HEAD, LIST) are obstore's blocking ones, which the catalog runs in
an executor.

Paths are object keys in the bucket, without a leading slash ("data/part-0.arrow");
`url(path)` gives "s3://bucket/data/part-0.arrow". '/' separates folders: `list_dir` is a
delimiter listing, `is_dir(p)` holds when some key starts with "p/".

Reads behave like a file's pread: a range past the end returns the bytes that exist
(S3 answers 416 when the range starts at or after the end; that becomes b""), and
size -1 reads to the end. `read_ranges` merges neighbouring ranges (gap at most
`coalesce_bytes`) and issues every merged range as its own `get_range_async`, all at
once. obstore's own `get_ranges_async` is not used: it runs at most 10 GETs of one call
at a time, merges ranges up to 1 MiB apart (a 1 MiB download for two 1 KB rows), and
panics (a BaseException) when a range starts past the end of the object.

Configuration is what the AWS SDKs read, plus explicit overrides (the server's flags):

* credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, else web
  identity (AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN), ECS/EKS container credentials,
  EC2 instance metadata, in obstore's order; AWS_SKIP_SIGNATURE=true for anonymous
  (public buckets). Profiles (AWS_PROFILE, ~/.aws) are not read.
* region: AWS_REGION, else AWS_DEFAULT_REGION, else us-east-1;
* endpoint: AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL (else AWS's); an http:// endpoint
  (MinIO, a loopback test server) turns on `allow_http`.
* options (dict, override the environment): endpoint, region, access_key_id,
  secret_access_key, session_token, skip_signature, allow_http,
  virtual_hosted_style_request; HTTP client: timeout, connect_timeout, read_timeout,
  pool_idle_timeout, pool_max_idle_per_host, http2, allow_invalid_certificates,
  proxy_url, user_agent; retries: max_retries, retry_timeout (seconds);
  coalesce_bytes; fast_get (default true; also CROUPIER_S3_FAST_GET=0): GETs on the loop
  where possible; any other key goes to obstore's store config as is (and sends every GET
  through obstore).

Retries are obstore's (10, exponential backoff from 100 ms, for 5xx, connection errors
and timeouts), but a read gives up 60 s after its first attempt rather than 3 minutes,
an attempt times out after 60 s and a connect after 5 s. HTTP/1.1 connections are pooled
without a cap, so every read in flight has its own connection.

Errors: a missing key raises FileNotFoundError naming its URL; a missing bucket
BucketNotFoundError; denied access ObjectStorePermissionError (a PermissionError); an
unreachable endpoint ObjectStoreConnectionError (a ConnectionError) or
ObjectStoreTimeoutError; anything else ObjectStoreError. All are OSErrors whose message
names the URL, what happened, and the endpoint.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import obstore
from obstore.store import AzureStore, GCSStore, S3Store

from .base import FileEntry, Range, Store
from .object_groups import start_objects
from .s3http import RangeGetClient, StaticCredentials

#: Neighbouring ranges of one `read_ranges` call closer than this are read by one GET.
DEFAULT_COALESCE_BYTES = 16 << 10
#: ... as long as the merged GET stays under this size.
MAX_COALESCED_BYTES = 8 << 20

_CLIENT_DEFAULTS: dict[str, Any] = {"connect_timeout": "5s", "timeout": "60s"}
_RETRY_TIMEOUT_S = 60.0

_CLIENT_KEYS = {"allow_http", "allow_invalid_certificates", "connect_timeout", "default_content_type",
                "default_headers", "http1_only", "http2_keep_alive_interval", "http2_keep_alive_timeout",
                "http2_keep_alive_while_idle", "http2_only", "pool_idle_timeout", "pool_max_idle_per_host",
                "proxy_url", "proxy_ca_certificate", "proxy_excludes", "randomize_addresses", "read_timeout",
                "root_certificate", "timeout", "user_agent"}
_DURATION_KEYS = {"connect_timeout", "timeout", "read_timeout", "pool_idle_timeout", "http2_keep_alive_timeout"}
_RETRY_KEYS = {"max_retries", "retry_timeout"}

SCHEMES = ("s3", "gs", "az")

log = logging.getLogger("croupier.storage")

#: S3 store options the direct GET client honours as obstore does; any other sends every
#: GET through obstore.
_FAST_CONFIG_KEYS = {"region", "endpoint", "aws_endpoint_url_s3", "access_key_id", "aws_access_key_id",
                     "secret_access_key", "aws_secret_access_key", "session_token", "token", "skip_signature",
                     "virtual_hosted_style_request"}


class ObjectStoreError(OSError):
    """An object store failed (other than a missing object); the message says where and why."""


class BucketNotFoundError(ObjectStoreError):
    """The bucket (container) does not exist, or was deleted."""


class ObjectStorePermissionError(ObjectStoreError, PermissionError):
    """The credentials were refused, or lack access."""


class ObjectStoreConnectionError(ObjectStoreError, ConnectionError):
    """The endpoint could not be reached (after obstore's retries)."""


class ObjectStoreTimeoutError(ObjectStoreError, TimeoutError):
    """Requests timed out (after obstore's retries)."""


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


def _duration(value: Any) -> Any:
    """Seconds (int/float) -> obstore's duration string; strings and timedeltas pass."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, (int, float)):
        return f"{int(round(value * 1000))}ms"
    return value


def _seconds(value: Any, default: float) -> float:
    """obstore's duration ("5s", "250ms", timedelta, seconds) in seconds."""
    if value is None:
        return default
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, (int, float)):
        return float(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*(ms|s|m|h)?\s*", str(value))
    if not m:
        return default
    return float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[m.group(2) or "s"]


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


_S3_CODE = re.compile(r"<Code>([^<]*)</Code>(?:\s*<Message>([^<]*)</Message>)?")
_STATUS = re.compile(r"status code: (\d{3})|status: (\d{3})")
_MISSING_BUCKET = ("NoSuchBucket", "ContainerNotFound", "bucket does not exist")
_DENIED = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
           "AuthorizationHeaderMalformed", "AuthenticationFailed", "AuthorizationFailure")


def _is_416(exc: BaseException) -> bool:
    text = str(exc)
    return "416 Range Not Satisfiable" in text or "<Code>InvalidRange</Code>" in text or "status: 416" in text


def _detail(text: str) -> str:
    """A short reason from obstore's long error text: the service's error code and message when
    it sent one, else the first line before obstore's debug dump."""
    m = _S3_CODE.search(text)
    if m:
        return f"{m.group(1)}: {m.group(2)}" if m.group(2) else m.group(1)
    head = text.split("\n\nDebug source", 1)[0].split("\n", 1)[0].strip()
    return head[:400] + ("..." if len(head) > 400 else "")


_CONNECT = re.compile(r'ConnectError\(\s*"([^"]+)"')
_OS_MESSAGE = re.compile(r'(?:message|error): "([^"]+)"')


def _connect_reason(text: str) -> str:
    """"connection refused", "dns error: Name or service not known", ... from obstore's debug text."""
    kind = _CONNECT.search(text)
    message = _OS_MESSAGE.search(text)
    parts = [p for p in (kind and kind.group(1), message and message.group(1)) if p]
    return ": ".join(parts) if parts else "connection failed"


_ATTEMPTS = re.compile(r" in ([0-9.]+[a-zµ]+)(?:, after (\d+) retries)?")


def _attempts(text: str) -> str:
    """", after 7 retries in 2.1s" from obstore's first line."""
    m = _ATTEMPTS.search(text.split("\n", 1)[0])
    if not m:
        return ""
    return f", after {m.group(2)} retries in {m.group(1)}" if m.group(2) else f", in {m.group(1)}"


class ObjectStore(Store):
    """One bucket (S3; GCS bucket or Azure container with `scheme` gs / az) of an object store."""

    scheme = "s3"

    def __init__(self, bucket: str, *, scheme: str = "s3", options: Mapping[str, Any] | None = None):
        super().__init__()
        if scheme in ("s3a",):
            scheme = "s3"
        if scheme not in SCHEMES:
            raise ValueError(f"unsupported object store scheme {scheme!r}: supported are {', '.join(SCHEMES)}")
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid bucket name {bucket!r}")
        self.scheme = scheme
        self.bucket = bucket
        #: (size, ETag) of each object a listing showed, by path, once the server's cache asks
        #: (None: not kept): the version a dataset opened on a listing (an image folder) is
        #: keyed on by the cache, with no HEAD per object
        self.listed: dict[str, tuple[int, str]] | None = None
        opts = dict(options or {})
        self.coalesce_bytes = int(opts.pop("coalesce_bytes", DEFAULT_COALESCE_BYTES))
        fast_get = opts.pop("fast_get", None)
        if fast_get is None:
            fast_get = os.environ.get("CROUPIER_S3_FAST_GET", "1")
        #: S3 GETs on the loop (s3http.py) when usable; None: every GET through obstore
        self.fast: RangeGetClient | None = None
        #: why GETs go through obstore only ("" when `fast` serves them)
        self.fast_off_reason = "" if _truthy(fast_get) else "turned off (fast_get=false / CROUPIER_S3_FAST_GET=0)"
        client: dict[str, Any] = dict(_CLIENT_DEFAULTS)
        retry: dict[str, Any] = {"retry_timeout": timedelta(seconds=_RETRY_TIMEOUT_S)}
        config: dict[str, Any] = {}
        for key, value in opts.items():
            if value is None:
                continue
            if key == "http2":
                client["http1_only"] = not _truthy(value)
            elif key in _CLIENT_KEYS:
                client[key] = _duration(value) if key in _DURATION_KEYS else value
            elif key == "max_retries":
                retry["max_retries"] = int(value)
            elif key == "retry_timeout":
                retry["retry_timeout"] = value if isinstance(value, timedelta) else timedelta(seconds=float(value))
            else:
                config[key] = value
        if "pool_max_idle_per_host" in client:
            client["pool_max_idle_per_host"] = str(client["pool_max_idle_per_host"])
        #: the endpoint, for messages ("https://s3.us-east-1.amazonaws.com", "http://127.0.0.1:9000")
        self.endpoint: str | None = None
        #: the obstore store: its HTTP client, credentials and configuration (`client.config`)
        self.client: S3Store | GCSStore | AzureStore
        try:
            if scheme == "s3":
                self.client = self._s3(config, client, retry)
                if not self.fast_off_reason:
                    self.fast, self.fast_off_reason = self._fast_client(config, client)
                log.info("%s: GETs %s", self.url(""), "on the event loop (s3http)" if self.fast is not None
                         else f"through obstore: {self.fast_off_reason}")
            elif scheme == "gs":
                self.endpoint = "https://storage.googleapis.com"
                self.client = GCSStore(bucket, config=config or None, client_options=client, retry_config=retry)
            else:
                self.endpoint = "https://<account>.blob.core.windows.net"
                self.client = AzureStore(bucket, config=config or None, client_options=client, retry_config=retry)
        except obstore.exceptions.BaseError as e:
            hint = " (set AZURE_STORAGE_ACCOUNT_NAME, or pass account_name)" if scheme == "az" else ""
            raise ValueError(f"cannot configure {self.url('')}: {_detail(str(e))}{hint}") from e

    def _s3(self, config: dict[str, Any], client: dict[str, Any], retry: dict[str, Any]) -> S3Store:
        endpoint = config.pop("endpoint", None) or config.pop("aws_endpoint_url_s3", None) or \
            _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
        region = config.pop("region", None) or _env("AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1"
        config["region"] = region
        if endpoint:
            endpoint = endpoint.rstrip("/")
            # both keys: obstore prefers AWS_ENDPOINT_URL_S3 from the environment over `endpoint`
            config["endpoint"] = config["aws_endpoint_url_s3"] = endpoint
            if endpoint.startswith("http://") and "allow_http" not in client:
                client["allow_http"] = True
            self.endpoint = endpoint
        else:
            self.endpoint = f"https://s3.{region}.amazonaws.com"
        if "skip_signature" in config:
            config["skip_signature"] = _truthy(config["skip_signature"])
        return S3Store(self.bucket, config=config, client_options=client, retry_config=retry)

    def _fast_client(self, config: dict[str, Any], client: dict[str, Any]) -> tuple[RangeGetClient | None, str]:
        """The direct GET client, or None and why not: only for what it signs and speaks
        the same way obstore would (static keys or no signing, HTTP/1.1, no proxy)."""
        extra = set(config) - _FAST_CONFIG_KEYS
        if extra:
            return None, f"store options {sorted(extra)} need obstore"
        if any(k in client for k in ("proxy_url", "root_certificate", "default_headers", "http2_only")) or \
                client.get("http1_only") is False:
            return None, "a proxy, custom certificates, headers or HTTP/2 need obstore"
        if _truthy(config.get("skip_signature", False)):
            creds = None
        else:
            key = config.get("access_key_id") or config.get("aws_access_key_id") or _env("AWS_ACCESS_KEY_ID")
            secret = config.get("secret_access_key") or config.get("aws_secret_access_key") or _env("AWS_SECRET_ACCESS_KEY")
            token = config.get("session_token") or config.get("token") or _env("AWS_SESSION_TOKEN")
            if not key or not secret:
                return None, "credentials other than static keys are resolved by obstore"
            creds = StaticCredentials(str(key), str(secret), str(token) if token else None)
        if self.endpoint and self.endpoint.startswith("http://") and not _truthy(client.get("allow_http", False)):
            return None, "http endpoint without allow_http"
        try:
            fast = RangeGetClient(
                self.endpoint or "", self.bucket, config["region"], creds,
                virtual_hosted=_truthy(config.get("virtual_hosted_style_request", False)),
                timeout_s=_seconds(client.get("timeout"), 60.0),
                connect_timeout_s=_seconds(client.get("connect_timeout"), 5.0),
                verify_tls=not _truthy(client.get("allow_invalid_certificates", False)))
        except ValueError as e:
            return None, str(e)
        return fast, ""

    # ---- naming -------------------------------------------------------------------
    def url(self, path: str) -> str:
        key = path.lstrip("/")
        return f"{self.scheme}://{self.bucket}/{key}" if key else f"{self.scheme}://{self.bucket}"

    def join(self, base: str, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (base, *parts) if p.strip("/"))

    @staticmethod
    def _key(path: str) -> str:
        return path.strip("/")

    # ---- errors -------------------------------------------------------------------
    def _error(self, exc: BaseException, path: str, what: str) -> OSError:
        """obstore's exception -> an OSError whose message names the URL and what happened."""
        url = self.url(path)
        text = str(exc)
        if any(s in text for s in _MISSING_BUCKET):
            return BucketNotFoundError(f"{url}: cannot {what}: bucket {self.bucket!r} does not exist "
                                       f"(endpoint {self.endpoint})")
        if isinstance(exc, (FileNotFoundError, obstore.exceptions.NotFoundError)):
            return FileNotFoundError(errno.ENOENT, "No such object", url)
        if "169.254.169.254" in text or "169.254.170.2" in text:  # the instance / container credentials service
            return ObjectStorePermissionError(
                f"{url}: cannot {what}: no credentials: none in the environment, and the instance metadata service "
                f"failed ({_detail(text)}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_SKIP_SIGNATURE=true "
                "for a public bucket")
        status = next((int(a or b) for a, b in _STATUS.findall(text)), None)
        if isinstance(exc, (obstore.exceptions.PermissionDeniedError, obstore.exceptions.UnauthenticatedError)) \
                or status in (401, 403) or any(s in text for s in _DENIED):
            return ObjectStorePermissionError(
                f"{url}: cannot {what}: access denied (endpoint {self.endpoint}): {_detail(text)}; check the "
                "credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, or AWS_SKIP_SIGNATURE=true "
                "for a public bucket)")
        if "kind: Timeout" in text or "TimedOut" in text:
            return ObjectStoreTimeoutError(f"{url}: cannot {what}: requests to {self.endpoint} timed out"
                                           f"{_attempts(text)}")
        if "kind: Connect" in text or "error sending request" in text:
            return ObjectStoreConnectionError(f"{url}: cannot {what}: cannot reach {self.endpoint} "
                                              f"({_connect_reason(text)}){_attempts(text)}")
        if isinstance(exc, obstore.exceptions.InvalidPathError):
            return ObjectStoreError(f"{url}: invalid object key: {_detail(text)}")
        return ObjectStoreError(f"{url}: cannot {what} (endpoint {self.endpoint}): {_detail(text)}")

    def _missing(self, exc: BaseException, path: str, what: str) -> OSError:
        """A 404 without a body (HEAD): a missing key, unless the bucket itself is gone."""
        err = self._error(exc, path, what)
        if type(err) is FileNotFoundError:
            self._check_bucket(path, what)
        return err

    def _check_bucket(self, path: str, what: str) -> None:
        try:  # one LIST of (usually) nothing: fails with NoSuchBucket when the bucket is gone
            obstore.list_with_delimiter(self.client, self._key(path) or None)
        except Exception as e:
            err = self._error(e, path, what)
            if type(err) is not FileNotFoundError:
                raise err from e

    # ---- open time (blocking) -----------------------------------------------------
    def size(self, path: str) -> int:
        key = self._key(path)
        if not key:
            raise IsADirectoryError(errno.EISDIR, "Is a bucket, not an object", self.url(path))
        try:
            return int(obstore.head(self.client, key)["size"])
        except Exception as e:
            raise self._missing(e, path, "get its size") from e

    def version(self, path: str) -> tuple[int, str]:
        """(size, ETag) of the object, by one HEAD: what the cache keys a version on."""
        key = self._key(path)
        try:
            meta = obstore.head(self.client, key)
        except Exception as e:
            raise self._missing(e, path, "get its size") from e
        return int(meta["size"]), str(meta.get("e_tag") or "")

    async def get_with_etag(self, path: str, start: int, end: int) -> tuple[memoryview, str]:
        """Bytes [start, end) and the ETag of the object that sent them, by one GET through
        obstore (whose answer carries the headers): the cache's large fill reads, which
        must tell an object rewritten since its dataset opened. Counted in `stats`."""
        self.stats.started()
        ok, data = False, memoryview(b"")
        try:
            result = await obstore.get_async(self.client, self._key(path), options={"range": (start, end)})
            data = memoryview(await result.bytes_async())
            ok = True
            return data, str(result.meta.get("e_tag") or "")
        except Exception as e:
            raise self._error(e, path, "read it") from e
        finally:
            self.stats.finished(len(data), ok=ok)

    def is_file(self, path: str) -> bool:
        key = self._key(path)
        if not key:
            return False
        try:
            obstore.head(self.client, key)
            return True
        except Exception as e:
            err = self._missing(e, path, "check it")
            if type(err) is FileNotFoundError:
                return False
            raise err from e

    def is_dir(self, path: str) -> bool:
        key = self._key(path)
        try:
            for chunk in obstore.list(self.client, key or None, chunk_size=1):
                return len(chunk) > 0
            return not key  # the bucket's root exists even when empty
        except Exception as e:
            err = self._error(e, path, "list it")
            if type(err) is FileNotFoundError:
                return False
            raise err from e

    def list_dir(self, path: str) -> tuple[list[str], list[FileEntry]]:
        key = self._key(path)
        try:
            result = obstore.list_with_delimiter(self.client, key or None)
        except Exception as e:
            raise self._error(e, path, "list it") from e
        dirs = sorted(p.rsplit("/", 1)[-1] for p in result["common_prefixes"])
        files = sorted((FileEntry(m["path"], int(m["size"])) for m in result["objects"]), key=lambda f: f.path)
        self._remember(result["objects"])
        if key and not dirs and not files:
            raise FileNotFoundError(errno.ENOENT, "No such folder (no key starts with it)", self.url(path) + "/")
        return dirs, files

    def list_files(self, path: str) -> list[FileEntry]:
        key = self._key(path)
        try:
            metas = [m for chunk in obstore.list(self.client, key or None, chunk_size=1000) for m in chunk]
        except Exception as e:
            raise self._error(e, path, "list it") from e
        self._remember(metas)
        return sorted((FileEntry(m["path"], int(m["size"])) for m in metas), key=lambda f: f.path)

    def _remember(self, metas: Sequence[Mapping[str, Any]]) -> None:
        if self.listed is not None:
            for m in metas:
                self.listed[m["path"]] = (int(m["size"]), str(m.get("e_tag") or ""))

    def _read_range(self, path: str, offset: int, size: int) -> bytes:
        key = self._key(path)
        if size == 0:
            return b""
        try:
            if size < 0:
                options = {"range": {"offset": offset}} if offset else None
                return bytes(obstore.get(self.client, key, options=options).bytes())
            return bytes(obstore.get_range(self.client, key, start=offset, length=size))
        except Exception as e:
            if _is_416(e):
                return b""
            raise self._error(e, path, "read it") from e

    def read_file(self, path: str) -> bytes:
        """The whole object in one GET (no HEAD first)."""
        return self.read_range(path, 0, -1)

    # ---- the hot path (async) -----------------------------------------------------
    async def _get(self, path: str, start: int, end: int) -> bytes | memoryview:
        """Bytes [start, end) of the object (end -1: to its end), fewer past its end."""
        if self.fast is not None:
            fut: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()
            self.fast.get(self._key(path), start, end,
                          lambda body, _reason: fut.done() or fut.set_result(body))
            body = await fut
            if body is not None:
                return body
        return await self._obstore_get(path, start, end)

    async def _obstore_get(self, path: str, start: int, end: int) -> bytes | memoryview:
        key = self._key(path)
        try:
            if end < 0:
                options = {"range": {"offset": start}} if start else None
                result = await obstore.get_async(self.client, key, options=options)
                return memoryview(await result.bytes_async())
            return memoryview(await obstore.get_range_async(self.client, key, start=start, end=end))
        except Exception as e:
            if _is_416(e):
                return b""
            raise self._error(e, path, "read it") from e

    async def _read(self, path: str, offset: int, size: int) -> bytes:
        if size == 0:
            return b""
        return bytes(await self._get(path, offset, -1 if size < 0 else offset + size))

    def _groups(self, ranges: Sequence[Range]) -> list[tuple[int, int, list[int]]]:
        """Neighbouring ranges merged into GETs: (start, end or -1, indexes of `ranges`);
        empty ranges need no GET."""
        order = sorted((i for i, (_, s) in enumerate(ranges) if s != 0), key=lambda i: ranges[i][0])
        groups: list[tuple[int, int, list[int]]] = []
        for i in order:
            o, s = ranges[i]
            end = -1 if s < 0 else o + s
            if groups:
                gs, ge, idx = groups[-1]
                if ge < 0 or (o - ge <= self.coalesce_bytes and end >= 0 and max(end, ge) - gs <= MAX_COALESCED_BYTES):
                    groups[-1] = (gs, -1 if ge < 0 else max(ge, end), idx + [i])
                    continue
                if end < 0 and o - ge <= self.coalesce_bytes:
                    groups[-1] = (gs, -1, idx + [i])
                    continue
            groups.append((o, end, [i]))
        return groups

    @staticmethod
    def _split(ranges: Sequence[Range], out: list[bytes], gs: int, idx: list[int], data: bytes | memoryview) -> None:
        if len(idx) == 1 and type(data) is bytes:  # a GET of one range: its body is the range (no copy)
            o, s = ranges[idx[0]]
            if o == gs and (s < 0 or s >= len(data)):
                out[idx[0]] = data
                return
        view = memoryview(data)
        for i in idx:
            o, s = ranges[i]
            a = o - gs
            out[i] = bytes(view[a:] if s < 0 else view[a:a + s])

    async def _read_ranges(self, path: str, ranges: Sequence[Range]) -> list[bytes]:
        if len(ranges) == 1:
            return [await self._read(path, *ranges[0])]
        out: list[bytes] = [b""] * len(ranges)
        groups = self._groups(ranges)
        datas = await asyncio.gather(*(self._get(path, gs, ge) for gs, ge, _ in groups))
        for (gs, _, idx), data in zip(groups, datas):
            self._split(ranges, out, gs, idx, data)
        return out

    @property
    def reads_files_in_groups(self) -> bool:
        return self.fast is not None

    def submit_files(self, paths: Sequence[str], versioned: bool, callback) -> bool:
        """Objects read whole by one call (a group of images), one GET each on the loop
        (object_groups.py). False without the direct client, or for versions (an object's
        version is its listing's, which the cache keeps)."""
        if self.fast is None or versioned or not paths:
            return False
        start_objects(self, paths, callback)
        return True

    def submit_ranges(self, path: str, ranges: Sequence[Range], callback) -> bool:
        """The ranges' GETs straight on the loop (s3http), one callback when all landed; a GET
        it hands back is done through obstore. False without the direct client."""
        fast = self.fast
        if fast is None:
            return False
        n = len(ranges)
        stats = self.stats
        stats.started(n)
        out: list[bytes] = [b""] * n
        groups = self._groups(ranges)
        left = [len(groups)]
        key = self._key(path)

        def finish(err: BaseException | None) -> None:
            stats.finished(sum(map(len, out)) if err is None else 0, n, ok=err is None)
            callback(out if err is None else None, err)

        if not groups:
            finish(None)
            return True

        def landed(gs: int, idx: list[int], data: bytes | memoryview) -> None:
            if left[0] <= 0:
                return  # an earlier GET failed: the callback was told
            self._split(ranges, out, gs, idx, data)
            left[0] -= 1
            if left[0] == 0:
                finish(None)

        def by_obstore(gs: int, ge: int, idx: list[int]) -> None:
            task = asyncio.get_running_loop().create_task(self._obstore_get(path, gs, ge))

            def settled(t: asyncio.Task) -> None:
                if left[0] <= 0:
                    return
                exc = t.exception() if not t.cancelled() else asyncio.CancelledError()
                if exc is not None:
                    left[0] = -1
                    finish(exc)
                else:
                    landed(gs, idx, t.result())

            task.add_done_callback(settled)

        for gs, ge, idx in groups:
            def done(body: bytes | None, _reason: str | None, gs: int = gs, ge: int = ge, idx: list[int] = idx) -> None:
                if body is None:
                    by_obstore(gs, ge, idx)
                else:
                    landed(gs, idx, body)

            fast.get(key, gs, ge, done)
        return True

    def close(self) -> None:
        """Nothing to release: connections close when idle. (Stores are shared between
        datasets through `open_store`'s cache, so this must not break them.)"""
