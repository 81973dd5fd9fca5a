"""torchdata.nodes: DistributedSampler -> ParallelMapper(in_order=False) -> Batcher -> Loader (own venv).

    python run_torchdata.py read '<Job as JSON>'

No shards of its own: torchdata reads plain files, the benchmark's own (the closest prior art
to croupier's out-of-order batches is in how it maps, not how it stores). Images: one file per
image in the ImageFolder tree, on the latency FS, or one GET per object from the S3 server
(boto3). Text: the save_to_disk folder's Arrow stream files, memory-mapped (pyarrow), a row
sliced per sample, as HF `datasets` maps them; text on S3 is not set up (rows need ranged
reads with an index, which torchdata has no writer for). The order is DistributedSampler's
global permutation (set_epoch per epoch via SamplerWrapper); `ParallelMapper` reads with
`threads` threads and yields samples as they complete (in_order=False). Resume:
Loader.state_dict() per rank.
"""

from __future__ import annotations

import os
import sys

from _common import Job, command_line, guarded, decode_jpeg, emit, load_state, now, run_loader_epochs

#: Reads in flight per rank (threads): the I/O parallelism a torchdata user gives a slow store.
THREADS = 16


class Rows:
    """id -> sample over the benchmark's files; made lazily per process."""

    def __init__(self, job: Job):
        self.job = job
        self.image = job.dataset == "image"
        if self.image:
            if job.endpoint:
                bucket, _, prefix = job.remote.removeprefix("s3://").partition("/")
                self.s3 = _client(job.endpoint)
                pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
                keys = [o["Key"] for p in pages for o in p.get("Contents", []) if o["Key"].endswith(".jpg")]
                self.bucket = bucket
            else:
                keys = [os.path.join(d, f) for d, _, fs in os.walk(job.remote) for f in fs if f.endswith(".jpg")]
            # ids are the file names; the label is the class folder
            self.files = {int(os.path.basename(k)[:-4]): k for k in keys}
            self.ids = sorted(self.files)
        else:
            import pyarrow as pa

            tables = []
            for name in sorted(f for f in os.listdir(job.remote) if f.endswith(".arrow")):
                tables.append(pa.ipc.open_stream(pa.memory_map(os.path.join(job.remote, name))).read_all())
            self.table = pa.concat_tables(tables)
            self.ids = list(range(self.table.num_rows))

    def __len__(self) -> int:
        return len(self.ids)

    def get(self, i: int) -> dict:
        import torch

        if self.image:
            key = self.files[self.ids[i]]
            label = int(os.path.basename(os.path.dirname(key))[len("class"):])
            if self.job.endpoint:
                data = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            else:
                with open(key, "rb") as f:
                    data = f.read()
            return {"id": self.ids[i], "label": label, "image": decode_jpeg(data)}
        row = self.table.slice(i, 1).to_pylist()[0]
        return {"id": row["id"], "label": row["label"], "text": row["text"],
                "tokens": torch.tensor(row["tokens"], dtype=torch.int32)}


def _client(endpoint: str):
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client("s3", endpoint_url=endpoint, aws_access_key_id="bench",
                                          aws_secret_access_key="bench", region_name="us-east-1",
                                          config=Config(max_pool_connections=THREADS * 2))


def read(job: Job) -> None:
    if job.endpoint and job.dataset == "text":
        raise SystemExit("torchdata: text on S3 is not set up (see the module's doc)")
    from torch.utils.data import DistributedSampler, default_collate
    from torchdata.nodes import Batcher, Loader, Mapper, ParallelMapper, SamplerWrapper

    emit("start", t=now())
    rows = Rows(job)
    sampler = DistributedSampler(range(len(rows)), num_replicas=job.world, rank=job.rank, shuffle=True, seed=job.seed)
    node = SamplerWrapper(sampler)  # calls sampler.set_epoch() at each new pass
    node = ParallelMapper(node, map_fn=rows.get, num_workers=THREADS, in_order=False, method="thread")
    node = Batcher(node, batch_size=job.batch, drop_last=False)
    node = Mapper(node, default_collate)
    loader = Loader(node)
    if job.resume:
        loader.load_state_dict(load_state(job))

    run_loader_epochs(job, loader)


if __name__ == "__main__":
    sys.exit(guarded(lambda: command_line("torchdata", read)))
