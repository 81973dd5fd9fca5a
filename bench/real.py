"""`croupier bench --suite real`: every system reading the same files through really slow storage.

No latency is injected in any loader: the storage itself is slow, and every system pays
it the same way, through the kernel or over HTTP.

* latency FS: the benchmark data mounted through latencyfs (a C FUSE passthrough whose
  every read request sleeps a seeded lognormal draw, 5 ms median, sigma 0.5); croupier
  serves the mount's paths, the baselines open and map the same paths. Before each case
  `fs.evict()` opens every file of the dataset through the mount, which drops its cached
  pages, so each case starts cold; within a case pages a system has read stay cached,
  as on any real network file system with a client page cache.
* S3: the loopback S3 server (its own process) serving the same folder as a bucket,
  20 ms lognormal sigma 0.5 per request, in the server; croupier serves s3:// URLs
  (obstore range GETs), the baselines read the bucket as their users do (s3baselines).
* a bucket through a mount: the same S3 server and latency, the bucket mounted by a real
  FUSE client of object storage with its documented defaults (`rclone mount`, `s3fs`;
  bench/bucket_mount.py), mounted afresh before each case (no client or kernel cache
  carried over). Every system reads the mount's paths, croupier too; croupier on the
  bucket's s3:// URLs is the S3 condition's row, beside it in the same run.
* page cache: croupier on the plain local files, read once before the case: the CPU
  ceiling (nothing to wait for), measured at the start and at the end of the suite.

What the storage served (requests, bytes, most requests in flight) is counted by the
storage (latencyfs's statistics file, the S3 server's counters), polled every 0.1 s during
the case, so it counts every system the same way; see README "croupier bench --suite real".
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .cases import (
    CROUPIER,
    CROUPIER_ORDERED,
    HF_SHUFFLE,
    WEBDATASET,
    Case,
    ServerProcess,
    Storage,
    System,
    aggregate,
    dataloader,
    run_ranks,
    steady_skip,
)
from . import bucket_mount as bucket_mounts
from . import latencyfs
from .datagen import BenchData, DataSpec, ensure_data
from .decode import DecodeCeiling
from .driver import Report, attempt, drive
from .procstat import ThreadCPU, cpu_seconds, load_into_page_cache, peak_rss_mb, thread_cpu, thread_cpu_delta
from .promscrape import scrape
from .reporting import num, target
from .trainer import RankJob

SIGMA = 0.5
#: The S3 bucket the data folder is served as (a symlink under a temporary root).
BUCKET = "bench"


@dataclass(frozen=True)
class Condition:
    key: str  # "local", "fuse", "s3", or a bucket mount: "rclone", "s3fs"
    name: str
    median_ms: float = 0.0
    sigma: float = SIGMA
    seed: int = 0
    #: Drop the dataset's cached pages this often during a case too (latency FS only): a data set
    #: much larger than memory, where pages read ahead are gone before they are asked for.
    evict_every_s: float = 0.0
    #: The latency FS's cap on background FUSE requests: None raised (to its threads), 0 the
    #: kernel's default (12), as s3fs, rclone, gcsfuse and most FUSE mounts have it.
    max_background: int | None = None
    #: croupier's server cache held to this share of the case's dataset (`--cache-memory`; 0: its
    #: default, 25% of RAM): with `evict_every_s`, data larger than memory for every system.
    cache_share: float = 0.0

    @property
    def mean_latency_s(self) -> float:
        """Mean of the lognormal latency: median * exp(sigma^2 / 2)."""
        return self.median_ms / 1000 * math.exp(self.sigma**2 / 2)


LOCAL = Condition("local", "page cache (local files)")


def latency_fs(ms: float = 5.0) -> Condition:
    return Condition("fuse", f"latency FS {ms:g} ms", ms)


def latency_fs_kernel_defaults(ms: float = 5.0) -> Condition:
    """The latency FS mounted as most FUSE file systems are: the kernel's cap of 12
    background requests (buffered preads), readahead 128 KB."""
    return Condition("fuse", f"latency FS {ms:g} ms, kernel defaults", ms, max_background=latencyfs.KERNEL_DEFAULT)


def latency_fs_cold(ms: float = 5.0, every_s: float = 0.5) -> Condition:
    return Condition("fuse", f"latency FS {ms:g} ms, cache dropped every {every_s:g} s", ms, evict_every_s=every_s)


def latency_fs_larger_than_memory(ms: float = 5.0, every_s: float = 0.5, cache_share: float = 0.1) -> Condition:
    """Data larger than memory, for every system, on the mount users have (kernel defaults): the
    kernel's cached pages of the dataset, mapped ones too, dropped every `every_s` (each file
    opened again through the mount: latencyfs.evict), and croupier's cache held to
    `cache_share` of the dataset, as a server caches a tenth of a dataset ten times its memory."""
    return Condition("fuse", f"latency FS {ms:g} ms, kernel defaults, larger than memory "
                     f"(pages dropped every {every_s:g} s, croupier's cache {cache_share:.0%} of the data)", ms,
                     evict_every_s=every_s, max_background=latencyfs.KERNEL_DEFAULT, cache_share=cache_share)


def s3(ms: float = 20.0) -> Condition:
    return Condition("s3", f"S3 {ms:g} ms", ms)


#: FUSE clients that mount a bucket (bench/bucket_mount.py), by condition key.
BUCKET_MOUNTS = tuple(bucket_mounts.CLIENTS)


def bucket_mount(client: str, ms: float = 20.0) -> Condition:
    """The S3 condition's bucket, mounted by `client` ("rclone" or "s3fs") with its defaults."""
    if client not in BUCKET_MOUNTS:
        raise ValueError(f"bucket mount client {client!r}: expected one of {', '.join(BUCKET_MOUNTS)}")
    return Condition(client, f"{client} mount of S3 {ms:g} ms", ms)


@dataclass(frozen=True)
class RealCase:
    dataset: str
    condition: Condition
    system: System
    #: "measure", "cpu ceiling" (croupier on page-cache files), "profile" (under cProfile, not a result)
    role: str = "measure"


@dataclass(frozen=True)
class RealSuite:
    name: str
    data: DataSpec
    #: Per storage condition (run in this order), per dataset, the systems run.
    matrix: tuple[tuple[Condition, dict[str, tuple[System, ...]]], ...]
    #: Datasets whose CPU ceiling (croupier unordered on page-cache files) is measured, first and last.
    ceilings: tuple[str, ...] = ("text", "imagefolder", "shards")
    world: int = 2
    batch: int = 64
    max_batches: int = 800
    max_seconds: float = 4.0
    hard_seconds: float = 15.0
    steady_batches: int = 4
    steady_per_warmup: int = 3
    #: Profile croupier's server (profserve: cProfile on CPU clocks, every thread) in a second run of
    #: text on the latency FS, for this long after the first batch.
    profile: bool = True
    profile_seconds: float = 8.0
    decode_seconds: float = 1.5
    #: Flags of every `croupier serve` in the suite beyond its defaults (a user's settings for slow storage).
    server_flags: tuple[str, ...] = ()
    targets: bool = True

    #: Measure the CPU ceilings again at the end (on a shared machine the better run is the ceiling).
    ceilings_again: bool = True

    def plan(self) -> list[tuple[Condition, list[RealCase]]]:
        """The cases in running order, grouped by storage condition (one mount or server each):
        the CPU ceilings, each slow condition's datasets and systems (the profile run after
        text's on the latency FS), the CPU ceilings again."""
        ceilings = [RealCase(ds, LOCAL, CROUPIER, "cpu ceiling") for ds in self.ceilings]
        out: list[tuple[Condition, list[RealCase]]] = [(LOCAL, ceilings)] if ceilings else []
        for cond, systems in self.matrix:
            group: list[RealCase] = []
            for ds, sys_ in systems.items():
                group += [RealCase(ds, cond, s) for s in sys_]
                if (self.profile and cond.key == "fuse" and not cond.evict_every_s and cond.max_background is None
                        and ds == "text"):
                    group.append(RealCase(ds, cond, CROUPIER, "profile"))
            if group:
                out.append((cond, group))
        if ceilings and self.ceilings_again:
            out.append((LOCAL, list(ceilings)))
        return out

    def cases(self) -> list[RealCase]:
        return [c for _, group in self.plan() for c in group]


def real() -> RealSuite:
    texts = (CROUPIER, CROUPIER_ORDERED, dataloader(0), dataloader(2), dataloader(8), HF_SHUFFLE)
    images = (CROUPIER, CROUPIER_ORDERED, dataloader(0), dataloader(2), dataloader(8))
    shards = (CROUPIER, CROUPIER_ORDERED, WEBDATASET)
    every = {"text": texts, "imagefolder": images, "shards": shards}
    # The text rows again with the cache kept cold: 1 GB of rows fits in this machine's page cache, so
    # memory-mapped readers' 128 KB read-around warms it within seconds; a data set much larger than
    # memory would not. Images are read once per epoch, so they need no such variant.
    cold = {"text": (CROUPIER, dataloader(2), dataloader(8))}
    # Data larger than memory on a kernel-default mount: no system keeps it, croupier's cache a tenth
    # (text: images are read once an epoch, so memory changes nothing within a case).
    larger = {"text": (CROUPIER, dataloader(2), dataloader(8))}
    # A bucket through the FUSE clients users mount it with: croupier given the mount path against the
    # DataLoaders through the same mount (croupier on s3:// is the S3 condition's row).
    mounted = {"text": (CROUPIER, dataloader(2), dataloader(8)), "imagefolder": (CROUPIER, dataloader(2), dataloader(8))}
    return RealSuite(name="real", data=DataSpec(text_rows=1_000_000, images=20_000, shard_size=1_000),
                     matrix=((latency_fs(5.0), every), (latency_fs_kernel_defaults(5.0), every),
                             (latency_fs_cold(5.0, 0.5), cold), (latency_fs_larger_than_memory(), larger),
                             (s3(20.0), every),
                             (bucket_mount("rclone"), mounted), (bucket_mount("s3fs"), mounted)))


def real_mounts() -> RealSuite:
    """The bucket-mount conditions of `real` alone, beside croupier on s3:// (the same data, about
    5 minutes): results/real-mounts.md, between full runs of the suite."""
    full = real()
    mounted = dict(full.matrix)[bucket_mount("rclone")]
    return replace(full, name="real-mounts", ceilings=(), ceilings_again=False, profile=False,
                   matrix=((s3(20.0), {ds: (CROUPIER,) for ds in mounted}),
                           (bucket_mount("rclone"), mounted), (bucket_mount("s3fs"), mounted)))


def real_quick() -> RealSuite:
    """Seconds on tiny data, one rank, each kind of system on each storage once or so: the smoke test."""
    return RealSuite(
        name="real-quick", data=DataSpec(text_rows=4_000, images=400, shard_size=100),
        matrix=((latency_fs(5.0), {"text": (CROUPIER, HF_SHUFFLE), "imagefolder": (dataloader(0),),
                                   "shards": (WEBDATASET,)}),
                (s3(20.0), {"text": (CROUPIER, dataloader(2), HF_SHUFFLE), "imagefolder": (dataloader(2),)})),
        ceilings=("text",), ceilings_again=False, world=1, batch=8, max_batches=20, max_seconds=0.3,
        hard_seconds=5.0, steady_batches=2, steady_per_warmup=1, profile=False, decode_seconds=0.3)


# ---- storage under test ---------------------------------------------------------------------

class StorageUnderTest:
    """Where a condition's files are, how to make them cold, and the storage's own counters."""

    condition: Condition
    pid: int | None = None
    env: dict[str, str] = {}
    eviction = ""

    def croupier_path(self, ds: str) -> str:
        raise NotImplementedError

    def baseline_path(self, ds: str) -> str:
        return self.croupier_path(ds)

    def before_case(self, ds: str) -> None:
        pass

    def stats(self) -> dict[str, float] | None:
        """{"requests", "bytes", "in_flight", "max_in_flight", ...} since the last reset, or None."""
        return None

    def reset(self) -> None:
        pass


class LocalFiles(StorageUnderTest):
    eviction = "files read once before the case (page cache)"

    def __init__(self, data: BenchData):
        self.condition, self.data = LOCAL, data

    def croupier_path(self, ds: str) -> str:
        return str(data_path(self.data, ds))

    def before_case(self, ds: str) -> None:
        load_into_page_cache([data_path(self.data, ds)])


class LatencyFSStorage(StorageUnderTest):
    eviction = ("fs.evict(): every file of the dataset opened and closed through the mount before the case, which "
                "drops its cached pages, mapped ones included (latencyfs.drop_page_cache(), drop_caches, is not used: "
                "evict() needs no root and leaves the rest of the machine's cache alone)")

    def __init__(self, fs: Any, condition: Condition):
        self.fs, self.condition, self.pid = fs, condition, fs.pid

    def croupier_path(self, ds: str) -> str:
        return str(Path(self.fs.path) / ds)

    def before_case(self, ds: str) -> None:
        self.fs.evict([Path(self.fs.path) / ds])

    def reset(self) -> None:
        self.fs.reset_stats()

    def stats(self) -> dict[str, float]:
        s = self.fs.stats()
        return {"requests": s["requests"], "bytes": s["bytes"], "in_flight": s["in_flight"],
                "max_in_flight": s["max_in_flight"], "delay_ms": s["delay_ms_total"], "slept_ms": s["slept_ms_total"]}


class BucketStorage(StorageUnderTest):
    """A bucket of the loopback S3 server: what reached it counted by the server itself."""

    def __init__(self, server: Any, condition: Condition):
        self.server, self.condition = server, condition
        self.pid = server.proc.pid if hasattr(server, "proc") else None

    def reset(self) -> None:
        self.server.reset_stats()

    def stats(self) -> dict[str, float]:
        s = self.server.stats()
        return {"requests": s["requests"], "bytes": s["bytes"], "in_flight": s["in_flight"],
                "max_in_flight": s["max_in_flight"], "delay_ms": s["delay_ms"]}


class S3Storage(BucketStorage):
    eviction = ("none needed: the latency is the server's, per request (the bucket's files are in the local "
                "page cache); the server's counters are reset before each case")

    def __init__(self, server: Any, condition: Condition):
        super().__init__(server, condition)
        self.env = {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": "bench",
                    "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}

    def croupier_path(self, ds: str) -> str:
        return f"s3://{BUCKET}/{ds}"


class BucketMountStorage(BucketStorage):
    """The S3 server's bucket through a FUSE client's mount, mounted afresh before each case."""

    def __init__(self, server: Any, condition: Condition):
        super().__init__(server, condition)
        self.eviction = (f"{condition.key} unmounted and mounted again before each case with its defaults (no file "
                         "data kept by the client or the kernel from one case to the next); the server's counters "
                         "are reset before each case")
        self._mount = contextlib.ExitStack()
        self.point: Path | None = None

    def _mounted(self) -> Path:
        mount, _ = bucket_mounts.CLIENTS[self.condition.key]
        self._mount.close()
        self.point = self._mount.enter_context(mount(self.server.endpoint, BUCKET))
        return self.point

    def croupier_path(self, ds: str) -> str:
        return str((self.point or self._mounted()) / ds)

    def before_case(self, ds: str) -> None:
        self._mounted()

    def close(self) -> None:
        self._mount.close()


def data_path(data: BenchData, ds: str) -> Path:
    return data.paths()[ds]


@contextlib.contextmanager
def open_storage(cond: Condition, data: BenchData) -> Iterator[StorageUnderTest]:
    if cond.key == "local":
        yield LocalFiles(data)
    elif cond.key == "fuse":
        with latencyfs.mounted(data.root, median_ms=cond.median_ms, sigma=cond.sigma, distribution="lognormal",
                               seed=cond.seed, max_background=cond.max_background) as fs:
            yield LatencyFSStorage(fs, cond)
    elif cond.key == "s3":
        with _bucket(cond, data) as server:
            st = S3Storage(server, cond)
            saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                                                    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
                                                    "AWS_SESSION_TOKEN", "AWS_PROFILE")}
            for k in saved:
                os.environ.pop(k, None)
            os.environ.update(st.env)  # croupier serve and the trainers inherit them
            try:
                yield st
            finally:
                for k, v in saved.items():
                    os.environ.pop(k, None)
                    if v is not None:
                        os.environ[k] = v
    elif cond.key in BUCKET_MOUNTS:
        with _bucket(cond, data) as server:
            mounted = BucketMountStorage(server, cond)
            try:
                yield mounted
            finally:
                mounted.close()
    else:
        raise ValueError(cond.key)


@contextlib.contextmanager
def _bucket(cond: Condition, data: BenchData) -> Iterator[Any]:
    """The loopback S3 server (its own process) serving the data folder as bucket BUCKET."""
    from . import s3server

    root = Path(tempfile.mkdtemp(prefix="croupier-bench-s3-"))
    try:
        (root / BUCKET).symlink_to(data.root.resolve(), target_is_directory=True)
        with s3server.running(root, latency=s3server.Latency.lognormal(cond.median_ms, cond.sigma, cond.seed),
                              process=True) as server:
            yield server
    finally:
        shutil.rmtree(root, ignore_errors=True)


class Evictor:
    """fs.evict() of one dataset every `period` seconds, on a thread, while a case runs."""

    def __init__(self, st: StorageUnderTest, ds: str, period: float):
        self.st, self.ds, self.period = st, ds, period
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="evictor", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.st.before_case(self.ds)
            self.count += 1

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(30)
        return self.count


class ThreadSampler:
    """The server's per-thread CPU (/proc/PID/task/*/stat) every `period` seconds: threads of an
    I/O pool that shrinks when idle end before the case does, and their last reading still counts."""

    def __init__(self, pid: int, period: float = 1.0):
        self.pid, self.period = pid, period
        self.first = self._named(thread_cpu(pid))
        self.last = dict(self.first)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="thread-sampler", daemon=True)
        self._thread.start()

    def _named(self, snap: dict[int, ThreadCPU]) -> dict[int, ThreadCPU]:
        # Python 3.11 does not name OS threads after threading.Thread names: its threads all read "python"
        out = {}
        for tid, (name, *cpu) in snap.items():
            if tid == self.pid:
                name = "main thread (event loop)"
            elif name == "croupier-read":
                name = "native read threads (blocking preads)"
            elif name.startswith("python"):
                name = "other Python threads (I/O pool, CPU pool)"
            out[tid] = (name, *cpu)
        return out

    def _sample(self) -> None:
        with contextlib.suppress(OSError):
            self.last.update(self._named(thread_cpu(self.pid)))

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def stop(self, total_s: float) -> dict[str, dict[str, float]]:
        self._stop.set()
        self._thread.join(10)
        self._sample()
        return thread_cpu_delta(self.first, self.last, total_s)


class Poller:
    """The storage's counters every `period` seconds, on a thread: (perf_counter, requests, bytes)."""

    def __init__(self, read: Callable[[], dict[str, float] | None], period: float = 0.1):
        self.read, self.period = read, period
        self.points: list[tuple[float, float, float]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="storage-poller", daemon=True)

    def _sample(self) -> None:
        try:
            s = self.read()
        except Exception:  # a missed poll is interpolated over
            self.errors += 1
            return
        if s is not None:
            self.points.append((time.perf_counter(), s["requests"], s["bytes"]))

    def _run(self) -> None:
        self._sample()
        while not self._stop.wait(self.period):
            self._sample()

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sample()

    def delta(self, a: float, b: float) -> tuple[float, float]:
        """Requests and bytes served between perf_counter times a and b (interpolated)."""
        if len(self.points) < 2:
            return float("nan"), float("nan")
        t, r, n = (np.asarray(x, dtype=float) for x in zip(*self.points))
        return float(np.interp(b, t, r) - np.interp(a, t, r)), float(np.interp(b, t, n) - np.interp(a, t, n))


def steady_window(ranks: list[dict[str, Any]], warmup: int) -> tuple[float, float, float]:
    """(start, end, samples): the steady-state window over all ranks in absolute perf_counter
    time (each rank's batches after its warm-up ones, as `aggregate` counts them), and the
    samples that arrived in it."""
    spans = []
    for r in ranks:
        t = r["arrivals_s"]
        if len(t) > 1:
            skip = steady_skip(t, warmup)
            spans.append((r["t0"] + t[skip - 1], r["t0"] + t[-1]))
    if not spans:
        return float("nan"), float("nan"), 0.0
    a, b = min(s for s, _ in spans), max(e for _, e in spans)
    samples = sum(n for r in ranks for t, n in zip(r["arrivals_s"], r["batch_samples"]) if a < r["t0"] + t <= b)
    return a, b, float(samples)


def scrape_metrics(port: int | None) -> dict[str, float]:
    """croupier's own storage counters from its Prometheus endpoint (file or s3 scheme summed)."""
    if not port:
        return {}
    try:
        samples = scrape(port)
    except OSError:
        return {}
    out: dict[str, float] = {}
    for base, _, v in samples:
        if base in ("croupier_storage_reads_total", "croupier_storage_read_bytes_total",
                    "croupier_storage_reads_in_flight_max", "croupier_samples_served_total"):
            key = base.removesuffix("_total")
            out[key] = max(out.get(key, 0.0), v) if key.endswith("_max") else out.get(key, 0.0) + v
    return out


def summarize_profile(prof: dict[str, Any], samples: int, top: int = 20) -> dict[str, Any]:
    """profserve's output, per 1,000 samples served and as shares of the Python CPU."""
    total = prof.get("python_cpu_s") or 1e-9
    per_k = 1000 / max(samples, 1)

    def rows(key: str, field: str) -> list[dict[str, Any]]:
        return [{"function": r["function"], "cpu_s": r[field], "share": r[field] / total,
                 "calls_per_sample": r["calls"] / max(samples, 1), "cpu_ms_per_1k": 1000 * r[field] * per_k}
                for r in prof.get(key, [])[:top]]

    return {"python_cpu_s": prof.get("python_cpu_s"), "process_user_s": prof.get("process_user_s"),
            "process_system_s": prof.get("process_system_s"), "threads_profiled": prof.get("threads_profiled"),
            "threads": [[name, cpu, cpu / total] for name, cpu in prof.get("threads", [])],
            "self": rows("self", "self_s"), "inclusive": rows("inclusive", "inclusive_s"),
            "by_file": [{"file": f, "cpu_s": cpu, "share": cpu / total, "cpu_ms_per_1k": 1000 * cpu * per_k}
                        for f, cpu in prof.get("by_file", [])[:top]]}


# ---- one case -------------------------------------------------------------------------------

def _case(suite: RealSuite, rc: RealCase) -> Case:
    storage = Storage(rc.condition.name, latency_ms=rc.condition.median_ms)
    return Case(rc.dataset, storage, rc.system, batch=suite.batch, world=suite.world, max_batches=suite.max_batches,
                max_seconds=suite.max_seconds, steady_batches=suite.steady_batches,
                steady_per_warmup=suite.steady_per_warmup)


def _tree_bytes(path: Path) -> int:
    """The bytes of the files at or under `path`."""
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _server_flags(suite: RealSuite, rc: RealCase, st: StorageUnderTest, cache_dir: str, extra: dict[str, Any]) -> list[str]:
    """`croupier serve`'s flags for a case: the suite's, metrics on, the condition's cache bound
    (recorded in `extra`), and on S3 the tar index's folder."""
    flags = [*suite.server_flags, "--metrics-port", "0"]
    if rc.condition.cache_share:
        held = int(rc.condition.cache_share * _tree_bytes(Path(st.baseline_path(rc.dataset))))
        flags += ["--cache-memory", str(held)]
        extra["cache_memory_bytes"] = held
    if cache_dir and isinstance(st, S3Storage):
        flags += ["--cache-dir", cache_dir]
    return flags


def run_real_case(suite: RealSuite, rc: RealCase, st: StorageUnderTest, log: Path, index_file: str = "",
                  cache_dir: str = "", profile_out: Path | None = None) -> dict[str, Any]:
    case = _case(suite, rc)
    sysm = rc.system
    st.before_case(rc.dataset)
    st.reset()
    job = RankJob(system=sysm.kind, dataset=rc.dataset, path=st.baseline_path(rc.dataset), rank=0, world=suite.world,
                  batch=suite.batch, max_batches=suite.max_batches, max_seconds=suite.max_seconds,
                  min_batches=sysm.warmup_batches() * (1 + suite.steady_per_warmup) + suite.steady_batches,
                  hard_seconds=suite.hard_seconds, workers=sysm.workers, ordered=sysm.ordered, prefetch=sysm.prefetch,
                  seed=0)
    if isinstance(st, S3Storage) and sysm.kind != "croupier":
        job = replace(job, endpoint=st.server.endpoint, index=index_file if rc.dataset == "text" else "")
    timeout = job.hard_seconds + 180  # the HF download on S3 comes before the first batch
    storage_cpu0 = cpu_seconds(st.pid) if st.pid else None
    extra: dict[str, Any] = {}
    server = None
    with Poller(st.stats) as poller:
        t_start = time.perf_counter()
        if sysm.kind == "croupier":
            flags = _server_flags(suite, rc, st, cache_dir, extra)
            launcher = ("-m", "croupier.bench.profserve", str(profile_out)) if profile_out else ("-m", "croupier.cli")
            server = ServerProcess([f"{rc.dataset}={st.croupier_path(rc.dataset)}"], flags, log, launcher)
            extra["server_start_s"] = time.perf_counter() - t_start
            open_stats = st.stats()
            extra["server_open_requests"] = open_stats["requests"] if open_stats else None
            job = replace(job, path=rc.dataset, address=server.address)
        evictor = Evictor(st, rc.dataset, rc.condition.evict_every_s) if rc.condition.evict_every_s else None
        sampler = None
        try:
            cpu0 = cpu_seconds(server.pid) if server else 0.0
            sampler = ThreadSampler(server.pid) if server else None
            if evictor:
                evictor.start()
            ranks, warnings = run_ranks([replace(job, rank=r) for r in range(suite.world)], timeout)
            if server:
                extra["server_cpu_s"] = cpu_seconds(server.pid) - cpu0
                extra["server_threads_cpu_s"] = sampler.stop(extra["server_cpu_s"]) if sampler else {}
                extra["server_peak_rss_mb"] = peak_rss_mb(server.pid)
                extra["croupier_metrics"] = scrape_metrics(server.metrics_port)
        finally:
            if sampler is not None and "server_threads_cpu_s" not in extra:
                sampler.stop(0.0)
            if evictor:
                extra["evictions"] = evictor.stop()
            if server is not None:
                server.stop()
    end = st.stats()
    storage_cpu = cpu_seconds(st.pid) - storage_cpu0 if st.pid and storage_cpu0 is not None else None
    in_flight = sysm.reads_in_flight(suite.batch)
    res = aggregate(case, ranks, in_flight)
    if server is not None:
        res.server_cpu_s_per_1k = 1000 * extra.pop("server_cpu_s") / max(res.samples, 1)
        res.cpu_s_per_1k += res.server_cpu_s_per_1k
        res.server_peak_rss_mb = extra.pop("server_peak_rss_mb")
    res.extra.update(extra)
    res.extra["warnings"] = warnings
    r = res.as_dict()
    r["condition"] = asdict(rc.condition)
    r["role"] = rc.role
    r["label"] = sysm.label
    # At the storage: the whole case, and the steady window
    a, b, steady_samples = steady_window(ranks, sysm.warmup_batches())
    sr, sb = poller.delta(a, b)
    span = b - a
    storage: dict[str, Any] = {"counted": end is not None}
    if end is not None:
        storage.update({
            "requests": end["requests"], "bytes": end["bytes"], "max_in_flight": end["max_in_flight"],
            "reads_per_sample": end["requests"] / max(res.samples, 1),
            "bytes_per_sample": end["bytes"] / max(res.samples, 1),
            "steady_reads_per_s": sr / span if span > 0 else None,
            "steady_mb_per_s": sb / span / 1e6 if span > 0 else None,
            "steady_reads_per_sample": sr / steady_samples if steady_samples else None,
            "steady_bytes_per_sample": sb / steady_samples if steady_samples else None,
            "steady_window_s": span, "steady_samples": steady_samples, "polls": len(poller.points),
            "cpu_s_per_1k": 1000 * storage_cpu / max(res.samples, 1) if storage_cpu is not None else None,
            "mean_latency_ms_configured": 1000 * rc.condition.mean_latency_s,
        })
        if end.get("slept_ms") is not None and end["requests"]:
            storage["mean_slept_ms"] = end["slept_ms"] / end["requests"]
            storage["slept_over_planned"] = end["slept_ms"] / max(end["delay_ms"], 1e-9)
        elif end.get("delay_ms") is not None and end["requests"]:
            storage["mean_delay_ms"] = end["delay_ms"] / end["requests"]
    r["storage"] = storage
    return r


# ---- ceilings, targets ----------------------------------------------------------------------

def derive(results: list[dict[str, Any]], decode_rates: dict[str, float], cores: int) -> None:
    """Ceilings and comparisons: C/L from what the storage saw, the CPU ceiling (croupier on
    page-cache files, the better of its runs), the decode ceiling; multiples of the best
    DataLoader (and of WebDataset) on the same dataset and storage."""
    cpu_best: dict[str, float] = {}
    for r in results:
        if r["role"] == "cpu ceiling":
            ds = r["case"]["dataset"]
            cpu_best[ds] = max(cpu_best.get(ds, 0.0), r["samples_per_s"])
    best_dl: dict[tuple[str, str], float] = {}
    best_wds: dict[tuple[str, str], float] = {}
    for r in results:
        key = (r["case"]["dataset"], r["condition"]["name"])
        kind = r["case"]["system"]["kind"]
        if r["role"] == "measure" and kind == "dataloader":
            best_dl[key] = max(best_dl.get(key, 0.0), r["samples_per_s"])
        if r["role"] == "measure" and kind == "webdataset":
            best_wds[key] = max(best_wds.get(key, 0.0), r["samples_per_s"])
    for r in results:
        ds, cond = r["case"]["dataset"], r["condition"]
        s = r["storage"]
        r["ceiling_decode"] = decode_rates.get(ds, math.inf) * cores
        io = None
        if cond["median_ms"] and s.get("counted") and s.get("max_in_flight"):
            mean_l = cond["median_ms"] / 1000 * math.exp(cond["sigma"] ** 2 / 2)
            s["c_over_l_reads_per_s"] = s["max_in_flight"] / mean_l
            per = s.get("steady_reads_per_sample") or s.get("reads_per_sample")
            s["reads_per_sample_for_ceiling"] = per
            io = s["c_over_l_reads_per_s"] / per if per else None
            if s.get("steady_reads_per_s") is not None:
                s["fraction_of_c_over_l"] = s["steady_reads_per_s"] / s["c_over_l_reads_per_s"]
        cpu = cpu_best.get(ds) if r["case"]["system"]["kind"] == "croupier" and cond["key"] != "local" else None
        bounds = {k: v for k, v in {"C/L": io, "CPU": cpu}.items() if v}
        r["ceiling_c_over_l"] = io
        r["ceiling_cpu"] = cpu
        if bounds:
            binding = min(bounds, key=bounds.get)
            r["ceiling"], r["ceiling_binding"] = bounds[binding], binding
            r["fraction_of_ceiling"] = r["samples_per_s"] / bounds[binding]
        else:
            r["ceiling"] = r["ceiling_binding"] = r["fraction_of_ceiling"] = None
        key = (ds, cond["name"])
        r["vs_best_dataloader"] = r["samples_per_s"] / best_dl[key] if best_dl.get(key) else None
        r["vs_webdataset"] = r["samples_per_s"] / best_wds[key] if best_wds.get(key) else None


def _find(results: list[dict[str, Any]], ds: str, cond: Condition, label: str) -> dict[str, Any] | None:
    return next((r for r in results if r["role"] == "measure" and r["case"]["dataset"] == ds and r["label"] == label
                 and r["condition"]["name"] == cond.name), None)


def _best(results: list[dict[str, Any]], ds: str, cond: Condition, kind: str = "dataloader") -> dict[str, Any] | None:
    rs = [r for r in results if r["role"] == "measure" and r["case"]["dataset"] == ds and r["case"]["system"]["kind"] == kind
          and r["condition"]["name"] == cond.name]
    return max(rs, key=lambda r: r["samples_per_s"]) if rs else None


#: The issue's targets against the best DataLoader on the latency FS (issue 21): the mount
#: raised (and kept cold), with the kernel's defaults, and larger than memory there.
DATALOADER_TARGETS = ((latency_fs(5.0), {"text": 10.0, "imagefolder": 3.0}),
                      (latency_fs_cold(5.0, 0.5), {"text": 10.0}),
                      (latency_fs_kernel_defaults(5.0), {"text": 3.0, "imagefolder": 2.0}),
                      (latency_fs_larger_than_memory(), {"text": 3.0}))


def check_targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, as numbers (see the report's Targets section)."""
    out: list[dict[str, Any]] = []
    for cond, wants in DATALOADER_TARGETS:
        for ds, want in wants.items():
            cr, dl = _find(results, ds, cond, CROUPIER.label), _best(results, ds, cond)
            if not (cr and dl):
                continue
            bound, which = want * dl["samples_per_s"], f"{want:g}x the best DataLoader"
            if ds == "imagefolder" and 0.7 * cr["ceiling_decode"] < bound:  # no one decodes faster than the CPU
                bound, which = 0.7 * cr["ceiling_decode"], "0.7 of the JPEG decode ceiling"
            out.append(target(f"{ds}, {cond.name}: croupier unordered >= {want:g}x the best DataLoader"
                              + (" or 0.7 of the decode ceiling, whichever is lower" if ds == "imagefolder" else ""),
                              cr["samples_per_s"] / bound, 1.0,
                              f"{cr['samples_per_s']:,.0f} vs {dl['samples_per_s']:,.0f} samples/s ({dl['label']}; "
                              f"the bound {bound:,.0f}: {which}); storage reads per sample "
                              f"{num(cr['storage'].get('reads_per_sample'), '.2f')} vs "
                              f"{num(dl['storage'].get('reads_per_sample'), '.2f')}"))
    ceilinged = (latency_fs(5.0), latency_fs_cold(5.0, 0.5), latency_fs_kernel_defaults(5.0),
                 latency_fs_larger_than_memory(), s3(20.0))
    for cond in ceilinged:
        for ds in ("text", "imagefolder", "shards"):
            cr = _find(results, ds, cond, CROUPIER.label)
            if cr is None or cr.get("fraction_of_ceiling") is None:
                continue
            s = cr["storage"]
            out.append(target(f"{ds}, {cr['condition']['name']}: croupier unordered >= 0.7 of min(C/L, CPU ceiling)",
                              cr["fraction_of_ceiling"], 0.7,
                              f"{cr['samples_per_s']:,.0f} of {cr['ceiling']:,.0f} samples/s ({cr['ceiling_binding']}; "
                              f"C/L {num(cr['ceiling_c_over_l'])} = {s.get('max_in_flight', 0):,.0f} in flight / "
                              f"{s.get('mean_latency_ms_configured', 0):.2f} ms / "
                              f"{num(s.get('reads_per_sample_for_ceiling'), '.2f')} reads per sample; "
                              f"CPU {num(cr['ceiling_cpu'])})"))
    for ds in ("text", "imagefolder"):
        cr, dl = _find(results, ds, s3(20.0), CROUPIER.label), _best(results, ds, s3(20.0))
        if cr and dl:
            out.append(target(f"{ds}, S3: croupier unordered >= 10x the best DataLoader",
                              cr["samples_per_s"] / dl["samples_per_s"], 10.0,
                              f"{cr['samples_per_s']:,.0f} vs {dl['samples_per_s']:,.0f} samples/s ({dl['label']})"))
    # A bucket through a FUSE client (issue 21): croupier given the mount path >= 2x the best DataLoader
    # through the same mount; croupier given s3:// >= 10x it.
    for key in BUCKET_MOUNTS:
        mount = bucket_mount(key)
        for ds in ("text", "imagefolder"):
            dl = _best(results, ds, mount)
            if dl is None:
                continue
            for cr, want, how in ((_find(results, ds, mount, CROUPIER.label), 2.0, "given the mount path"),
                                  (_find(results, ds, s3(20.0), CROUPIER.label), 10.0, "given s3://")):
                if cr is not None:
                    out.append(target(f"{ds}, {dl['condition']['name']}: croupier unordered {how} >= {want:g}x the "
                                      "best DataLoader through the mount", cr["samples_per_s"] / dl["samples_per_s"],
                                      want, f"{cr['samples_per_s']:,.0f} vs {dl['samples_per_s']:,.0f} samples/s "
                                      f"({dl['label']})"))
    return out


# ---- the suite ------------------------------------------------------------------------------

def run_real(suite: RealSuite, out: Path, data_dir: Path, command: str, say: Callable[[str], None] = print,
             only: str = "") -> Report:
    """Runs `suite` (only the cases whose "dataset | storage | system | role" contains `only`) and
    writes `<suite>.json`, `.md` and the plots under `out`."""
    from . import realreport

    return drive(suite.name, out, command, lambda rep: RealRun(suite, rep, say).measure(data_dir, only),
                 realreport.markdown, realreport.plots, say)


class RealRun:
    """One run of a real suite: the storage conditions in turn, each case through the storage's
    own counters; what it measures goes into `rep`. Its server log, the text's record-batch
    index and the profile live in a folder of its own, removed when `measure` returns."""

    data: BenchData
    #: The run's own folder, its server log, and the text's record-batch index in it.
    work: Path
    log: Path
    index_file: str
    #: croupier's tar index of s3:// shards, kept beside the data between runs.
    tar_cache: Path

    def __init__(self, suite: RealSuite, rep: Report, say: Callable[[str], None]):
        self.suite, self.rep, self.say = suite, rep, say
        self.results: list[dict[str, Any]] = []
        self.done = self.total = 0

    def measure(self, data_dir: Path, only: str = "") -> None:
        suite, rep = self.suite, self.rep
        rep.update({"data": asdict(suite.data), "batch": suite.batch, "world": suite.world,
                    "server_flags": list(suite.server_flags), "skipped": [],
                    "limits": {"max_batches": suite.max_batches, "max_seconds": suite.max_seconds,
                               "hard_seconds": suite.hard_seconds}})
        self.data = ensure_data(data_dir, suite.data, log=self.say)
        decode = DecodeCeiling(self.data.paths(), suite.decode_seconds, self.say)
        self.tar_cache = data_dir.parent / f"{data_dir.name}-tar-index"
        with tempfile.TemporaryDirectory(prefix=f"croupier-bench-{suite.name}-", ignore_cleanup_errors=True) as work:
            self.work = Path(work)
            # CROUPIER_BENCH_SERVER_LOG=FILE keeps the servers' logs (else they go with the run's folder);
            # CROUPIER_BENCH_SERVER_LOG_LEVEL=INFO says more in them (default WARNING)
            kept = os.environ.get("CROUPIER_BENCH_SERVER_LOG")
            self.log = Path(kept) if kept else self.work / "server.log"
            self.log.write_text("")
            self.index_file = self._text_index()
            rep["conditions"] = {}
            plan = [(cond, [c for c in group if not only or only in
                            f"{c.dataset} | {c.condition.name} | {c.system.label} | {c.role}"])
                    for cond, group in suite.plan()]
            plan = [(cond, group) for cond, group in plan if group]
            self.total = sum(len(g) for _, g in plan)
            fuse_reason = latencyfs.check_available()
            for cond, todo in plan:
                why = (f"latencyfs is unusable here: {fuse_reason}" if cond.key == "fuse" and fuse_reason else
                       bucket_mounts.CLIENTS[cond.key][1]() if cond.key in BUCKET_MOUNTS else None)
                if why:
                    rep["skipped"].append(f"{cond.name}: skipped, {why}")
                    self.say(f"skipping {cond.name}: {why}")
                    self.done += len(todo)
                    continue
                self._condition(cond, todo)
        rates = decode.end(rep, self.say)
        derive(self.results, rates, rep["machine"]["cores"])
        rep["cases"] = self.results
        if suite.targets:
            rep["targets"] = check_targets(self.results)

    def _text_index(self) -> str:
        """The text's Arrow record batches (file, offset, bytes, rows), for the S3 baselines' ranged GETs."""
        from .s3baselines import arrow_batch_index

        index = arrow_batch_index(self.data.text)
        path = self.work / "text-batches.json"
        path.write_text(json.dumps(index))
        self.rep["text_record_batches"] = {
            "files": len(index["files"]), "batches": len(index["batches"]),
            "rows_per_batch": index["batches"][0][4] if index["batches"] else 0,
            "mean_batch_bytes": float(np.mean([b[2] for b in index["batches"]]))}
        return str(path)

    def _condition(self, cond: Condition, todo: list[RealCase]) -> None:
        """The cases of one storage condition, on one mount or S3 server."""
        with open_storage(cond, self.data) as st:
            about = self.rep["conditions"].setdefault(cond.name, {
                "key": cond.key, "median_ms": cond.median_ms, "sigma": cond.sigma, "seed": cond.seed,
                "mean_ms": 1000 * cond.mean_latency_s, "evict_every_s": cond.evict_every_s,
                "eviction": st.eviction + (f", and again every {cond.evict_every_s:g} s during the case"
                                           if cond.evict_every_s else "")
                + (f"; croupier's server cache held to {cond.cache_share:.0%} of the case's dataset (`--cache-memory`)"
                   if cond.cache_share else "")})
            if any(c.dataset == "shards" and c.system.kind == "croupier" for c in todo):
                if cond.key == "s3":
                    about["tar_index_s"] = _prepare_tar_index(st.croupier_path("shards"),
                                                              ["--cache-dir", str(self.tar_cache)], self.log, self.say)
                elif cond.key == "fuse":  # beside the shards in the source folder (the mount is read-only)
                    about["tar_index_s"] = _prepare_tar_index(str(self.data.shards), [], self.log, self.say)
            for rc in todo:
                self._case(rc, st)

    def _case(self, rc: RealCase, st: StorageUnderTest) -> None:
        suite, rep = self.suite, self.rep
        self.done += 1
        what = f"{rc.dataset} | {rc.condition.name} | {rc.system.label}" + (f" ({rc.role})" if rc.role != "measure" else "")
        self.say(f"[{self.done}/{self.total}] {what} ...")
        t = time.perf_counter()
        prof = self.work / "profile.json" if rc.role == "profile" else None
        run_as = suite if prof is None else replace(
            suite, max_seconds=suite.profile_seconds, max_batches=max(suite.max_batches, 4000),
            hard_seconds=max(suite.hard_seconds, suite.profile_seconds + 5))
        r = attempt(rep, what, lambda: run_real_case(run_as, rc, st, self.log, self.index_file, str(self.tar_cache),
                                                     prof), self.say)
        if r is None:
            return
        if prof is not None:
            self._profiled(what, r, prof)
            return
        self.results.append(r)
        rep["errors"] += [f"{what}: {w}" for w in r["extra"].get("warnings", [])]
        s = r["storage"]
        self.say(f"    {r['samples_per_s']:,.0f} samples/s, first batch {r['first_batch_s']:.2f} s"
                 + (f", storage {num(s.get('steady_reads_per_s'))} reads/s, {s['reads_per_sample']:.2f} reads and "
                    f"{s['bytes_per_sample'] / 1024:,.1f} KB per sample, max {s['max_in_flight']:,.0f} in flight"
                    if s.get("counted") else "")
                 + f" ({time.perf_counter() - t:.1f} s)")

    def _profiled(self, what: str, r: dict[str, Any], prof: Path) -> None:
        """The profile run's summary into rep["profile"] (it is not a result of its own)."""
        try:
            summary = summarize_profile(json.loads(prof.read_text()), r["samples"])
        except (OSError, ValueError) as exc:
            self.rep["errors"].append(f"{what}: no profile written ({exc})")
            return
        self.rep["profile"] = {"case": what, "samples_per_s": r["samples_per_s"], "samples": r["samples"],
                               "server_cpu_s_per_1k": r["server_cpu_s_per_1k"],
                               "server_threads_cpu_s": r["extra"].get("server_threads_cpu_s"), **summary}
        self.say(f"    profiled at {r['samples_per_s']:,.0f} samples/s; top (self CPU): "
                 + ", ".join(f"{x['function']} {x['share']:.0%}" for x in summary["self"][:3]))


def _prepare_tar_index(shards: str, flags: list[str], log: Path, say: Callable[[str], None]) -> float:
    """croupier scans a tar shard's headers once and keeps its offset index (`<shard>.idx.json`
    beside a local shard, under --cache-dir for s3://): done before the cases, as a deployment
    would ship or cache it. Without it the first server on the latency FS would read every
    shard whole through the mount at start, and serve the case from the page cache."""
    t = time.perf_counter()
    ServerProcess([f"shards={shards}"], flags, log).stop()
    took = time.perf_counter() - t
    say(f"croupier's tar index of {shards} ready in {took:.1f} s")
    return took
