"""The server's cache tier: blocks of the files datasets read, kept in memory and on a
local disk, shared by every stream and job of the server (README.md beside this file)."""

from .block_cache import BlockCache, CacheStats
from .cached_objects import CachedObjectStore
from .cached_store import CachedStore
from .sizing import CacheSizes, memory_limit, parse_memory_budget

__all__ = ["BlockCache", "CacheStats", "CachedObjectStore", "CachedStore", "CacheSizes", "memory_limit", "parse_memory_budget"]
