"""How big the cache tiers are: the memory budget (bytes, or a share of the memory this
process may use) and the disk tier's bound."""

from __future__ import annotations

import os
from dataclasses import dataclass

#: The memory budget when none is given: this share of the memory the process may use
#: (min of the machine's RAM and the cgroup's memory.max), leaving the rest to streams'
#: buffers, the CPU pool and the page cache.
DEFAULT_MEMORY_SHARE = 0.25
_CGROUP_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
_SUFFIXES = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
             "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def _meminfo_total(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_limit(files: tuple[str, ...] = _CGROUP_FILES) -> int | None:
    for name in files:
        try:
            with open(name) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 says "no limit" with a huge number
            return int(text)
    return None


def memory_limit() -> int:
    """Bytes of memory this process may use: the machine's RAM, or its cgroup's bound
    (a container's memory limit) when lower. 0 when neither can be read."""
    known = [v for v in (_meminfo_total(), _cgroup_limit()) if v]
    return min(known) if known else 0


def parse_size(text: str, what: str) -> int:
    """'512M', '4GiB', '1048576' -> bytes; a ValueError naming `what` and the value."""
    value = str(text).strip().lower().replace(" ", "")
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = value[len(number):]
    try:
        if unit not in _SUFFIXES:
            raise ValueError
        size = int(float(number) * _SUFFIXES[unit])
    except ValueError:
        raise ValueError(f"{what}={text!r}: expected bytes with an optional unit (K, M, G, T), e.g. 512M or 8G") from None
    if size < 0:
        raise ValueError(f"{what}={text!r}: must be 0 or more")
    return size


def parse_memory_budget(text: str | int | None, limit: int | None = None) -> int:
    """--cache-memory: bytes ('8G'), a share of the memory the process may use ('25%'),
    or 0 (no cache). None: DEFAULT_MEMORY_SHARE of it."""
    limit = memory_limit() if limit is None else limit
    if text is None:
        return int(limit * DEFAULT_MEMORY_SHARE)
    if isinstance(text, int):
        return max(0, text)
    value = str(text).strip()
    if value.endswith("%"):
        try:
            share = float(value[:-1]) / 100
        except ValueError:
            share = -1.0
        if not 0 <= share <= 1:
            raise ValueError(f"cache_memory (--cache-memory)={text!r}: a share must lie between 0% and 100%")
        return int(limit * share)
    return parse_size(value, "cache_memory (--cache-memory)")


@dataclass(frozen=True)
class CacheSizes:
    """The tiers' bounds: memory bytes (0: no memory tier), the disk tier's folder and
    bytes (0 or no folder: no disk tier), and whether fills run ("auto": where the
    storage rewards large reads, measured per mount; "always"; "never")."""

    memory_bytes: int
    disk_dir: str | None = None
    disk_bytes: int = 0
    fill: str = "auto"

    @property
    def enabled(self) -> bool:
        return self.memory_bytes > 0 or (self.disk_dir is not None and self.disk_bytes > 0)


def disk_folder(cache_dir: str | None) -> str:
    """The disk tier's folder: `blocks/` under --cache-dir, else under ~/.cache/croupier."""
    base = cache_dir if cache_dir else os.path.join(os.path.expanduser("~"), ".cache", "croupier")
    return os.path.join(base, "blocks")
