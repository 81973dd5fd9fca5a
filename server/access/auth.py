"""Who is calling: bearer tokens from a file, checked on every call by a server interceptor.

The tokens file is YAML (see README "Security"):

    tokens:
      - name: team-a                  # who; logged and used as the caller's identity
        token: "a-long-random-secret" # or  sha256: <hex of the token>  to keep no secret here
        datasets: [digits, "team-a/*"] # optional scope: names, or paths under a data root (globs)
      - name: admin
        token: "..."

It is read again, without a restart, on SIGHUP and whenever its (mtime, size, inode)
changes (checked on each call: one stat). A file that no longer parses keeps the last
good tokens in force and logs why. Tokens are kept only as SHA-256 digests, looked up
by digest and compared with `hmac.compare_digest`, and never logged.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import logging
import os
import posixpath
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

log = logging.getLogger("croupier.server.access.auth")

#: Services reachable without a token unless the operator says otherwise (`--open-services`).
OPEN_SERVICE_PREFIXES = {
    "health": ("/grpc.health.v1.Health/",),
    "reflection": ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/"),
}
#: The shortest token accepted: a guessable token is no token.
MIN_TOKEN_CHARS = 16
AUTH_HEADER = "authorization"


class TokenFileError(ValueError):
    """The tokens file is missing, unreadable or malformed; the message names the file and entry."""


class ScopeError(PermissionError):
    """A valid token asked for a dataset outside its scope."""


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: the token's name and the datasets it may read."""

    name: str
    #: Glob patterns over dataset names and data-root-relative paths; None: every dataset.
    datasets: tuple[str, ...] | None = None

    def may_read(self, dataset: str) -> bool:
        if self.datasets is None:
            return True
        key = _normalize(dataset)
        return any(fnmatch.fnmatchcase(key, pattern) for pattern in self.datasets)


def _normalize(dataset: str) -> str:
    # "team-a/../team-b/x" must not match "team-a/*"; names without slashes are unchanged.
    return posixpath.normpath(dataset) if "/" in dataset else dataset


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def parse_tokens(raw: Any, source: str) -> dict[bytes, Principal]:
    """The tokens of a parsed tokens file, by SHA-256 digest of the token."""
    if not isinstance(raw, dict) or not isinstance(raw.get("tokens"), list):
        raise TokenFileError(f"{source}: expected a mapping with a 'tokens:' list (see README, Security)")
    out: dict[bytes, Principal] = {}
    names: set[str] = set()
    for i, entry in enumerate(raw["tokens"]):
        where = f"{source}: tokens[{i}]"
        if not isinstance(entry, dict):
            raise TokenFileError(f"{where}: expected a mapping with name and token (or sha256)")
        unknown = set(entry) - {"name", "token", "sha256", "datasets"}
        if unknown:
            raise TokenFileError(f"{where}: unknown key {sorted(unknown)[0]!r}; known: datasets, name, sha256, token")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise TokenFileError(f"{where}: 'name' must be a non-empty string")
        if name in names:
            raise TokenFileError(f"{where}: name {name!r} is used twice")
        names.add(name)
        if ("token" in entry) == ("sha256" in entry):
            raise TokenFileError(f"{where} ({name}): give exactly one of 'token' and 'sha256'")
        if "token" in entry:
            token = entry["token"]
            if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
                raise TokenFileError(f"{where} ({name}): 'token' must be a string of at least {MIN_TOKEN_CHARS} characters")
            digest = _digest(token)
        else:
            try:
                digest = bytes.fromhex(str(entry["sha256"]))
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise TokenFileError(f"{where} ({name}): 'sha256' must be 64 hex digits (sha256sum of the token)")
        scope = entry.get("datasets")
        if scope is not None:
            if not isinstance(scope, list) or not all(isinstance(p, str) and p for p in scope):
                raise TokenFileError(f"{where} ({name}): 'datasets' must be a list of names or path globs")
            scope = tuple(scope)
        if digest in out:
            raise TokenFileError(f"{where} ({name}): the same token as {out[digest].name!r}")
        out[digest] = Principal(name, scope)
    return out


class TokenStore:
    """The tokens of one file, reloaded when it changes or on `reload()` (SIGHUP)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._tokens: dict[bytes, Principal] = {}
        self.reload(strict=True)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def reload(self, strict: bool = False) -> bool:
        """Read the file again. At start (strict) a bad file is an error; later it is logged
        and the tokens in force stay (a typo must not lock every trainer out)."""
        with self._lock:
            stamp = self._stat()
            try:
                text = self.path.read_text()
                tokens = parse_tokens(yaml.safe_load(text), str(self.path))
            except (OSError, yaml.YAMLError, TokenFileError) as exc:
                self._stamp = stamp  # do not retry a bad file on every call
                message = exc if isinstance(exc, TokenFileError) else f"cannot read tokens file {self.path}: {exc}"
                if strict:
                    raise TokenFileError(str(message)) from None
                log.error("%s; keeping the %d token(s) loaded before", message, len(self._tokens))
                return False
            self._tokens, self._stamp = tokens, stamp
        log.info("tokens file %s: %d token(s) loaded", self.path, len(tokens))
        return True

    def refresh(self) -> None:
        """Reload if the file changed since it was last read."""
        if self._stat() != self._stamp:
            self.reload()

    def names(self) -> list[str]:
        return sorted(p.name for p in self._tokens.values())

    def lookup(self, token: str) -> Principal | None:
        digest = _digest(token)
        for known, principal in self._tokens.items():
            # Every entry is compared (no early exit): the time taken says nothing of which.
            if hmac.compare_digest(known, digest):
                found = principal
                break
        else:
            found = None
        return found

    def authenticate(self, metadata: Iterable[tuple[str, Any]] | None) -> Principal | None:
        """The caller named by a call's `authorization: Bearer TOKEN` metadata, or None."""
        token = bearer_token(metadata)
        if token is None:
            return None
        self.refresh()
        return self.lookup(token)


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == AUTH_HEADER:
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, token = str(value).partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def open_prefixes(open_services: Sequence[str]) -> tuple[str, ...]:
    """Method prefixes reachable without a token, from service names (health, reflection)."""
    out: list[str] = []
    for name in open_services:
        if name not in OPEN_SERVICE_PREFIXES:
            raise ValueError(f"open_services: unknown service {name!r}; known: {sorted(OPEN_SERVICE_PREFIXES)}")
        out.extend(OPEN_SERVICE_PREFIXES[name])
    return tuple(out)


class _Throttled:
    """At most one log line a second for a repeated event, with a count of those skipped
    (a client hammering with bad tokens must not fill the disk)."""

    def __init__(self) -> None:
        self.last = 0.0
        self.skipped = 0

    def warn(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.last < 1.0:
            self.skipped += 1
            return
        if self.skipped:
            message += f" ({self.skipped} more refused in the last second(s))"
        self.last, self.skipped = now, 0
        log.warning(message, *args)


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that only answers `code`: the request body
    is never parsed for a caller that is not let in."""

    async def refuse(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

    serialize = handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, None, serialize)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse, None, serialize)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, None, serialize)
    return grpc.stream_stream_rpc_method_handler(refuse, None, serialize)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call without a known bearer token, except to
    the open services (health and reflection by default)."""

    def __init__(self, tokens: TokenStore, open_services: Sequence[str] = ("health", "reflection")):
        self.tokens = tokens
        self.open = open_prefixes(open_services)
        self._refused = _Throttled()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method or ""
        if method.startswith(self.open):
            return await continuation(details)
        token = bearer_token(details.invocation_metadata)
        if token is not None:
            self.tokens.refresh()
            if self.tokens.lookup(token) is not None:
                return await continuation(details)
            why = "the bearer token is not valid here (unknown, or revoked)"
        else:
            why = ("this server needs a bearer token: send metadata 'authorization: Bearer TOKEN' "
                   "(Loader(token=...) or the CROUPIER_TOKEN environment variable)")
        handler = await continuation(details)
        if handler is None:  # an unknown method stays UNIMPLEMENTED
            return handler
        self._refused.warn("refused %s: %s", method[:200], "unknown token" if token else "no token")
        return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, why)


def principal_of(context: grpc.aio.ServicerContext, tokens: TokenStore | None) -> Principal | None:
    """The caller of a call the interceptor let in; None when the server has no tokens."""
    if tokens is None:
        return None
    return tokens.lookup(bearer_token(context.invocation_metadata()) or "")


def check_scope(principal: Principal | None, dataset: str) -> None:
    """Raise ScopeError when `principal` may not read `dataset` (nothing is opened first,
    so the answer says nothing of whether it exists)."""
    if principal is not None and not principal.may_read(dataset):
        raise ScopeError(
            f"token {principal.name!r} may not read dataset {dataset[:256]!r}; "
            f"its scope is {list(principal.datasets or ())}"
        )


def path_under_roots(path: str, roots: Sequence[str]) -> str | None:
    """`path` relative to the data root holding it (for scope checks of datasets opened by path)."""
    real = os.path.realpath(path)
    for root in roots:
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return os.path.relpath(real, root).replace(os.sep, "/")
    return None
