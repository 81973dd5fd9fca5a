"""Lance (pylance): its writer, a global shuffle by `take`, and lance.torch.data's loader (in its own venv).

    python run_lance.py write '{"dataset": "text", "source": ..., "out": ..., "shard_rows": ...}'
    python run_lance.py read '<Job as JSON>'

Written with `lance.write_dataset` (one fragment file per `shard_rows` rows, in id order: row i is id i).
Read two ways, as its documentation has them:

* default, `take` of a global permutation: Lance's native random access, the one peer that does a
  global shuffle from remote storage. Each epoch draws its own permutation of all rows (numpy,
  seeded by (seed, epoch): not croupier's plan), rank r takes every world-th index of it
  (DistributedSampler's split), cut into batches; each batch is one `dataset.take(indices)`,
  with TAKES_IN_FLIGHT takes in flight per rank on a thread pool (the set-up issue 21 measured:
  2 rank processes, 32 takes in flight each), batches handed out in order. JPEGs are decoded on
  the same threads.
* loader: `lance.torch.data.LanceDataset` with `ShardedBatchSampler(rank, world, randomize=True)`,
  its shuffled sampler for distributed training: the dataset cut into ranges of `batch` rows,
  rank r reads every world-th range, the ranges' order shuffled (rows stay contiguous inside a
  batch; its seed ignores the epoch, so every epoch has the same order). Iterated in the rank:
  Lance reads on its own Rust threads (`batch_readahead`, default 16), and its docs warn that it
  is not fork-safe, so no DataLoader worker processes.

On S3, `lance.dataset("s3://...", storage_options=...)` (its object_store client: endpoint, keys,
`allow_http` for the loopback server's plain HTTP). No checkpoint of its own: no resume case.
"""

from __future__ import annotations

import sys
from collections import deque
from itertools import islice

from _common import Job, command_line, decode_jpeg, emit, guarded, now, run_epochs, source_rows

#: `take` calls in flight per rank (issue 21's measurement of Lance: 32).
TAKES_IN_FLIGHT = 32


def write(args: dict) -> dict:
    import lance
    import pyarrow as pa

    rows = list(source_rows(args["dataset"], args["source"]))
    if args["dataset"] == "text":
        table = pa.table({"id": pa.array([r["id"] for r in rows], pa.int64()),
                          "label": pa.array([r["label"] for r in rows], pa.int64()),
                          "text": pa.array([r["text"] for r in rows], pa.string()),
                          "tokens": pa.array([r["tokens"] for r in rows], pa.list_(pa.int32()))})
    else:
        table = pa.table({"id": pa.array([r["id"] for r in rows], pa.int64()),
                          "label": pa.array([r["label"] for r in rows], pa.int64()),
                          "jpg": pa.array([r["jpg"] for r in rows], pa.binary())})
    ds = lance.write_dataset(table, args["out"], mode="overwrite", max_rows_per_file=int(args["shard_rows"]))
    return {"rows": ds.count_rows(), "shards": len(ds.get_fragments())}


def open_dataset(job: Job):
    import lance

    if not job.endpoint:
        return lance.dataset(job.remote)
    return lance.dataset(job.remote, storage_options={
        "endpoint": job.endpoint, "aws_access_key_id": "bench", "aws_secret_access_key": "bench",
        "region": "us-east-1", "allow_http": "true"})


def samples(batch, image: bool) -> dict:
    """A pyarrow Table/RecordBatch of rows -> the batch the trainer gets (as croupier's client decodes)."""
    import torch

    cols = batch.to_pydict()
    out = {"id": torch.tensor(cols["id"]), "label": torch.tensor(cols["label"])}
    if image:
        out["image"] = [decode_jpeg(b) for b in cols["jpg"]]
    else:
        out["text"] = cols["text"]
        out["tokens"] = torch.tensor(cols["tokens"], dtype=torch.int32)
    return out


def take_epochs(job: Job, ds):
    """The default: takes of this rank's part of each epoch's global permutation, TAKES_IN_FLIGHT at once."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    n = ds.count_rows()
    image = job.dataset == "image"
    pool = ThreadPoolExecutor(TAKES_IN_FLIGHT, thread_name_prefix="lance-take")

    def fetch(indices):
        return samples(ds.take(indices), image)

    def epoch(e: int):
        mine = np.random.default_rng([job.seed, e]).permutation(n)[job.rank::job.world]
        todo = (mine[i:i + job.batch].tolist() for i in range(0, len(mine), job.batch))
        pending = deque(pool.submit(fetch, b) for b in islice(todo, TAKES_IN_FLIGHT))
        while pending:
            batch = pending.popleft().result()
            nxt = next(todo, None)
            if nxt is not None:
                pending.append(pool.submit(fetch, nxt))
            yield batch["id"].tolist()

    return epoch


def loader_epochs(job: Job, ds):
    """lance.torch.data.LanceDataset over ShardedBatchSampler(randomize=True)."""
    from lance.sampler import ShardedBatchSampler
    from lance.torch.data import LanceDataset

    image = job.dataset == "image"
    sampler = ShardedBatchSampler(job.rank, job.world, randomize=True, seed=job.seed)
    data = LanceDataset(ds, batch_size=job.batch, sampler=sampler,
                        to_tensor_fn=lambda batch, **_: samples(batch, image))

    def epoch(e: int):
        sampler.set_epoch(e)
        for batch in data:
            yield batch["id"].tolist()

    return epoch


def read(job: Job) -> None:
    if job.resume or job.kill_after:
        raise SystemExit("lance: no loader state to checkpoint (the suite runs no resume case for it)")
    emit("start", t=now())
    ds = open_dataset(job)
    if job.shuffle == "loader":
        emit("note", text="loader: lance.torch.data.LanceDataset + ShardedBatchSampler(randomize=True), "
                          "iterated in the rank (Lance reads on its own threads; not fork-safe)")
        run_epochs(job, loader_epochs(job, ds))
    else:
        emit("note", text=f"take: {TAKES_IN_FLIGHT} dataset.take() calls of one batch each in flight per rank")
        run_epochs(job, take_epochs(job, ds))


if __name__ == "__main__":
    sys.exit(guarded(lambda: command_line("lance", read, write)))
