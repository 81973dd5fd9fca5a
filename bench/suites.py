"""What each suite runs: data sizes, storage conditions, systems, and how long each case may take.

* full: every system on every storage condition and dataset, plus the curves.
* first: the data plane's first benchmark (text, 5 ms and page cache, batch 64, 2 ranks:
  croupier unordered and ordered vs DataLoader + DistributedSampler with 2 workers).
* quick: a one-minute smoke run on tiny data (used by the tests).
* real: every system reading the same files through really slow storage (a latency
  FUSE mount, a loopback S3 server, a bucket through rclone and s3fs): see real.py; real-quick
  is its smoke run, real-mounts its bucket-mount conditions alone.
* peers: croupier beside Mosaic Streaming, LitData, tf.data service and torchdata on that
  storage, each peer in its own venv (see peers/); peers-quick is its smoke run.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cases import (
    COLD_DISK,
    CROUPIER,
    NO_WAIT,
    CROUPIER_ORDERED,
    HF_SHUFFLE,
    PAGE_CACHE,
    WEBDATASET,
    Case,
    Storage,
    System,
    dataloader,
    latency,
)
from .datagen import DataSpec


@dataclass(frozen=True)
class Curves:
    #: croupier unordered, 1 rank, at this latency, with these server reads-in-flight limits.
    in_flight_latency_ms: float = 20.0
    in_flight: tuple[int, ...] = (8, 32, 128, 512, 2048)
    #: concurrent streams against one server (the load test), at this latency.
    streams_latency_ms: float = 5.0
    streams: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    streams_seconds: float = 3.0
    #: planner time and memory for these dataset sizes (rows); numpy's permutation up to the limit.
    planner_sizes: tuple[int, ...] = (10**3, 10**4, 10**5, 10**6, 10**7, 10**8, 10**9)
    numpy_limit: int = 10**8
    shuffle_rows: int = 100_000


@dataclass(frozen=True)
class Suite:
    name: str
    data: DataSpec
    cases: tuple[Case, ...]
    curves: Curves | None = None
    shuffle_quality: bool = True
    #: The targets to check, by name (see report.targets).
    targets: tuple[str, ...] = ()
    #: How long the one-core decode rate is measured, per dataset kind.
    decode_seconds: float = 1.5


STORAGE = (PAGE_CACHE, latency(1), latency(5), latency(20), COLD_DISK)
SYSTEMS: dict[str, tuple[System, ...]] = {
    "text": (CROUPIER, CROUPIER_ORDERED, dataloader(0), dataloader(2), dataloader(8), HF_SHUFFLE),
    "imagefolder": (CROUPIER, CROUPIER_ORDERED, dataloader(0), dataloader(2), dataloader(8)),
    "shards": (CROUPIER, CROUPIER_ORDERED, WEBDATASET),
}


def _matrix(storage: tuple[Storage, ...], systems: dict[str, tuple[System, ...]], **kw) -> tuple[Case, ...]:
    return tuple(Case(ds, st, sy, **kw) for ds, sys_ in systems.items() for st in storage for sy in sys_)


def full() -> Suite:
    cpu_ceiling = _matrix((NO_WAIT,), {ds: (CROUPIER,) for ds in SYSTEMS}, max_batches=400, max_seconds=2.5)
    return Suite(
        name="full",
        data=DataSpec(),
        cases=(*cpu_ceiling, *_matrix(STORAGE, SYSTEMS, max_batches=400, max_seconds=2.5), *cpu_ceiling),
        curves=Curves(),
        targets=("full",),
    )


def first() -> Suite:
    systems = {"text": (CROUPIER, CROUPIER_ORDERED, dataloader(2))}
    return Suite(
        name="first",
        data=DataSpec(),
        cases=(Case("text", NO_WAIT, CROUPIER, max_batches=400, max_seconds=5.0),
               *_matrix((latency(5), PAGE_CACHE), systems, max_batches=400, max_seconds=5.0),
               Case("text", NO_WAIT, CROUPIER, max_batches=400, max_seconds=5.0)),
        shuffle_quality=False,
        targets=("first",),
    )


def quick() -> Suite:
    # One rank and few cases: process start-up (torch, grpc) is most of a case's time.
    kw = dict(world=1, max_batches=25, max_seconds=0.5, steady_batches=2, steady_per_warmup=1)
    cases = (
        *_matrix((PAGE_CACHE,), {"text": (CROUPIER, dataloader(0))}, **kw),
        *_matrix((latency(5),), {"text": (CROUPIER, dataloader(2)), "shards": (WEBDATASET,)}, **kw),
    )
    return Suite(
        name="quick",
        data=DataSpec(text_rows=4_000, images=600, shard_size=100),
        cases=cases,
        curves=Curves(in_flight=(64,), streams=(1, 4), streams_seconds=0.3,
                      planner_sizes=(10**3, 10**6, 10**9), numpy_limit=10**6, shuffle_rows=10_000),
        targets=("first",),
        decode_seconds=0.3,
    )


def _real():
    from .real import real

    return real()


def _real_mounts():
    from .real import real_mounts

    return real_mounts()


def _real_quick():
    from .real import real_quick

    return real_quick()


def _peers():
    from .peers.suite import full as peers_full

    return peers_full()


def _peers_quick():
    from .peers.suite import quick as peers_quick

    return peers_quick()


SUITES = {"full": full, "first": first, "quick": quick, "real": _real, "real-quick": _real_quick, "real-mounts": _real_mounts,
          "peers": _peers, "peers-quick": _peers_quick}
