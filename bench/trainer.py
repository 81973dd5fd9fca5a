"""One trainer rank of one benchmark case, in its own process.

    python -m croupier.bench.trainer '<RankJob as JSON>'

It builds the loader of the system under test, takes batches until `max_batches`, or
`max_seconds` after the first once it has `min_batches` (slow systems need a few
intervals for a rate), or `hard_seconds` after the first, and prints one JSON line of what it measured at the trainer: when each
batch arrived, samples and bytes, CPU seconds of this process and its workers, peak RSS.
No training step: the figures are those of the data path alone.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from .procstat import cpu_seconds, peak_rss_mb, tree_private_rss_mb


@dataclass(frozen=True)
class RankJob:
    system: str  # "croupier", "dataloader", "hf", "webdataset"
    dataset: str  # "text", "imagefolder", "shards"
    path: str  # the files (baselines) or the server's dataset name (croupier)
    rank: int
    world: int
    batch: int
    max_batches: int
    #: Stop this long after the first batch, once `min_batches` have arrived ...
    max_seconds: float
    min_batches: int = 5
    #: ... and in any case this long after the first batch.
    hard_seconds: float = 15.0
    workers: int = 0
    ordered: bool = False
    prefetch: int = 0
    address: str = ""
    latency_ms: float = 0.0
    latency_sigma: float = 0.5
    seed: int = 0
    #: Baselines reading an S3 bucket (`path` an s3:// URL): the endpoint, and for text the
    #: record-batch index file (see s3baselines); empty for files.
    endpoint: str = ""
    index: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def build_loader(job: RankJob) -> tuple[Any, Any]:
    """(iterable of batches, closer)."""
    from . import baselines

    latency = baselines.Latency(job.latency_ms, job.latency_sigma, job.seed)
    common = dict(rank=job.rank, world=job.world, batch=job.batch, workers=job.workers, latency=latency)
    if job.system == "croupier":
        from croupier.client import Loader

        loader = Loader(job.path, servers=job.address, batch_size=job.batch, rank=job.rank, world_size=job.world,
                        seed=job.seed, ordered=job.ordered, prefetch=job.prefetch)
        return loader, loader.close
    if job.endpoint:
        from . import s3baselines

        s3 = dict(endpoint=job.endpoint, rank=job.rank, world=job.world, batch=job.batch, workers=job.workers,
                  seed=job.seed)
        if job.system == "dataloader":
            return s3baselines.dataloader(job.dataset, job.path, index=job.index, **s3), None
        if job.system == "hf":
            loader = s3baselines.hf_downloaded(job.path, **s3)
            return loader, loader.close
        if job.system == "webdataset":
            return s3baselines.webdataset_http(job.path, **s3), None
        raise ValueError(f"no S3 baseline for system {job.system!r}")
    if job.system == "dataloader":
        return baselines.dataloader(job.dataset, job.path, seed=job.seed, **common), None
    if job.system == "hf":
        return baselines.hf_shuffled(job.path, seed=job.seed, **common), None
    if job.system == "webdataset":
        return baselines.webdataset(job.path, seed=job.seed, **common), None
    raise ValueError(f"unknown system {job.system!r}")


def batch_size_and_bytes(batch: dict[str, Any]) -> tuple[int, int]:
    """Samples in a collated batch and the bytes of its data (tensors, strings)."""
    import torch

    n, nbytes = 0, 0
    for value in batch.values():
        if isinstance(value, torch.Tensor):
            n = max(n, len(value))
            nbytes += value.numel() * value.element_size()
        elif isinstance(value, list):
            n = max(n, len(value))
            nbytes += sum(len(v.encode()) if isinstance(v, str) else len(v) for v in value)
    return n, nbytes


def preimport(job: RankJob) -> None:
    """Import the system's modules before the clock starts: time to first batch is the loader's."""
    import torch  # noqa: F401

    if job.system == "croupier":
        import croupier.client  # noqa: F401
    elif job.system == "hf":
        import datasets  # noqa: F401
    elif job.system == "webdataset":
        import webdataset  # noqa: F401
    if job.endpoint:
        import boto3  # noqa: F401
        import pyarrow.fs  # noqa: F401

        from . import s3baselines  # noqa: F401
    from . import baselines  # noqa: F401


def run(job: RankJob) -> dict[str, Any]:
    preimport(job)
    cpu0 = cpu_seconds(children=True)
    t0 = time.perf_counter()
    loader, close = build_loader(job)
    arrivals: list[float] = []
    batch_samples: list[int] = []
    nbytes, workers_rss = 0, 0.0
    it = iter(loader)
    try:
        for batch in it:
            now = time.perf_counter() - t0
            n, b = batch_size_and_bytes(batch)
            arrivals.append(now)
            batch_samples.append(n)
            nbytes += b
            elapsed = now - arrivals[0]
            enough = len(arrivals) >= job.min_batches and elapsed >= job.max_seconds
            if len(arrivals) >= job.max_batches or enough or elapsed >= job.hard_seconds:
                break
        workers_rss = tree_private_rss_mb()  # before the workers exit
    finally:
        del it  # shuts DataLoader workers down (joined, so their CPU counts below)
        if close is not None:
            close()
    return {
        "rank": job.rank,
        "t0": t0,  # time.perf_counter() when the loader was built: CLOCK_MONOTONIC, the same in every process
        "arrivals_s": arrivals,
        "samples": sum(batch_samples),
        "batch_samples": batch_samples,
        "bytes": nbytes,
        "cpu_s": cpu_seconds(children=True) - cpu0,
        "peak_rss_mb": peak_rss_mb(),
        "workers_private_rss_mb": workers_rss,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job = RankJob(**json.loads(argv[0]))
    print(json.dumps(run(job)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
