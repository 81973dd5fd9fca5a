"""The datasets a server serves: opened at start by name, or on demand by path under a root."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from croupier.server.config import LatencySpec
from croupier.server.access.limits import LimitExceeded
from croupier.server.readers.base import DatasetError, DatasetInfo, OutsideRootsError, Reader
from croupier.server.readers.synthetic import SyntheticReader
from croupier.server.storage import Store


def is_url(path: str) -> bool:
    """An object-store location (s3://...), not a file-system path."""
    return "://" in path and not path.startswith("file://")


class UnknownDatasetError(LookupError):
    pass


class DatasetUnavailableError(LookupError):
    """A dataset the server was told to serve, which failed to open at start (the
    message says why); clients get FAILED_PRECONDITION, not NOT_FOUND."""


def one_line(exc: BaseException) -> str:
    """An error's message on one line (schemas and tracebacks span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def parse_dataset_spec(spec: str) -> tuple[str | None, str]:
    """'NAME=PATH' -> (NAME, PATH); 'PATH' -> (None, PATH)."""
    name, sep, path = spec.partition("=")
    if sep and name and os.sep not in name:
        return name, path
    return None, spec


def _synthetic(name: str | None, path: str) -> SyntheticReader:
    parts = path.split(":")[1:]
    try:
        rows = int(parts[0])
        row_bytes = int(parts[1]) if len(parts) > 1 else 64
    except (IndexError, ValueError):
        raise DatasetError(f"bad synthetic dataset {path!r}: expected synthetic:ROWS[:ROW_BYTES]") from None
    return SyntheticReader(name or f"synthetic-{rows}", rows, row_bytes)


class Catalog:
    def __init__(
        self,
        *,
        data_roots: Sequence[str] = (),
        cache_dir: str | None = None,
        latency: LatencySpec | None = None,
        executor: concurrent.futures.Executor | None = None,
        store: Store | None = None,
        storage_options: Mapping[str, Any] | None = None,
        follow_symlinks_outside_roots: bool = False,
        verify_images: bool = False,
        max_path_datasets: int = 0,
        path_idle_s: float = 0.0,
        cache: Any = None,
    ):
        #: The server's one BlockCache (server/cache), shared by every dataset; None: off.
        self.cache = cache
        #: Object-store settings over the environment's (endpoint, region, keys...).
        self.storage_options = dict(storage_options or {})
        #: The file-system store every local dataset reads through (the server's I/O pool).
        self.store = store
        self.data_roots = tuple(str(os.path.realpath(r)) for r in data_roots)
        self.cache_dir = cache_dir
        self.latency = latency
        self.executor = executor
        #: Off (the default): every file a local dataset touches must resolve under its
        #: roots (see `confined_store`); on: links inside datasets are followed anywhere.
        self.follow_symlinks_outside_roots = follow_symlinks_outside_roots
        #: Image datasets decode every image before sending it (else: the cheap check only).
        self.verify_images = verify_images
        self._by_name: dict[str, Reader] = {}
        # Datasets opened by path, least recently used first: each is closed once no
        # stream uses it and it has been idle `path_idle_s`, or sooner when opening
        # another would pass `max_path_datasets` (0: no bound, never closed when idle).
        self._by_path: collections.OrderedDict[str, Reader] = collections.OrderedDict()
        #: Datasets named at start that failed to open: name -> why (left unserved).
        self.failed: dict[str, str] = {}
        #: ... and name -> the path they were named with.
        self.failed_paths: dict[str, str] = {}
        self._opening: dict[str, asyncio.Future[Reader]] = {}
        self.max_path_datasets = max_path_datasets
        self.path_idle_s = path_idle_s
        self._users: dict[str, int] = {}  # path key -> streams using it now
        self._key_of: dict[int, str] = {}  # id(reader) -> path key
        self._idle_timers: dict[str, asyncio.TimerHandle] = {}
        #: Called with each dataset opened on demand (the server counts its store's reads).
        self.on_open: Callable[[Reader], None] | None = None
        #: Called after a dataset opened by path was closed (the server trims memory).
        self.on_close: Callable[[Reader], None] | None = None

    def _wrap(self, reader: Reader) -> Reader:
        if self.verify_images and hasattr(reader, "verify_images"):
            reader.verify_images = True  # type: ignore[attr-defined]
        if self.executor is not None:
            reader.bind_executor(self.executor)
        if self.latency is None:
            return reader
        from croupier.server.readers.latency import LatencyInjected

        lat = self.latency
        return LatencyInjected(
            reader,
            distribution=lat.distribution,
            median_ms=lat.median_ms,
            sigma=lat.sigma,
            seed=lat.seed,
            overrides={int(k): float(v) for k, v in (lat.overrides or {}).items()},
        )

    def confined_store(self, path: str) -> Store | None:
        """The store a local dataset at `path` reads through: the server's, confined to the
        data roots when there are any, else to the dataset's own folder (a file's: its
        folder). None (the server's store as it is) when links may point anywhere."""
        if self.follow_symlinks_outside_roots:
            return self._cached(self.store, path, owns=False) if self.store is not None else None
        from croupier.server.readers.base import MemberOutsideRootsError
        from croupier.server.storage import default_local_store
        from croupier.server.storage.confined import ConfinedStore, dataset_roots

        inner = self.store if self.store is not None else default_local_store()
        folder = path if os.path.isdir(path) else os.path.dirname(path)  # its files' names start with it
        confined = ConfinedStore(inner, dataset_roots(path, self.data_roots), MemberOutsideRootsError,  # type: ignore[arg-type]
                                 folders=(folder,))
        return self._cached(confined, path, owns=True)

    def _cached(self, store: Store, path: str, owns: bool) -> Store:
        """`store` read through the server's cache (wrapping the confined store: the cache
        serves only files its checks let the dataset open)."""
        if self.cache is None:
            return store
        from croupier.server.cache import CachedStore

        return CachedStore(store, self.cache, path.rstrip("/") or path, owns_inner=owns)  # logs name the data's path

    def _cached_objects(self, store: Store, path: str) -> Store:
        """An object-store dataset's store read through the server's cache (objects keyed
        by URL, size and ETag; `store` is shared by its bucket's datasets, never closed here)."""
        from croupier.server.cache import CachedObjectStore

        return CachedObjectStore(store, self.cache, path.rstrip("/"))

    def _open_path(self, path: str, name: str | None) -> Reader:
        from croupier.server.readers import open_dataset, resolve_under_roots

        store = self.store
        wrapped: list[Store] = []  # an object store's view through the cache, made at open

        def through_cache(obj: Store) -> Store:
            wrapped.append(self._cached_objects(obj, path))
            return wrapped[-1]

        if not is_url(path):
            if self.data_roots:
                path = str(resolve_under_roots(path, self.data_roots))
            store = self.confined_store(path.removeprefix("file://"))
        try:
            reader = open_dataset(
                path, name=name, cache_dir=self.cache_dir, store=store, storage_options=self.storage_options or None,
                wrap_object_store=through_cache if self.cache is not None else None,
            )
        except BaseException:
            for s in [store, *wrapped]:
                if s is not None and s is not self.store:
                    s.close()  # unpins what the failed open pinned
            raise
        return self._wrap(reader)

    def add(self, spec: str) -> Reader:
        """Open a dataset named on the command line or in the config file (blocking)."""
        name, path = parse_dataset_spec(spec)
        if path.startswith("synthetic:"):
            reader = self._wrap(_synthetic(name, path))
        else:
            reader = self._open_path(path, name)
        if reader.name in self._by_name:
            raise DatasetError(f"two datasets are named {reader.name!r}; name them with NAME=PATH")
        self._by_name[reader.name] = reader
        return reader

    def add_failed(self, spec: str, exc: BaseException) -> str:
        """Record that dataset `spec` failed to open (it stays unserved); returns its name."""
        from croupier.server.readers import default_name

        name, path = parse_dataset_spec(spec)
        name = name or default_name(path)
        if name not in self._by_name:
            self.failed[name] = one_line(exc)
            self.failed_paths[name] = path
        return name

    def readers(self) -> list[Reader]:
        """Every dataset open now (named ones and those opened by path)."""
        return [*self._by_name.values(), *self._by_path.values()]

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def infos(self) -> list[DatasetInfo]:
        return [self._by_name[n].info() for n in self.names()]

    async def get(self, name_or_path: str) -> Reader:
        """A served dataset by name, or one under a data root by path (opened once);
        for a look that holds nothing (a stream uses `acquire` and `release`)."""
        reader = await self.acquire(name_or_path)
        self.release(reader)
        return reader

    async def acquire(self, name_or_path: str) -> Reader:
        """As `get`, and a dataset opened by path stays open until `release`d."""
        if name_or_path in self._by_name:
            return self._by_name[name_or_path]
        if name_or_path in self.failed:
            raise DatasetUnavailableError(
                f"dataset {name_or_path!r} failed to open when the server started and is not served: "
                f"{self.failed[name_or_path]}"
            )
        if not self.data_roots or not name_or_path:
            raise UnknownDatasetError(
                f"dataset {name_or_path!r} is not served here; datasets: {self.names()}"
                + ("" if self.data_roots else " (no data roots are configured, so paths are not accepted)")
            )
        candidate = self._under_roots(name_or_path)
        if candidate is None:
            # One answer whether or not the path exists: a client cannot probe outside
            # the roots, nor learn where they are.
            raise UnknownDatasetError(
                f"dataset {name_or_path!r} is not served here, nor a dataset path under the data roots; "
                f"datasets: {self.names()}"
            )
        key = os.path.realpath(candidate)
        if key in self._by_path:
            return self._use(key)
        opening = self._opening.get(key)
        if opening is None:
            self._make_room()
            loop = asyncio.get_running_loop()
            opening = self._opening[key] = asyncio.ensure_future(
                loop.run_in_executor(self.executor, self._open_path, candidate, None)
            )
            # Registered by the open itself, not by a waiter that may be cancelled.
            opening.add_done_callback(lambda fut: self._opened(key, fut))
        reader = await asyncio.shield(opening)
        if self._by_path.get(key) is not reader:  # closed again before this caller woke
            return await self.acquire(name_or_path)
        return self._use(key)

    def _opened(self, key: str, fut: asyncio.Future[Reader]) -> None:
        if self._opening.get(key) is fut:
            del self._opening[key]
        if fut.cancelled() or fut.exception() is not None:
            return
        reader = fut.result()
        self._by_path[key] = reader
        self._key_of[id(reader)] = key
        if self.on_open is not None:
            self.on_open(reader)
        if key not in self._users and self.path_idle_s > 0:  # nobody came for it after all
            self._idle_timers[key] = asyncio.get_running_loop().call_later(self.path_idle_s, self._close_path, key)

    def _use(self, key: str) -> Reader:
        self._users[key] = self._users.get(key, 0) + 1
        timer = self._idle_timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._by_path.move_to_end(key)
        return self._by_path[key]

    def release(self, reader: Reader) -> None:
        """A stream is done with `reader`; an unused path dataset closes once idle."""
        key = self._key_of.get(id(reader))
        if key is None or key not in self._users:
            return  # a named dataset (always open)
        self._users[key] -= 1
        if self._users[key] > 0:
            return
        del self._users[key]
        if self.path_idle_s > 0:
            self._idle_timers[key] = asyncio.get_running_loop().call_later(self.path_idle_s, self._close_path, key)

    def _make_room(self) -> None:
        """Close unused path datasets, least recently used first, to fit one more."""
        if not self.max_path_datasets:
            return
        while len(self._by_path) + len(self._opening) >= self.max_path_datasets:
            idle = next((k for k in self._by_path if k not in self._users), None)
            if idle is None:
                raise LimitExceeded(
                    "max_path_datasets", self.max_path_datasets, "--max-path-datasets",
                    f"{len(self._by_path) + len(self._opening)} datasets opened by path are in use",
                )
            self._close_path(idle)

    def _close_path(self, key: str) -> None:
        if key in self._users:
            return  # in use again since the timer was set
        timer = self._idle_timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        reader = self._by_path.pop(key, None)
        if reader is not None:
            self._key_of.pop(id(reader), None)
            reader.close()
            if self.on_close is not None:
                self.on_close(reader)

    def path_datasets(self) -> list[str]:
        """Keys (real paths) of the datasets opened by path and still open."""
        return list(self._by_path)

    def _under_roots(self, name_or_path: str) -> str | None:
        """The path a client named, if it exists and resolves under a data root. A
        relative path is looked up under each root in turn (the first that has it wins);
        os.path.join keeps an absolute one as it is."""
        from croupier.server.storage.confined import under

        for root in self.data_roots:
            candidate = os.path.join(root, name_or_path)
            if under(os.path.realpath(candidate), self.data_roots) and os.path.lexists(candidate):
                return candidate
        return None

    def close(self) -> None:
        for timer in self._idle_timers.values():
            timer.cancel()
        self._idle_timers.clear()
        for reader in [*self._by_name.values(), *self._by_path.values()]:
            reader.close()
        if self.store is not None:
            self.store.close()
        if self.cache is not None:
            self.cache.close()


__all__ = ["Catalog", "DatasetUnavailableError", "UnknownDatasetError", "OutsideRootsError", "parse_dataset_spec"]
