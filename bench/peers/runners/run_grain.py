"""Grain with ArrayRecord: ArrayRecordDataSource + IndexSampler + DataLoader (in its own venv; no torch).

    python run_grain.py write '{"dataset": "text", "source": ..., "out": ..., "shard_rows": ...}'
    python run_grain.py read '<Job as JSON>'

The JAX world's global shuffle by random access, set up as Grain's documentation has it. Written
with ArrayRecord's own writer, one file per `shard_rows` rows in id order, `group_size:1` (the
option its docs give for random access: every record its own chunk); a record is a pickled dict
(id, label, text and int32 tokens, or the JPEG's bytes). Read with
`grain.ArrayRecordDataSource(files)`, `grain.IndexSampler(shuffle=True, seed,
shard_options=ShardOptions(rank, world), num_epochs=1)` and `grain.DataLoader` with
`worker_count` = the suite's workers per rank (its processes run the parsing and decoding, as
the docs recommend for CPU-bound transforms), `read_options` its defaults (16 threads, a
prefetch buffer of 500 per process), operations: a MapTransform that unpickles (and decodes a
JPEG to a uint8 CHW array, as croupier's client does), then `grain.Batch(batch)`.

Grain shards before it shuffles: rank r gets the contiguous r-th 1/world of the records, and
IndexSampler shuffles within it. Each epoch is its own DataLoader, seeded seed + epoch: with
`num_epochs=E` on one loader, each worker process batches its own records (record i goes to
worker i % workers) and its batches run on past the epoch's end while another worker's are still
in it, so an epoch's rows could not be told apart for the exactly-once check. Resume: the epoch's
DataLoader iterator's get_state() (Grain's exact-checkpoint claim), set_state() on the same rank. Files only: ArrayRecord's reader opens paths (no S3 client), so a Grain user with data in a
bucket mounts it.
"""

from __future__ import annotations

import os
import pickle
import sys

import grain.python as grain
from _common import Job, command_line, emit, guarded, load_state, now, run_epochs, source_rows


def write(args: dict) -> dict:
    import numpy as np
    from array_record.python.array_record_module import ArrayRecordWriter

    os.makedirs(args["out"], exist_ok=True)
    per = int(args["shard_rows"])
    n, files, writer = 0, 0, None
    for row in source_rows(args["dataset"], args["source"]):
        if n % per == 0:
            if writer is not None:
                writer.close()
            writer = ArrayRecordWriter(os.path.join(args["out"], f"shard-{files:05d}.array_record"), "group_size:1")
            files += 1
        if args["dataset"] == "text":
            row["tokens"] = np.asarray(row["tokens"], dtype=np.int32)
        writer.write(pickle.dumps(row, protocol=5))
        n += 1
    if writer is not None:
        writer.close()
    return {"rows": n, "shards": files}


class Parse(grain.MapTransform):
    """A record's bytes -> the sample the trainer gets (runs in the DataLoader's worker processes)."""

    def __init__(self, image: bool):
        self.image = image

    def map(self, data: bytes) -> dict:
        row = pickle.loads(data)
        if not self.image:
            return {"id": row["id"], "label": row["label"], "text": row["text"], "tokens": row["tokens"]}
        import io

        import numpy as np
        from PIL import Image

        with Image.open(io.BytesIO(row["jpg"])) as img:
            chw = np.ascontiguousarray(np.asarray(img.convert("RGB")).transpose(2, 0, 1))
        return {"id": row["id"], "label": row["label"], "image": chw}


def read(job: Job) -> None:
    if job.endpoint:
        raise SystemExit("grain: ArrayRecord reads files by path (no S3 client); see the module's doc")
    emit("start", t=now())
    files = sorted(os.path.join(job.remote, f) for f in os.listdir(job.remote) if f.endswith(".array_record"))
    source = grain.ArrayRecordDataSource(files)
    shard = grain.ShardOptions(shard_index=job.rank, shard_count=job.world, drop_remainder=False)
    current = None  # this epoch's DataLoader iterator (the checkpoint is its state)

    def epoch(e: int):
        nonlocal current
        sampler = grain.IndexSampler(num_records=len(source), shard_options=shard, shuffle=True, num_epochs=1,
                                     seed=job.seed + e)
        loader = grain.DataLoader(data_source=source, sampler=sampler, shard_options=shard, worker_count=job.workers,
                                  operations=[Parse(job.dataset == "image"), grain.Batch(job.batch, drop_remainder=False)])
        current = iter(loader)
        if job.resume and e == 0:
            current.set_state(load_state(job)["grain"].encode())
        for batch in current:
            yield batch["id"].tolist()

    run_epochs(job, epoch, lambda: {"grain": current.get_state().decode()})


if __name__ == "__main__":
    sys.exit(guarded(lambda: command_line("grain", read, write)))
