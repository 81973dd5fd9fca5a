"""Where a dataset lives -> the store that reads it and the path within that store.

    open_store("/data/text")            -> (LocalStore, "/data/text")
    open_store("file:///data/text")     -> (LocalStore, "/data/text")
    open_store("s3://bucket/ds/text")   -> (ObjectStore for s3://bucket, "ds/text")

Object stores are cached per scheme, bucket, options and the AWS_* / GOOGLE_* / AZURE_*
environment they were built under, so every dataset of one bucket shares one client
(its connection pool, its credentials).
"""

from __future__ import annotations

import json
import os
import threading
import urllib.parse
from collections.abc import Mapping
from typing import Any

from .base import Store
from .local import LocalStore

#: URL schemes of object stores (s3a is read as s3).
OBJECT_SCHEMES = ("s3", "s3a", "gs", "az")
SUPPORTED = ("a local path", "file://", "s3://", "gs://", "az://")

_ENV_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_")
_cache: dict[tuple[Any, ...], Store] = {}
_lock = threading.Lock()


def is_url(s: str) -> bool:
    """Whether `s` is a URL (scheme://...) rather than a local path."""
    scheme, sep, _ = s.partition("://")
    return bool(sep) and scheme.replace("+", "").replace("-", "").replace(".", "").isalnum() and scheme[:1].isalpha()


def _options_key(options: Mapping[str, Any] | None) -> str:
    return json.dumps(dict(options or {}), sort_keys=True, default=repr)


def _env_key() -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)))


def object_store(scheme: str, bucket: str, options: Mapping[str, Any] | None = None) -> Store:
    """The shared ObjectStore of one bucket (created on first use)."""
    scheme = "s3" if scheme == "s3a" else scheme
    key = (scheme, bucket, _options_key(options), _env_key())
    with _lock:
        store = _cache.get(key)
        if store is None:
            from .objectstore import ObjectStore  # obstore loads only when an object store is used

            store = _cache[key] = ObjectStore(bucket, scheme=scheme, options=options)
        return store


def clear_cache() -> None:
    """Forget the shared object stores (tests; their clients close once unreferenced)."""
    with _lock:
        _cache.clear()


def open_store(location: str, *, local: Store | None = None,
               options: Mapping[str, Any] | None = None) -> tuple[Store, str]:
    """The store holding `location` and the path of `location` in it.

    A local path or file:// URL gives `local` (or a new LocalStore) and the absolute path;
    s3://bucket/prefix (gs://, az:// likewise) gives the bucket's shared ObjectStore,
    built with `options` (endpoint, region, ...: see objectstore.py), and the key prefix
    without slashes at either end ("" for the whole bucket)."""
    if not location:
        raise ValueError("empty dataset location")
    if not is_url(location):
        return local or LocalStore(), os.path.abspath(os.path.expanduser(location))
    parsed = urllib.parse.urlsplit(location)
    scheme = parsed.scheme.lower()
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{location}: file:// URLs name a local path (file:///path), not host {parsed.netloc!r}")
        return local or LocalStore(), os.path.abspath(urllib.parse.unquote(parsed.path))
    if scheme in OBJECT_SCHEMES:
        bucket = parsed.netloc
        if not bucket:
            raise ValueError(f"{location}: no bucket; write {scheme}://BUCKET/PATH")
        if parsed.query or parsed.fragment:
            raise ValueError(f"{location}: an object store location takes no ?query or #fragment")
        prefix = parsed.path.strip("/")  # keys as written: S3 URIs are not percent-encoded
        return object_store(scheme, bucket, options), prefix
    raise ValueError(f"{location}: unsupported storage scheme {scheme!r}; supported are {', '.join(SUPPORTED)}")
