"""MosaicML Streaming: MDSWriter shards, StreamingDataset + StreamingDataLoader (in its own venv).

    python run_mosaic.py write '{"dataset": "text", "source": ..., "out": ..., "shard_bytes": ...}'
    python run_mosaic.py read '<Job as JSON>'

Set up as its documentation recommends for remote data: `remote` = the shards on the slow
storage (a folder on the latency FS, or s3:// with S3_ENDPOINT_URL pointing at the loopback
server), `local` = a cache folder, `shuffle=True` with the default algorithm (py1e) or
`naive` (a global permutation of samples: its strongest), `batch_size` given to the dataset
as the docs require for deterministic resumption; ranks from RANK / WORLD_SIZE / LOCAL_RANK /
LOCAL_WORLD_SIZE (it opens a gloo group on loopback at construction, then closes it).
Resume: StreamingDataLoader.state_dict() on rank 0, load_state_dict() on every rank.
`import streaming` needs torchvision, whose PyPI build cannot load beside the CPU torch: see
_common.torchvision_or_placeholder.
"""

from __future__ import annotations

import os
import sys

from _common import (Job, command_line, emit, guarded, load_state, now, run_loader_epochs, source_rows,
                     torchvision_or_placeholder)

COLUMNS = {
    "text": {"id": "int64", "label": "int64", "text": "str", "tokens": "ndarray:int32"},
    "image": {"id": "int64", "label": "int64", "jpg": "bytes"},
}


def write(args: dict) -> dict:
    import numpy as np

    torchvision_or_placeholder()
    from streaming import MDSWriter

    n = 0
    with MDSWriter(out=args["out"], columns=COLUMNS[args["dataset"]], size_limit=int(args["shard_bytes"])) as w:
        for row in source_rows(args["dataset"], args["source"]):
            if args["dataset"] == "text":
                row["tokens"] = np.asarray(row["tokens"], dtype=np.int32)
            w.write(row)
            n += 1
    shards = [f for f in os.listdir(args["out"]) if f.endswith(".mds")]
    return {"rows": n, "shards": len(shards)}


def read(job: Job) -> None:
    os.environ.update({"RANK": str(job.rank), "WORLD_SIZE": str(job.world), "LOCAL_RANK": str(job.rank),
                       "LOCAL_WORLD_SIZE": str(job.world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(job.master_port)})
    if job.endpoint:
        os.environ["S3_ENDPOINT_URL"] = job.endpoint
    from mosaic_rows import NOTE, Rows
    from streaming import StreamingDataLoader

    if NOTE:
        emit("note", text=NOTE)
    emit("start", t=now())
    kw = {}
    if job.shuffle == "strongest":
        kw["shuffle_algo"] = "naive"
    if job.cache_limit:
        kw["cache_limit"] = job.cache_limit
    ds = Rows(image=job.dataset == "image", remote=job.remote, local=job.local, shuffle=True, shuffle_seed=job.seed + 9176,
              batch_size=job.batch, **kw)
    if job.endpoint and job.workers:
        # Forked workers inherit the parent's boto3 client (made to fetch index.json) and its
        # keep-alive socket: processes then share one connection, and responses interleave
        # (stalls of download_timeout, shards with another response's bytes: seen here). Workers
        # from a fork server unpickle the dataset, which drops the client (Mosaic's
        # __getstate__), so each has its own; the server imports streaming once, not per worker.
        import multiprocessing

        multiprocessing.set_forkserver_preload(["mosaic_rows"])
        kw_loader = {"multiprocessing_context": "forkserver"}
    else:
        kw_loader = {}
    loader = StreamingDataLoader(ds, batch_size=job.batch, num_workers=job.workers,
                                 persistent_workers=False, drop_last=False, **kw_loader)
    if job.resume:
        loader.load_state_dict(load_state(job, rank=0))  # the docs: rank 0's state, loaded by every rank

    run_loader_epochs(job, loader)


if __name__ == "__main__":
    sys.exit(guarded(lambda: command_line("mosaic", read, write)))
