"""The benchmark's own files as id -> sample, for the peers that read them as a DataLoader does
(torchdata.nodes, dataloader-rs): no shards of their own.

Images: one file per image in the ImageFolder tree, on the latency FS, or one GET per object from
the S3 server (boto3). Text: the save_to_disk folder's Arrow stream files, memory-mapped (pyarrow),
a row sliced per sample, as HF `datasets` maps them; text on S3 is not set up (rows need ranged
reads with an index, which neither has a writer for).
"""

from __future__ import annotations

import os

from _common import Job, decode_jpeg


class Rows:
    """id -> sample over the benchmark's files; made lazily per process. `numpy`: images and
    tokens as NumPy arrays (a venv without torch), else torch tensors."""

    def __init__(self, job: Job, connections: int = 32, numpy: bool = False):
        self.job = job
        self.numpy = numpy
        self.image = job.dataset == "image"
        if self.image:
            if job.endpoint:
                bucket, _, prefix = job.remote.removeprefix("s3://").partition("/")
                self.s3 = _client(job.endpoint, connections)
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
        if self.image:
            key = self.files[self.ids[i]]
            label = int(os.path.basename(os.path.dirname(key))[len("class"):])
            if self.job.endpoint:
                data = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            else:
                with open(key, "rb") as f:
                    data = f.read()
            return {"id": self.ids[i], "label": label, "image": decode_jpeg(data, numpy=self.numpy)}
        row = self.table.slice(i, 1).to_pylist()[0]
        if self.numpy:
            import numpy as np

            tokens = np.asarray(row["tokens"], dtype=np.int32)
        else:
            import torch

            tokens = torch.tensor(row["tokens"], dtype=torch.int32)
        return {"id": row["id"], "label": row["label"], "text": row["text"], "tokens": tokens}


def _client(endpoint: str, connections: int):
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client("s3", endpoint_url=endpoint, aws_access_key_id="bench",
                                          aws_secret_access_key="bench", region_name="us-east-1",
                                          config=Config(max_pool_connections=connections))
