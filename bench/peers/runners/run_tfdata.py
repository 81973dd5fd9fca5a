"""tf.data service: TFRecord shards, a dispatcher and workers, trainer ranks as consumers (own venv).

    python run_tfdata.py write '{"dataset": "text", "source": ..., "out": ..., "shards": ...}'
    unshare --net python run_tfdata.py group '[<Job as JSON>, ...]'

The tf.data servers bind every interface ("[::]:port", no option to bind one), so the harness
runs them in a network namespace of their own that has only loopback (`unshare --net`): `group`
brings `lo` up, starts one dispatcher and `workers` workers in this process, then one process
per trainer rank (same namespace), and relays their JSON lines with a "rank" field.

The pipeline is what the tf.data guide sets up for files: the files listed once per run
(`tf.io.gfile.glob`, in each rank), their names shuffled
(`from_tensor_slices(files).shuffle(len(files))`, reshuffled each epoch), `interleave`d
TFRecordDatasets, the user's own `shuffle(buffer)` (tf.data has no global shuffle: 1,000 by
default here, the whole dataset for the strongest), parse (and JPEG decode) on the service's
workers, `batch`, then `distribute(ShardingPolicy.DYNAMIC)`: the dispatcher hands files to
workers as they ask, so an epoch visits every file once; both ranks consume one shared job
(`job_name` per epoch), each element going to one of them. tf.data service iterators cannot
be checkpointed, so there is no resume case.

S3, as a TensorFlow user reads it: TensorFlow's own s3:// file system is gone (since 2.6) and
lives in tensorflow-io, whose newest release, 0.37.1, is built for TensorFlow 2.16 (its README's
compatibility table), so S3 runs in its own venv (venvs.py: `tfdata-s3`, tensorflow-cpu 2.16.2
+ tensorflow-io 0.37.1), on the TFRecord files the `tfdata` venv wrote, as
`s3://bench/peers/tfdata-<dataset>/*.tfrecord` (`tf.io.gfile.glob`). `import tensorflow_io`
registers the file system, and it is configured from the environment, as tensorflow-io reads it:
S3_ENDPOINT=http://127.0.0.1:<port> (the URL's scheme selects plain HTTP: 0.37.1 reads no
S3_USE_HTTPS), AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_REGION; everything else its
defaults (path-style requests, and its multi-part download: a HEAD and a ranged GET per read
of a TFRecord file's buffer). Both the service's workers (this process: they open the files)
and the ranks (they list them) import it. The namespace cannot see the host's loopback, where
the S3 server listens: `group` listens on the server's own port on the namespace's loopback and
relays each connection to a Unix socket the harness relays on to the server (_relay.py; the
latency of every request is still the server's). tensorflow-io's S3 client aborts the process
at interpreter exit ("pure virtual method called": the AWS SDK is shut down before the client),
so after S3 a runner leaves with os._exit once its lines are flushed.
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
#: Set once this process used tensorflow-io's S3 file system (see the module's doc: how it exits).
_S3 = False


def s3_setup(job: Job, tf) -> str:
    """For an s3:// job: tensorflow-io's S3 file system, configured from the environment; returns a note
    for the results ("" on files). Call before the first s3:// path (the client reads the variables once)."""
    global _S3
    if not job.remote.startswith("s3://"):
        return ""
    os.environ["S3_ENDPOINT"] = job.endpoint  # http://127.0.0.1:<port>: the scheme makes it plain HTTP
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_REGION", "us-east-1")
    import tensorflow_io as tfio  # registers s3:// with TensorFlow

    _S3 = True
    return (f"S3 through tensorflow-io {tfio.__version__}'s s3:// file system (TensorFlow {tf.__version__}), "
            "S3_ENDPOINT + AWS_* variables, its default multi-part download; the service in its loopback-only "
            "network namespace reaches the S3 server through a TCP -> Unix socket -> TCP relay")


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


def list_files(job: Job, tf) -> list[str]:
    """The TFRecord files, listed once per run (a folder or s3://bucket/prefix). On S3 a glob costs a
    listing plus two Stats per match (tensorflow-io's: a HEAD and a listing each), one after another,
    so it is not redone every epoch."""
    files = sorted(tf.io.gfile.glob(job.remote.rstrip("/") + "/*.tfrecord"))
    if not files:
        raise RuntimeError(f"no .tfrecord files under {job.remote}")
    return files


def pipeline(job: Job, tf, epoch: int, files: list[str]):
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

    note = s3_setup(job, tf)
    if note:
        emit("note", text=note)
    emit("start", t=now())
    files = list_files(job, tf)

    def epoch(e: int):
        for batch in pipeline(job, tf, e, files).as_numpy_iterator():
            yield batch["id"].tolist()

    run_epochs(job, epoch)


def group(jobs: list[dict]) -> int:
    """The service and every rank, inside this network namespace (see the module's doc)."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    import tensorflow as tf

    s3_relay = None
    if jobs and jobs[0].get("endpoint"):  # S3: the server's port on this namespace's loopback, relayed out
        import urllib.parse

        from _relay import tcp_to_unix

        url = urllib.parse.urlsplit(jobs[0]["endpoint"])
        s3_relay = tcp_to_unix(url.hostname, url.port, jobs[0]["extra"]["s3_relay"])
        s3_setup(Job(**jobs[0]), tf)  # the workers open the files here; the ranks inherit the variables
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
    if s3_relay is not None:
        s3_relay.close()
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
    rc = guarded(main)
    if _S3:  # skip the interpreter's exit, which tensorflow-io's S3 client turns into an abort
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)
