"""The datasets a server serves: opened at start by name, or on demand by path under a root."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .config import LatencySpec
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
        self._by_path: dict[str, Reader] = {}
        self._opening: dict[str, asyncio.Future[Reader]] = {}
        #: Called with each dataset opened on demand (the server counts its store's reads).
        self.on_open: Callable[[Reader], None] | None = None

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
        """A served dataset by name, or one under a data root by path (opened once)."""
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
            return self._by_path[key]
        if key not in self._opening:
            loop = asyncio.get_running_loop()
            self._opening[key] = asyncio.ensure_future(
                loop.run_in_executor(self.executor, self._open_path, candidate, None)
            )
        try:
            reader = await asyncio.shield(self._opening[key])
        except BaseException:
            self._opening.pop(key, None)
            raise
        self._by_path[key] = reader
        if self.on_open is not None:
            self.on_open(reader)
        return reader

    def close(self) -> None:
        for reader in [*self._by_name.values(), *self._by_path.values()]:
            reader.close()
        if self.store is not None:
            self.store.close()


__all__ = ["Catalog", "UnknownDatasetError", "OutsideRootsError", "parse_dataset_spec"]
