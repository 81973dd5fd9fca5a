"""The datasets a server serves: opened at start by name, or on demand by path under a root."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .config import LatencySpec
from .limits import LimitExceeded
from .readers.base import DatasetError, DatasetInfo, OutsideRootsError, Reader
from .readers.synthetic import SyntheticReader
from .storage import Store


def is_url(path: str) -> bool:
    """An object-store location (s3://...), not a file-system path."""
    return "://" in path and not path.startswith("file://")


class UnknownDatasetError(LookupError):
    pass


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
        max_path_datasets: int = 0,
        path_idle_s: float = 0.0,
    ):
        #: Object-store settings over the environment's (endpoint, region, keys...).
        self.storage_options = dict(storage_options or {})
        #: The file-system store every local dataset reads through (the server's I/O pool).
        self.store = store
        self.data_roots = tuple(str(os.path.realpath(r)) for r in data_roots)
        self.cache_dir = cache_dir
        self.latency = latency
        self.executor = executor
        self._by_name: dict[str, Reader] = {}
        # Datasets opened by path, least recently used first: each is closed once no
        # stream uses it and it has been idle `path_idle_s`, or sooner when opening
        # another would pass `max_path_datasets` (0: no bound, never closed when idle).
        self._by_path: collections.OrderedDict[str, Reader] = collections.OrderedDict()
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
        if self.executor is not None:
            reader.bind_executor(self.executor)
        if self.latency is None:
            return reader
        from .readers.latency import LatencyInjected

        lat = self.latency
        return LatencyInjected(
            reader,
            distribution=lat.distribution,
            median_ms=lat.median_ms,
            sigma=lat.sigma,
            seed=lat.seed,
            overrides={int(k): float(v) for k, v in (lat.overrides or {}).items()},
        )

    def _open_path(self, path: str, name: str | None) -> Reader:
        from .readers import open_dataset, resolve_under_roots

        if self.data_roots and not is_url(path):
            path = str(resolve_under_roots(path, self.data_roots))
        return self._wrap(open_dataset(
            path, name=name, cache_dir=self.cache_dir, store=self.store, storage_options=self.storage_options or None
        ))

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
        if not self.data_roots or not name_or_path:
            raise UnknownDatasetError(
                f"dataset {name_or_path!r} is not served here; datasets: {self.names()}"
                + ("" if self.data_roots else " (no data roots are configured, so paths are not accepted)")
            )
        # A relative path is looked up under each root in turn (the first that has it
        # wins); os.path.join keeps an absolute one as it is.
        candidate = next(
            (c for c in (os.path.join(r, name_or_path) for r in self.data_roots) if os.path.lexists(c)), None
        )
        if candidate is None:
            raise UnknownDatasetError(
                f"dataset {name_or_path!r} is not served here, nor a path under the data roots "
                f"{list(self.data_roots)}; datasets: {self.names()}"
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

    def close(self) -> None:
        for timer in self._idle_timers.values():
            timer.cancel()
        self._idle_timers.clear()
        for reader in [*self._by_name.values(), *self._by_path.values()]:
            reader.close()
        if self.store is not None:
            self.store.close()


__all__ = ["Catalog", "UnknownDatasetError", "OutsideRootsError", "parse_dataset_spec"]
