"""LitData: optimize() chunks, StreamingDataset + StreamingDataLoader (in its own venv).

    python run_litdata.py write '{"dataset": "text", "source": ..., "out": ..., "shard_rows": ...}'
    python run_litdata.py read '<Job as JSON>'

Set up as its documentation has it for remote data: `input_dir` the chunks on the slow storage
(`local:/mount/...`, LitData's scheme for a folder to be treated as remote and copied chunk by
chunk into the cache; s3:// with `storage_options={"endpoint_url": ...}` for the S3 server),
`cache_dir` the local cache, `shuffle=True` (FullShuffle: chunks permuted, items shuffled in
windows of 256 inside each chunk) or, strongest, the same with `item_shuffle_window="full"`
(a full permutation inside each chunk: LitData has no shuffle across chunks); `max_cache_size`
for the 10% condition. Ranks from WORLD_SIZE / GLOBAL_RANK / NNODES (no process group needed).
Resume: each rank's StreamingDataLoader.state_dict(), loaded by the same rank.
On the loopback S3 server (plain HTTP) obstore's client is allowed http (see read()).
The PyPI version check at import is turned off (LITDATA_DISABLE_VERSION_CHECK=1): it is a
network call to pypi.org, not part of reading data.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")

from _common import (Job, command_line, decode_jpeg, emit, guarded, load_state, now,  # noqa: E402
                     run_loader_epochs, source_rows)

def _row(row: dict) -> dict:
    return row  # the rows are the inputs: optimize()'s workers are spawned, they share no globals


def write(args: dict) -> dict:
    import numpy as np
    from litdata import optimize

    rows = []
    for row in source_rows(args["dataset"], args["source"]):
        if args["dataset"] == "text":
            row["tokens"] = np.asarray(row["tokens"], dtype=np.int32)
        rows.append(row)
    # One worker keeps the rows in id order, chunk after chunk (the storage order every system has).
    optimize(fn=_row, inputs=rows, output_dir=args["out"], chunk_size=int(args["shard_rows"]),
             num_workers=1, mode="overwrite")
    chunks = [f for f in os.listdir(args["out"]) if f.endswith(".bin")]
    return {"rows": len(rows), "shards": len(chunks)}


def read(job: Job) -> None:
    os.environ.update({"WORLD_SIZE": str(job.world), "GLOBAL_RANK": str(job.rank), "NNODES": "1"})
    import torch
    from litdata import StreamingDataLoader, StreamingDataset

    image = job.dataset == "image"

    def transform(row: dict) -> dict:
        if image:
            return {"id": row["id"], "label": row["label"], "image": decode_jpeg(row["jpg"])}
        return {"id": row["id"], "label": row["label"], "text": row["text"],
                "tokens": torch.as_tensor(row["tokens"])}

    emit("start", t=now())
    kw: dict = {}
    if job.endpoint.startswith("http://"):
        # The loopback server speaks plain HTTP (real S3 is HTTPS). LitData's boto3 path accepts
        # it; its obstore chunk downloads use fixed client options without allow_http and fail
        # with "BadScheme". Allowing http there is the only change made to LitData.
        from litdata.streaming import downloader

        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"
    if job.endpoint:
        kw["storage_options"] = {"endpoint_url": job.endpoint, "aws_access_key_id": "bench",
                                 "aws_secret_access_key": "bench", "region_name": "us-east-1"}
        remote = job.remote
    else:
        remote = "local:" + job.remote
    if job.shuffle == "strongest":
        kw["item_shuffle_window"] = "full"
    if job.cache_limit:
        kw["max_cache_size"] = job.cache_limit
    ds = StreamingDataset(input_dir=remote, cache_dir=job.local, shuffle=True, seed=job.seed + 42,
                          transform=transform, **kw)
    loader = StreamingDataLoader(ds, batch_size=job.batch, num_workers=job.workers)
    if job.resume:
        loader.load_state_dict(load_state(job))

    run_loader_epochs(job, loader)


if __name__ == "__main__":
    sys.exit(guarded(lambda: command_line("litdata", read, write)))
