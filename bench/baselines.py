"""The loaders users pick today, built over the benchmark's files.

Each returns an iterable of collated batches shaped like croupier's (a dict of tensors
and lists), for one rank of `world` ranks. Injected storage latency is the server's own
distribution (`LatencySampler`: seeded lognormal, same median and sigma) slept before
every sample read, the way a network file system makes each random read wait.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate, get_worker_info


@dataclass(frozen=True)
class Latency:
    """Per-read latency: lognormal with this median (0 = none), as `croupier serve --latency-ms`."""

    median_ms: float = 0.0
    sigma: float = 0.5
    seed: int = 0

    def sampler(self, stream: int):
        from croupier.server.readers.latency import LatencySampler

        # One independent, seeded stream per (rank, worker), like the server's per-process one.
        return LatencySampler("lognormal", self.median_ms, self.sigma, self.seed * 1_000_003 + stream)


class LatencyDataset(Dataset):
    """`inner[i]` after sleeping one draw of the read latency: one read at a time per worker."""

    def __init__(self, inner: Any, latency: Latency, rank: int):
        self.inner, self.latency, self.rank = inner, latency, rank
        self._sampler = None

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Any:
        if self._sampler is None:
            worker = get_worker_info()
            self._sampler = self.latency.sampler(self.rank * 1000 + (worker.id + 1 if worker else 0))
        time.sleep(self._sampler())
        return self.inner[i]


class ArrowRows(Dataset):
    """Rows of a save_to_disk folder, memory-mapped and read with pyarrow: a lean map-style
    Dataset (no `datasets` per-row overhead), the strongest plain DataLoader baseline."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._table = None
        self._len = None

    @property
    def table(self):
        if self._table is None:  # opened lazily: each worker maps the files itself
            from croupier.server.readers import open_dataset

            self._table = open_dataset(self.path).mapped_table()
        return self._table

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.table.slice(i, 1).to_pylist()[0]
        if isinstance(row.get("tokens"), list):
            row["tokens"] = torch.tensor(row["tokens"], dtype=torch.int32)
        return row


def list_imagefolder(root: str | os.PathLike) -> tuple[list[str], list[int]]:
    """Files and labels in torchvision ImageFolder order (sorted classes, sorted files)."""
    root = Path(root)
    files: list[str] = []
    labels: list[int] = []
    for label, cls in enumerate(sorted(d.name for d in root.iterdir() if d.is_dir())):
        names = sorted(os.listdir(root / cls))
        files += [str(root / cls / n) for n in names]
        labels += [label] * len(names)
    return files, labels


def decode_jpeg(data: bytes) -> torch.Tensor:
    """uint8 CHW by Pillow, as torchvision's default image loader decodes (the baselines' decoder)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return torch.from_numpy(np.asarray(img.convert("RGB")).copy()).permute(2, 0, 1)


class ImageFiles(Dataset):
    """torchvision's ImageFolder without torchvision: read a file, decode it, return (image, label)."""

    def __init__(self, root: str | os.PathLike):
        self.files, self.labels = list_imagefolder(root)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, Any]:
        with open(self.files[i], "rb") as f:
            return {"image": decode_jpeg(f.read()), "label": self.labels[i]}


def _loader(ds: Any, batch: int, workers: int, **kw: Any) -> DataLoader:
    return DataLoader(
        ds, batch_size=batch, num_workers=workers, prefetch_factor=2 if workers else None,
        persistent_workers=False, **kw
    )


def dataloader(dataset: str, path: str, *, rank: int, world: int, batch: int, workers: int, latency: Latency,
               seed: int = 0) -> DataLoader:
    """DataLoader + DistributedSampler(shuffle=True): the stock global shuffle."""
    ds: Any = ArrowRows(path) if dataset == "text" else ImageFiles(path)
    if latency.median_ms:
        ds = LatencyDataset(ds, latency, rank)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    return _loader(ds, batch, workers, sampler=sampler)


def hf_shuffled(path: str, *, rank: int, world: int, batch: int, workers: int, latency: Latency,
                seed: int = 0) -> DataLoader:
    """load_from_disk + .shuffle(seed) (an indices mapping), split by node, through a DataLoader."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    ds: Any = datasets.load_from_disk(path)
    try:
        ds = ds.shuffle(seed=seed)  # writes its indices mapping beside the data, as a cache file
    except OSError:  # a read-only folder (a network mount): what users do there, the mapping in memory
        ds = ds.shuffle(seed=seed, keep_in_memory=True)
    ds = split_dataset_by_node(ds, rank=rank, world_size=world).with_format("torch")
    if latency.median_ms:
        ds = LatencyDataset(ds, latency, rank)
    return _loader(ds, batch, workers)


def webdataset(path: str | list[str], *, rank: int, world: int, batch: int, workers: int, latency: Latency,
               buffer: int = 1000, seed: int = 0) -> Iterable[dict[str, Any]]:
    """WebDataset over the tar shards (a folder's `*.tar`, or a list of URLs): shard shuffle,
    then a `buffer`-sample shuffle buffer."""
    import webdataset as wds

    shards = sorted(str(p) for p in Path(path).glob("*.tar")) if isinstance(path, (str, os.PathLike)) else list(path)
    state: dict[str, Any] = {}

    def wait(sample: dict) -> dict:
        if "sampler" not in state:
            worker = get_worker_info()
            state["sampler"] = latency.sampler(rank * 1000 + (worker.id + 1 if worker else 0))
        time.sleep(state["sampler"]())
        return sample

    pipeline = wds.WebDataset(
        shards, shardshuffle=len(shards), seed=seed, nodesplitter=lambda urls: list(urls)[rank::world],
        empty_check=False,
    )
    if latency.median_ms:
        pipeline = pipeline.map(wait)
    pipeline = (
        pipeline.shuffle(buffer)
        .map(lambda s: {"image": decode_jpeg(s["jpg"]), "label": int(s["cls"])})
        .batched(batch, collation_fn=default_collate, partial=False)
    )
    return DataLoader(pipeline, batch_size=None, num_workers=workers, prefetch_factor=2 if workers else None)
