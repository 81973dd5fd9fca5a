"""Storage under the formats: async range reads on file systems and object stores."""

from .base import FileEntry, Range, Store, StoreStats
from .iopool import IOPool
from .local import LocalStore, default_local_store

__all__ = ["FileEntry", "IOPool", "LocalStore", "Range", "Store", "StoreStats", "default_local_store"]
