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
    ):
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
        self._by_path: dict[str, Reader] = {}
        #: Datasets named at start that failed to open: name -> why (left unserved).
        self.failed: dict[str, str] = {}
        #: ... and name -> the path they were named with.
        self.failed_paths: dict[str, str] = {}
        self._opening: dict[str, asyncio.Future[Reader]] = {}
        #: Called with each dataset opened on demand (the server counts its store's reads).
        self.on_open: Callable[[Reader], None] | None = None

    def _wrap(self, reader: Reader) -> Reader:
        if self.verify_images and hasattr(reader, "verify_images"):
            reader.verify_images = True  # type: ignore[attr-defined]
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

    def confined_store(self, path: str) -> Store | None:
        """The store a local dataset at `path` reads through: the server's, confined to the
        data roots when there are any, else to the dataset's own folder (a file's: its
        folder). None (the server's store as it is) when links may point anywhere."""
        if self.follow_symlinks_outside_roots:
            return self.store
        from .readers.base import MemberOutsideRootsError
        from .storage import default_local_store
        from .storage.confined import ConfinedStore, dataset_roots

        inner = self.store if self.store is not None else default_local_store()
        return ConfinedStore(inner, dataset_roots(path, self.data_roots), MemberOutsideRootsError)  # type: ignore[arg-type]

    def _open_path(self, path: str, name: str | None) -> Reader:
        from .readers import open_dataset, resolve_under_roots

        store = self.store
        if not is_url(path):
            if self.data_roots:
                path = str(resolve_under_roots(path, self.data_roots))
            store = self.confined_store(path.removeprefix("file://"))
        try:
            reader = open_dataset(
                path, name=name, cache_dir=self.cache_dir, store=store, storage_options=self.storage_options or None
            )
        except BaseException:
            if store is not None and store is not self.store:
                store.close()  # unpins what the failed open pinned
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
        from .readers import default_name

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
        """A served dataset by name, or one under a data root by path (opened once)."""
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

    def _under_roots(self, name_or_path: str) -> str | None:
        """The path a client named, if it exists and resolves under a data root. A
        relative path is looked up under each root in turn (the first that has it wins);
        os.path.join keeps an absolute one as it is."""
        from .storage.confined import under

        for root in self.data_roots:
            candidate = os.path.join(root, name_or_path)
            if under(os.path.realpath(candidate), self.data_roots) and os.path.lexists(candidate):
                return candidate
        return None

    def close(self) -> None:
        for reader in [*self._by_name.values(), *self._by_path.values()]:
            reader.close()
        if self.store is not None:
            self.store.close()


__all__ = ["Catalog", "DatasetUnavailableError", "UnknownDatasetError", "OutsideRootsError", "parse_dataset_spec"]
