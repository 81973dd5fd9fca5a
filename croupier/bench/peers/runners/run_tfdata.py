"""tf.data service: TFRecord shards, a dispatcher and workers, trainer ranks as consumers (own venv).

    python run_tfdata.py write '{"dataset": "text", "source": ..., "out": ..., "shards": ...}'
    unshare --net python run_tfdata.py group '[<Job as JSON>, ...]'

The tf.data servers bind every interface ("[::]:port", no option to bind one), so the harness
runs them in a network namespace of their own that has only loopback (`unshare --net`): `group`
brings `lo` up, starts one dispatcher and `workers` workers in this process, then one process
per trainer rank (same namespace), and relays their JSON lines with a "rank" field.

The pipeline is what the tf.data guide sets up for files: the file names shuffled
(`from_tensor_slices(files).shuffle(len(files))`, reshuffled each epoch), `interleave`d
TFRecordDatasets, the user's own `shuffle(buffer)` (tf.data has no global shuffle: 1,000 by
default here, the whole dataset for the strongest), parse (and JPEG decode) on the service's
workers, `batch`, then `distribute(ShardingPolicy.DYNAMIC)`: the dispatcher hands files to
workers as they ask, so an epoch visits every file once; both ranks consume one shared job
(`job_name` per epoch), each element going to one of them. tf.data service iterators cannot
be checkpointed, so there is no resume case. S3: TensorFlow 2.21 has no s3:// file system
(it moved to tensorflow-io), so only the latency FS is run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from _common import Job, emit, guarded, now, run_epochs, source_rows

BUFFER = 1000
#: tf.data service workers started beside the dispatcher.
SERVICE_WORKERS = 2


def write(args: dict) -> dict:
    import tensorflow as tf

    os.makedirs(args["out"], exist_ok=True)
    per = int(args["shard_rows"])
    writer, n, shard = None, 0, 0

    def feature(row: dict) -> tf.train.Example:
        f = {"id": tf.train.Feature(int64_list=tf.train.Int64List(value=[row["id"]])),
             "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[row["label"]]))}
        if args["dataset"] == "text":
            f["text"] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[row["text"].encode()]))
            f["tokens"] = tf.train.Feature(int64_list=tf.train.Int64List(value=row["tokens"]))
        else:
            f["jpg"] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[row["jpg"]]))
        return tf.train.Example(features=tf.train.Features(feature=f))

    for row in source_rows(args["dataset"], args["source"]):
        if n % per == 0:
            if writer is not None:
                writer.close()
            writer = tf.io.TFRecordWriter(os.path.join(args["out"], f"part-{shard:05d}.tfrecord"))
            shard += 1
        writer.write(feature(row).SerializeToString())
        n += 1
    if writer is not None:
        writer.close()
    return {"rows": n, "shards": shard}


def pipeline(job: Job, tf, epoch: int):
    files = sorted(os.path.join(job.remote, f) for f in os.listdir(job.remote) if f.endswith(".tfrecord"))
    rows = int(job.extra.get("rows", BUFFER))
    text = job.dataset == "text"
    spec = {"id": tf.io.FixedLenFeature([], tf.int64), "label": tf.io.FixedLenFeature([], tf.int64)}
    if text:
        spec.update({"text": tf.io.FixedLenFeature([], tf.string), "tokens": tf.io.VarLenFeature(tf.int64)})
    else:
        spec["jpg"] = tf.io.FixedLenFeature([], tf.string)

    def parse(record):
        x = tf.io.parse_single_example(record, spec)
        if text:
            return {"id": x["id"], "label": x["label"], "text": x["text"],
                    "tokens": tf.cast(tf.sparse.to_dense(x["tokens"]), tf.int32)}
        return {"id": x["id"], "label": x["label"], "image": tf.io.decode_jpeg(x["jpg"], channels=3)}

    seed = job.seed * 1000 + epoch
    ds = tf.data.Dataset.from_tensor_slices(files).shuffle(len(files), seed=seed)
    ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=4, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.shuffle(rows if job.shuffle == "strongest" else BUFFER, seed=seed)
    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE).batch(job.batch)
    return ds.apply(tf.data.experimental.service.distribute(
        processing_mode=tf.data.experimental.service.ShardingPolicy.DYNAMIC, service=job.extra["dispatcher"],
        job_name=f"{job.extra['run']}-epoch-{epoch}"))


def read(job: Job) -> None:
    import tensorflow as tf

    emit("start", t=now())

    def epoch(e: int):
        for batch in pipeline(job, tf, e).as_numpy_iterator():
            yield batch["id"].tolist()

    run_epochs(job, epoch)


def group(jobs: list[dict]) -> int:
    """The service and every rank, inside this network namespace (see the module's doc)."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    import tensorflow as tf

    svc = tf.data.experimental.service
    dispatcher = svc.DispatchServer(svc.DispatcherConfig(port=0))
    address = dispatcher.target.split("://")[1]
    workers = [svc.WorkerServer(svc.WorkerConfig(dispatcher_address=address, worker_address="localhost:%port%"))
               for _ in range(SERVICE_WORKERS)]
    emit("service", rank=-1, dispatcher=dispatcher.target, workers=len(workers), pid=os.getpid())
    procs = []
    lock = threading.Lock()

    def relay(rank: int, p: subprocess.Popen) -> None:
        for line in p.stdout:
            line = line.strip()
            if line.startswith("{"):
                with lock:
                    sys.stdout.write(json.dumps({**json.loads(line), "rank": rank}) + "\n")
                    sys.stdout.flush()

    threads = []
    for j in jobs:
        j = {**j, "extra": {**j.get("extra", {}), "dispatcher": dispatcher.target}}
        p = subprocess.Popen([sys.executable, __file__, "read", json.dumps(j)], stdout=subprocess.PIPE, text=True)
        procs.append(p)
        t = threading.Thread(target=relay, args=(j["rank"], p), daemon=True)
        t.start()
        threads.append(t)
    codes = [p.wait() for p in procs]
    for t in threads:
        t.join(10)
    del workers, dispatcher
    return max((abs(c) for c in codes), default=0)


def main() -> int:
    cmd, arg = sys.argv[1], sys.argv[2]
    if cmd == "write":
        print(json.dumps(write(json.loads(arg))), flush=True)
        return 0
    if cmd == "group":
        return group(json.loads(arg))
    read(Job.parse(arg))
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
