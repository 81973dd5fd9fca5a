"""The baselines reading an S3 bucket the way users of each read one (the `real` suite).

All of them talk to the same endpoint (the loopback S3 server, its latency applied in the
server), with the same files croupier serves: `s3://BUCKET/text` (the save_to_disk
folder), `s3://BUCKET/imagefolder`, `s3://BUCKET/shards`.

* images, DataLoader + DistributedSampler: a map-style Dataset listing the keys once
  (ListObjectsV2) and doing one boto3 `get_object` per image, then decoding it: what an
  ImageFolder-on-S3 Dataset looks like.
* text, DataLoader + DistributedSampler: a map-style Dataset that reads the Arrow record
  batch holding the row with one ranged GET (pyarrow's S3FileSystem, `read_at`), decodes
  it and keeps the row. The stream format HF writes has no footer, so the batches'
  offsets are given to it (an index computed from the files beforehand, as a user would
  ship beside the data); without one it would have to read every file from the start.
* text, HF datasets: `load_from_disk("s3://...")` downloads the whole folder to a local
  temporary folder (fsspec/s3fs) and memory-maps it; s3fs is not installed here, so the
  download is done with boto3 (8 files at a time), then load_from_disk + shuffle +
  split_dataset_by_node + DataLoader as on local files. Its first batch waits for the
  download; each rank downloads its own copy, as each process would.
* shards, WebDataset: the shards' http URLs (curl, as WebDataset's gopen does for http;
  one streaming GET per shard), the same pipeline as on files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .baselines import Latency, _loader, decode_jpeg, webdataset

CREDENTIALS = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench", "region_name": "us-east-1"}


def split_url(url: str) -> tuple[str, str]:
    """s3://bucket/prefix -> (bucket, prefix)."""
    u = urlparse(url)
    if u.scheme != "s3":
        raise ValueError(f"not an s3:// URL: {url}")
    return u.netloc, u.path.strip("/")


def boto3_client(endpoint: str):
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client("s3", endpoint_url=endpoint, config=Config(retries={"max_attempts": 3}),
                                          **CREDENTIALS)


def list_keys(endpoint: str, bucket: str, prefix: str) -> list[str]:
    pages = boto3_client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


class _PerProcess:
    """A client made lazily in each process (DataLoader workers are forked: boto3 clients and
    pyarrow's S3 client must not cross a fork)."""

    def __init__(self, make):
        self._make, self._pid, self._value = make, None, None

    def get(self):
        if self._pid != os.getpid():
            self._value, self._pid = self._make(), os.getpid()
        return self._value

    def __getstate__(self):
        return {"_make": self._make, "_pid": None, "_value": None}


class _Boto3Factory:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def __call__(self):
        return boto3_client(self.endpoint)


class S3ImageFiles(Dataset):
    """ImageFolder on S3: keys listed once, one GetObject per image, decoded as on files."""

    def __init__(self, url: str, endpoint: str):
        self.bucket, prefix = split_url(url)
        keys = sorted(k for k in list_keys(endpoint, self.bucket, prefix)
                      if k.lower().endswith((".jpg", ".jpeg", ".png")))
        classes = sorted({k[len(prefix) + 1:].split("/")[0] for k in keys})
        label = {c: i for i, c in enumerate(classes)}
        # torchvision's order: classes sorted, files sorted within each
        self.keys = keys
        self.labels = [label[k[len(prefix) + 1:].split("/")[0]] for k in keys]
        self._client = _PerProcess(_Boto3Factory(endpoint))

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> dict[str, Any]:
        body = self._client.get().get_object(Bucket=self.bucket, Key=self.keys[i])["Body"].read()
        return {"image": decode_jpeg(body), "label": self.labels[i]}


# ---- text: the record batch holding each row, by a ranged GET -----------------------------

def arrow_batch_index(folder: str | os.PathLike) -> dict[str, Any]:
    """Where each record batch of a save_to_disk folder's Arrow stream files lies:
    {"files": [name], "schema": [offset, length] (in files[0]), "batches": [[file, offset,
    length, first row, rows]], "rows": n}, from the local files, message by message."""
    import pyarrow as pa

    folder = Path(folder)
    state = json.loads((folder / "state.json").read_text())
    files = [f["filename"] for f in state["_data_files"]]
    batches: list[list[int]] = []
    schema_range: list[int] = []
    row = 0
    for fno, name in enumerate(files):
        schema = None
        with pa.OSFile(str(folder / name)) as f:
            reader = pa.ipc.MessageReader.open_stream(f)
            while True:
                start = f.tell()
                try:
                    msg = reader.read_next_message()
                except StopIteration:
                    break
                length = f.tell() - start
                if msg.type == "schema":
                    schema = pa.ipc.read_schema(msg)
                    if not schema_range:
                        schema_range = [start, length]
                elif msg.type == "record batch":
                    n = pa.ipc.read_record_batch(msg, schema).num_rows
                    batches.append([fno, start, length, row, n])
                    row += n
    return {"files": files, "schema": schema_range, "batches": batches, "rows": row}


class _ArrowS3Factory:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def __call__(self):
        import pyarrow.fs as pafs

        u = urlparse(self.endpoint)
        return pafs.S3FileSystem(access_key=CREDENTIALS["aws_access_key_id"],
                                 secret_key=CREDENTIALS["aws_secret_access_key"], region=CREDENTIALS["region_name"],
                                 endpoint_override=u.netloc, scheme=u.scheme or "http")


class S3ArrowBatchRows(Dataset):
    """Rows of a save_to_disk folder on S3: each row by one ranged GET of the record batch
    holding it (pyarrow S3FileSystem), decoded with pyarrow, the row kept."""

    def __init__(self, url: str, endpoint: str, index: dict[str, Any]):
        bucket, prefix = split_url(url)
        self.paths = [f"{bucket}/{prefix}/{name}" for name in index["files"]]
        self.schema_range = index["schema"]
        b = np.asarray(index["batches"], dtype=np.int64).reshape(-1, 5)
        self.batch_file, self.batch_offset, self.batch_length, self.batch_first = b[:, 0], b[:, 1], b[:, 2], b[:, 3]
        self.rows = int(index["rows"])
        self._fs = _PerProcess(_ArrowS3Factory(endpoint))
        self._files: dict[int, Any] = {}
        self._schema = None
        self._pid = None

    def __len__(self) -> int:
        return self.rows

    def _file(self, fno: int):
        if self._pid != os.getpid():  # fresh handles in each worker
            self._files, self._schema, self._pid = {}, None, os.getpid()
        f = self._files.get(fno)
        if f is None:
            f = self._files[fno] = self._fs.get().open_input_file(self.paths[fno])
        return f

    def __getitem__(self, i: int) -> dict[str, Any]:
        import pyarrow as pa

        b = int(np.searchsorted(self.batch_first, i, side="right") - 1)
        f = self._file(int(self.batch_file[b]))
        if self._schema is None:  # the schema message of the first file: one ranged GET per process
            off, length = self.schema_range
            self._schema = pa.ipc.read_schema(pa.ipc.read_message(self._file(0).read_at(length, off)))
        raw = f.read_at(int(self.batch_length[b]), int(self.batch_offset[b]))
        batch = pa.ipc.read_record_batch(pa.ipc.read_message(raw), self._schema)
        row = batch.slice(i - int(self.batch_first[b]), 1).to_pylist()[0]
        if isinstance(row.get("tokens"), list):
            row["tokens"] = torch.tensor(row["tokens"], dtype=torch.int32)
        return row


def dataloader(dataset: str, url: str, *, endpoint: str, index: str, rank: int, world: int, batch: int,
               workers: int, seed: int = 0, **_: Any) -> DataLoader:
    """DataLoader + DistributedSampler(shuffle=True) over S3 objects."""
    if dataset == "text":
        ds: Any = S3ArrowBatchRows(url, endpoint, json.loads(Path(index).read_text()))
    else:
        ds = S3ImageFiles(url, endpoint)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    return _loader(ds, batch, workers, sampler=sampler)


def download(url: str, endpoint: str, dest: Path, threads: int = 8) -> int:
    """Every object under the URL's prefix into `dest` (keys relative to the prefix); bytes."""
    bucket, prefix = split_url(url)
    keys = list_keys(endpoint, bucket, prefix)
    client = boto3_client(endpoint)

    def get(key: str) -> int:
        target = dest / key[len(prefix) + 1:]
        target.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, key, str(target))
        return target.stat().st_size

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(get, keys))


class _Downloaded:
    """An iterable DataLoader that removes its downloaded copy when closed."""

    def __init__(self, loader: DataLoader, folder: str):
        self.loader, self.folder = loader, folder

    def __iter__(self):
        return iter(self.loader)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def hf_downloaded(url: str, *, endpoint: str, rank: int, world: int, batch: int, workers: int, seed: int = 0,
                  **_: Any) -> _Downloaded:
    """load_from_disk of an s3:// folder, as `datasets` does it: download, then memory-map."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    tmp = tempfile.mkdtemp(prefix="croupier-bench-hf-s3-")
    download(url, endpoint, Path(tmp))
    ds: Any = datasets.load_from_disk(tmp).shuffle(seed=seed)
    ds = split_dataset_by_node(ds, rank=rank, world_size=world).with_format("torch")
    return _Downloaded(_loader(ds, batch, workers), tmp)


def webdataset_http(url: str, *, endpoint: str, rank: int, world: int, batch: int, workers: int, seed: int = 0,
                    **_: Any) -> Iterable[dict[str, Any]]:
    """WebDataset over the shards' http URLs (its gopen runs curl: one streaming GET per shard)."""
    bucket, prefix = split_url(url)
    keys = sorted(k for k in list_keys(endpoint, bucket, prefix) if k.endswith(".tar"))
    urls = [f"{endpoint.rstrip('/')}/{bucket}/{k}" for k in keys]
    return webdataset(urls, rank=rank, world=world, batch=batch, workers=workers, latency=Latency(), seed=seed)
