"""`croupier bench --suite peers`: croupier beside Mosaic Streaming, LitData, tf.data service,
torchdata.nodes (issue 12), Lance, dataloader-rs and Grain with ArrayRecord (issue 21), on the same
rows and the same really slow storage.

What runs, per storage condition (the latency FS at 5 ms, the loopback S3 server at 20 ms), per
dataset (text rows, JPEG images), per system, at `world` ranks and batch `batch`:

* default: the system as its documentation sets it up for remote data, `epochs` epochs from a
  fresh local cache: samples/s at the trainer per epoch (epoch 1 cold), time to first batch,
  peak local disk, peak RSS, the delivered order's shuffle quality;
* strongest: the peer's best-quality shuffle (Mosaic `naive`, LitData's full shuffle, tf.data
  a shuffle buffer the size of the dataset); croupier and torchdata have one shuffle, global;
* loader: a peer's own shuffled loader beside its default set-up: Lance's default is `take` of a
  global permutation, its `loader` lance.torch.data's LanceDataset with ShardedBatchSampler;
* cache10: the cache limited to 10% of the dataset's bytes on storage (Mosaic `cache_limit`,
  LitData `max_cache_size`, croupier's server `--cache-memory`): a dataset larger than the cache.
  croupier's default row runs the server's defaults (cache on, 25% of RAM); the server's cache
  counters (/metrics: hit ratio, storage bytes per sample) are recorded with each of its rows;
* resume: the trainer killed (SIGKILL, every rank) after a third of the first epoch, right
  after a checkpoint of the system's own state_dict, then resumed from it: ids lost and
  repeated against the uninterrupted epoch.

Each system runs in its own venv (venvs.py), except where a storage needs another (STORAGE_VENVS):
tf.data on S3 runs in `tfdata-s3`, TensorFlow 2.16.2 with tensorflow-io 0.37.1's s3:// file system
(TensorFlow dropped its own in 2.6; tensorflow-io's newest release is built for 2.16), configured
from S3_ENDPOINT and the AWS_* variables; its service's loopback-only network namespace reaches the
S3 server through a relay (case.S3Relay, runners/_relay.py). NOT_RUN lists what is still not run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .. import latencyfs
from ..datagen import BenchData, DataSpec, ensure_data, text_table
from ..driver import Report, attempt, drive
from .. import bucket_mount as bucket_mounts
from ..real import BUCKET_MOUNTS, Condition, bucket_mount, latency_fs, latency_fs_kernel_defaults, open_storage, s3
from ..reporting import revision
from . import quality, venvs
from .case import RUNNERS, Watcher, first_batch_s, free_port, per_epoch, run_group, run_ranks
from .runners._common import Job

#: Runner script per system (runners/), and the venv it runs in (None: croupier's own).
SCRIPTS = {"croupier": "run_croupier.py", "mosaic": "run_mosaic.py", "litdata": "run_litdata.py",
           "tfdata": "run_tfdata.py", "torchdata": "run_torchdata.py", "lance": "run_lance.py",
           "dataloader-rs": "run_dataloader_rs.py", "grain": "run_grain.py"}
LABELS = {"croupier": "croupier (unordered)", "mosaic": "Mosaic Streaming", "litdata": "LitData",
          "tfdata": "tf.data service", "torchdata": "torchdata.nodes", "lance": "Lance",
          "dataloader-rs": "dataloader-rs", "grain": "Grain + ArrayRecord"}
#: Variants each system has (croupier's cache10: its server's --cache-memory at 10% of the data).
#: croupier's shards: the images as the WebDataset tar shards datagen wrote (its default reads the ImageFolder).
VARIANTS = {"croupier": ("default", "cache10", "shards", "resume"), "mosaic": ("default", "strongest", "cache10", "resume"),
            "litdata": ("default", "strongest", "cache10", "resume"), "tfdata": ("default", "strongest"),
            "torchdata": ("default", "resume"), "lance": ("default", "loader"), "dataloader-rs": ("default",),
            "grain": ("default", "resume")}
SHUFFLE = {
    ("croupier", "default"): "global permutation per epoch (the plan), batches out of order",
    ("mosaic", "default"): "py1e (default): shuffle blocks of 262,144 samples per canonical node",
    ("mosaic", "strongest"): "naive: a global permutation of the samples",
    ("litdata", "default"): "shuffle=True (FullShuffle): chunks permuted, samples shuffled in windows of 256 inside a chunk",
    ("litdata", "strongest"): "shuffle=True, item_shuffle_window='full': a full permutation inside each chunk "
                              "(LitData has no shuffle across chunks)",
    ("tfdata", "default"): "files shuffled + the user's shuffle buffer of 1,000, on the service's workers",
    ("tfdata", "strongest"): "files shuffled + a shuffle buffer the size of the dataset, on each service worker "
                             "(each shuffles only the files the dispatcher hands it)",
    ("torchdata", "default"): "DistributedSampler (global permutation) + ParallelMapper(in_order=False)",
    ("lance", "default"): "take() of a global permutation per epoch (numpy, seeded per epoch), every world-th index "
                          "to a rank, one take per batch, 32 in flight per rank",
    ("lance", "loader"): "lance.torch.data.LanceDataset + ShardedBatchSampler(randomize=True): ranges of a batch's "
                         "rows, every world-th to a rank, their order shuffled (the same order every epoch)",
    ("dataloader-rs", "default"): "DistributedSampler (global permutation), items_in_parallel=16 per batch",
    ("grain", "default"): "IndexSampler(shuffle=True): each rank's contiguous 1/world of the records, shuffled "
                          "within it per epoch",
}


#: The venv a system runs in on a storage, where it is not the system's own (venvs.PEERS): tf.data on S3
#: needs tensorflow-io's s3:// file system, whose newest release is built for TensorFlow 2.16, while the
#: latency FS runs the newest TensorFlow (2.21). Each is what a TensorFlow user reading that storage
#: installs; both read the same TFRecord files (written by the `tfdata` venv).
STORAGE_VENVS = {("tfdata", "s3"): "tfdata-s3"}


def venv_of(system: str, storage: str) -> str:
    """The name of the venv (venvs.PEERS) `system` runs in on `storage` (a Condition's key)."""
    return STORAGE_VENVS.get((system, storage), system)


#: Cases a peer cannot run here, and why (system, storage, dataset or "*").
NOT_RUN = {
    ("torchdata", "s3", "text"): "rows of the Arrow files on S3 need ranged reads with an index; torchdata has "
                                 "no writer or index of its own (images on S3 are run: one GET per file)",
    ("dataloader-rs", "s3", "text"): "as torchdata: no writer or index of its own for rows on S3 (images on S3 "
                                     "are run: one GET per file)",
    ("grain", "s3", "*"): "ArrayRecord's reader opens file paths and has no S3 client: a Grain user with data in "
                          "a bucket mounts it (the FUSE conditions)",
}


@dataclass(frozen=True)
class PeersSuite:
    name: str
    data: DataSpec
    systems: tuple[str, ...] = ("croupier", "mosaic", "litdata", "tfdata", "torchdata", "lance", "dataloader-rs",
                                "grain")
    conditions: tuple[Condition, ...] = (latency_fs(5.0), s3(20.0))
    datasets: tuple[str, ...] = ("text", "image")
    world: int = 2
    batch: int = 64
    epochs: int = 2
    #: DataLoader workers per rank (peers that have them): 2 on this 2-core machine.
    workers: int = 2
    #: Shards (chunks) each peer writes per dataset: the 10% cache then holds 5 of them,
    #: above Mosaic's floor of 4 of its largest.
    shards: int = 50
    cache_fraction: float = 0.10
    #: Kill the trainer after this fraction of the first epoch's batches (resume variant).
    kill_fraction: float = 1 / 3
    #: Per run of a system's ranks.
    timeout_s: float = 600.0
    #: A peer thrashing its 10% cache can take many minutes an epoch: its epoch is cut after this
    #: long, and reported as the rate of the part it ran (its later epochs are then not run).
    cache10_epoch_s: float = 60.0
    #: Every epoch is cut after this long (0: never), reported as the rate of the part it ran: a
    #: peer reading a request a sample through a bucket mount would take many minutes an epoch.
    epoch_cut_s: float = 0.0
    seed: int = 0
    #: "loader": a peer's own shuffled loader beside its default set-up (Lance's lance.torch.data).
    variants: tuple[str, ...] = ("default", "strongest", "cache10", "resume", "loader")

    def rows(self, ds: str) -> int:
        return self.data.text_rows if ds == "text" else self.data.images

    def shard_rows(self, ds: str) -> int:
        return max(1, -(-self.rows(ds) // self.shards))


def full() -> PeersSuite:
    """The issue's run: modest sizes so that every system, condition and variant fits in ~30 min on 2 cores
    (the full matrix took 24 min on 1,280 rows and 256 images, 10 of them a stalled case)."""
    return PeersSuite(name="peers", data=DataSpec(text_rows=24_000, images=6_000, shard_size=1_000))


def quick() -> PeersSuite:
    """A few minutes on tiny data: croupier, Mosaic and LitData, text on the latency FS (the smoke run)."""
    return PeersSuite(name="peers-quick", data=DataSpec(text_rows=3_200, images=640, shard_size=100),
                      systems=("croupier", "mosaic", "litdata"), conditions=(latency_fs(5.0),), datasets=("text",),
                      workers=1, timeout_s=180.0, cache10_epoch_s=15.0)


#: The cache-tier runs (issue 25's targets): on the kernel-default FUSE mount and the raised one (both),
#: one of them, or the loopback S3 server (s3://, 20 ms).
CACHE_CONDITIONS = {"kernel": (latency_fs_kernel_defaults(5.0),), "raised": (latency_fs(5.0),),
                    "both": (latency_fs_kernel_defaults(5.0), latency_fs(5.0)), "s3": (s3(20.0),),
                    "rclone": (bucket_mount("rclone"),), "s3fs": (bucket_mount("s3fs"),),
                    "mounts": (bucket_mount("rclone"), bucket_mount("s3fs"))}


def cache_targets(conditions: str = "both") -> PeersSuite:
    """croupier's server cache against Mosaic and LitData, data that fits and a cache of 10% of it, on
    the FUSE mount with the kernel's defaults (max_background 12, readahead 128 KB) and/or the raised
    one, or S3 (CACHE_CONDITIONS); the suite's sizes. A thrashing 10% cache is cut after 30 s an
    epoch (its rate is the part it ran)."""
    return PeersSuite(name="peers-cache" + ("" if conditions == "both" else f"-{conditions}"),
                      data=full().data, systems=("croupier", "mosaic", "litdata"),
                      conditions=CACHE_CONDITIONS[conditions], variants=("default", "cache10", "shards"),
                      cache10_epoch_s=30.0)


#: Issue 21's item 5 for its three new peers: the storage people really mount.
MOUNT_CONDITIONS = (latency_fs_kernel_defaults(5.0), bucket_mount("rclone"), bucket_mount("s3fs"))


def on_mounts() -> PeersSuite:
    """croupier beside Lance (its take and its torch loader), Grain + ArrayRecord and dataloader-rs on
    the FUSE mount with the kernel's defaults and the S3 bucket through rclone and s3fs with their
    defaults; the suite's sizes; every epoch cut after 30 s (its rate is the part it ran)."""
    return PeersSuite(name="peers-mounts", data=full().data, systems=("croupier", "lance", "grain", "dataloader-rs"),
                      conditions=MOUNT_CONDITIONS, variants=("default", "loader", "shards"), epoch_cut_s=30.0)


def epoch_cut(suite: PeersSuite, variant: str) -> float:
    """Seconds into an epoch at which a case of `variant` is cut (0: never)."""
    return suite.cache10_epoch_s if variant == "cache10" else suite.epoch_cut_s


def resized(suite: PeersSuite, text_rows: int | None = None, images: int | None = None) -> PeersSuite:
    """The same suite on other data sizes (`--text-rows`, `--images`: the full matrix on tiny data, to check it runs)."""
    data = replace(suite.data, text_rows=text_rows or suite.data.text_rows, images=images or suite.data.images)
    if data == suite.data:
        return suite
    return replace(suite, name=f"{suite.name}-{data.text_rows}-rows-{data.images}-images", data=data)


# ---- the peers' shards ----------------------------------------------------------------------

def export_source(data: BenchData, spec: DataSpec) -> Path:
    """The text rows as JSON lines for the writers in the peers' venvs (no pyarrow there);
    images are read from the WebDataset tar shards datagen wrote."""
    out = data.root / "peers" / "source"
    stamp = out / "spec.json"
    if stamp.is_file() and stamp.read_text() == spec.stamp():
        return out
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "text.jsonl.tmp", "w") as f:
        for row in text_table(spec).to_pylist():
            f.write(json.dumps(row) + "\n")
    os.replace(out / "text.jsonl.tmp", out / "text.jsonl")
    stamp.write_text(spec.stamp())
    return out


def row_bytes(data: BenchData, ds: str, rows: int) -> float:
    """Mean bytes of a row's payload (to size Mosaic's shards by bytes)."""
    if ds == "text":
        return os.path.getsize(data.root / "peers" / "source" / "text.jsonl") / rows * 0.75  # JSON's digits vs int32
    return sum(f.stat().st_size for f in data.imagefolder.rglob("*.jpg")) / rows


def write_shards(suite: PeersSuite, system: str, python: Path, data: BenchData, ds: str, log: Path,
                 say: Callable[[str], None]) -> dict[str, Any]:
    """The peer's own writer over the source rows, into data.root/peers/<system>-<ds> (the latency
    FS and the S3 bucket serve that folder); kept while its stamp matches."""
    import subprocess

    out = data.root / "peers" / f"{system}-{ds}"
    args = {"dataset": ds, "source": str(data.root / "peers" / "source" if ds == "text" else data.shards),
            "out": str(out), "shard_rows": suite.shard_rows(ds),
            "shard_bytes": int(row_bytes(data, ds, suite.rows(ds)) * suite.shard_rows(ds) * 1.02) + 1024}
    stamp = data.root / "peers" / f"{system}-{ds}.json"
    want = json.dumps({"args": args, "spec": suite.data.stamp(), "venv": venvs.PEERS[system].stamp()})
    if stamp.is_file() and json.loads(stamp.read_text()).get("want") == want and out.is_dir():
        return json.loads(stamp.read_text())["written"]
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    with open(log, "a") as f:
        r = subprocess.run([str(python), str(RUNNERS / SCRIPTS[system]), "write",
                            json.dumps(args)], cwd=str(RUNNERS), stdout=subprocess.PIPE,
                           stderr=f, text=True, timeout=1800)
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{system}'s writer failed on {ds} ({r.returncode}); see {log}")
    written = {**json.loads(lines[-1]), "seconds": time.perf_counter() - t,
               "bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file())}
    stamp.write_text(json.dumps({"want": want, "written": written}))
    say(f"  {system} wrote {ds}: {written}")
    return written


# ---- one case ------------------------------------------------------------------------------------

@dataclass
class Ctx:
    suite: PeersSuite
    data: BenchData
    work: Path
    log: Path
    say: Callable[[str], None]
    pythons: dict[str, str] = field(default_factory=dict)
    written: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    #: Cases planned in the whole run, and counted so far (the progress lines' [done/total]).
    total: int = 0
    done: int = 0


#: Systems that read the benchmark's own files (the save_to_disk folder, the ImageFolder tree): no writer.
OWN_FILES = ("croupier", "torchdata", "dataloader-rs")


def _own_files(ds: str, variant: str) -> str:
    """The benchmark's own folder a system that needs no writer reads (BenchData.paths())."""
    return "text" if ds == "text" else "shards" if variant == "shards" else "imagefolder"


def _remote(st: Any, system: str, ds: str, variant: str = "default") -> str:
    if system in OWN_FILES:
        return st.croupier_path(_own_files(ds, variant))
    sub = f"peers/{system}-{ds}"
    if st.condition.key == "s3":
        from ..real import BUCKET

        return f"s3://{BUCKET}/{sub}"
    if st.condition.key in BUCKET_MOUNTS:  # the bucket's mount point (the data folder is the bucket)
        return str(Path(st.croupier_path(".")) / sub)
    return str(Path(st.fs.path) / sub)


def _evict(st: Any, system: str, ds: str, variant: str = "default") -> None:
    """Cold storage before every run: the latency FS drops the files' cached pages; a bucket
    mount is mounted afresh (no data kept by the client or the kernel)."""
    if st.condition.key in BUCKET_MOUNTS:
        st.before_case(ds)
    elif st.condition.key != "fuse":
        return
    elif system in OWN_FILES:
        st.before_case(_own_files(ds, variant))
    else:
        st.fs.evict([Path(st.fs.path) / "peers" / f"{system}-{ds}"])


def _unusable(cond: Condition) -> str:
    """Why a condition's storage cannot run here ("" when it can)."""
    if cond.key == "fuse":
        reason = latencyfs.check_available()
        return f"latencyfs is unusable here: {reason}" if reason else ""
    if cond.key in BUCKET_MOUNTS:
        return bucket_mounts.CLIENTS[cond.key][1]() or ""
    return ""


def _shuffle_of(variant: str) -> str:
    """The Job's `shuffle` for a variant: the peer's strongest shuffle, its own loader, or its default."""
    return variant if variant in ("strongest", "loader") else "default"


def image_ids(data: BenchData) -> list[int]:
    """croupier's ImageFolder index -> the image's id (its file name), in croupier's listing order."""
    from ..baselines import list_imagefolder

    files, _ = list_imagefolder(data.imagefolder)
    return [int(Path(f).stem) for f in files]


def shard_ids(data: BenchData) -> list[int]:
    """croupier's WebDataset index over datagen's tar shards -> the image's id (its key), in croupier's
    order (shards sorted, samples in tar order). Loading the index writes it beside the local shards,
    as a deployment ships it: the server then reads it through the mount, not every shard whole."""
    from croupier.server.readers.webdataset import load_index

    return [int(key) for shard in sorted(data.shards.glob("*.tar")) for key, _, _ in load_index(shard)]


def run_system(ctx: Ctx, st: Any, system: str, ds: str, variant: str, n: int, expected: np.ndarray | None) -> dict[str, Any]:
    s = ctx.suite
    run_dir = ctx.work / f"{system}-{ds}-{variant}-{st.condition.key}-{n}"
    local = run_dir / "cache"
    run_dir.mkdir(parents=True)
    total_bytes = ctx.written.get((system, ds), {}).get("bytes", 0)
    epochs = 1 if variant == "resume" else s.epochs
    rows = s.rows(ds)
    batches_per_rank = -(-rows // (s.batch * s.world))
    shm_before = _shm()
    _evict(st, system, ds, variant)  # first: a bucket mount's point is new once mounted afresh
    job = Job(system=system, dataset=ds, remote=_remote(st, system, ds, variant), local=str(local), world=s.world,
              batch=s.batch, epochs=epochs, workers=s.workers, shuffle=_shuffle_of(variant),
              cache_limit=int(total_bytes * s.cache_fraction) if variant == "cache10" else 0,
              state_path=str(run_dir / "state.json"), seed=s.seed, barrier=str(run_dir / "barrier"),
              max_epoch_s=epoch_cut(s, variant),
              endpoint=getattr(getattr(st, "server", None), "endpoint", "") if st.condition.key == "s3" else "",
              master_port=free_port())
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    rec: dict[str, Any] = {"system": system, "label": LABELS[system], "dataset": ds, "variant": variant,
                           "condition": asdict(st.condition), "shuffle": SHUFFLE.get((system, _shuffle_of(variant)), ""),
                           "cache_limit_bytes": job.cache_limit, "dataset_bytes_on_storage": total_bytes,
                           "problems": []}
    server = None
    watch = Watcher([str(local)])
    t_case = time.perf_counter()
    st.reset()
    try:
        if system == "croupier":
            from ..cases import ServerProcess

            name = _own_files(ds, variant)
            ids = (shard_ids(ctx.data) if variant == "shards" else image_ids(ctx.data)) if ds == "image" else []
            t = time.perf_counter()
            server = ServerProcess([f"{name}={job.remote}"], server_args(job), ctx.log)
            rec["server_start_s"] = time.perf_counter() - t
            job = replace(job, extra={"address": server.address, "dataset": name, "ids": ids})
            watch.roots.append(server.pid)
        python = ctx.pythons[venv_of(system, st.condition.key)]
        rec["venv"] = venv_of(system, st.condition.key)
        jobs = [asdict(replace(job, rank=r)) for r in range(s.world)]
        # A thrashing cache is cut per epoch once a batch comes; one that brings none is stopped here.
        cut = epoch_cut(s, variant)
        timeout = min(s.timeout_s, epochs * cut + 180) if cut else s.timeout_s
        with watch:
            if variant == "resume":
                kill_after = max(1, int(batches_per_rank * s.kill_fraction))
                jobs = [{**j, "kill_after": kill_after} for j in jobs]
                before, problems = run_ranks(python, SCRIPTS[system], jobs, env, ctx.log, s.timeout_s, watch,
                                             expect_kill=True)
                rec["problems"] += [f"killed run: {p}" for p in problems]
                states = [e for evs in before for e in evs if e["ev"] == "state"]
                if len(states) != s.world:
                    rec["problems"].append(f"only {len(states)} of {s.world} ranks checkpointed before the kill")
                # Mosaic's docs: clean_stale_shared_memory() after a crash, before restarting
                _shm_cleanup(rec, system, shm_before)
                jobs = [{**j, "kill_after": 0, "resume": True} for j in jobs]
                after, problems = run_ranks(python, SCRIPTS[system], jobs, env, ctx.log, s.timeout_s, watch)
                rec["problems"] += [f"resumed run: {p}" for p in problems]
                ids_before = np.asarray([i for evs in before for e in evs if e["ev"] == "batch" for i in e["ids"]])
                ids_after = np.asarray([i for evs in after for e in evs if e["ev"] == "batch" for i in e["ids"]])
                rec["kill_after_batches_per_rank"] = kill_after
                rec["notes"] = _notes(before + after)
                if expected is not None:
                    rec["resume"] = quality.resume_check(expected, ids_before, ids_after)
                else:
                    rec["problems"].append("no uninterrupted epoch to compare the resume with (its default run failed)")
                rec["resume_first_batch_s"] = first_batch_s(after)
            else:
                if system == "tfdata":  # a dispatcher and workers beside the ranks, in a loopback-only namespace
                    # (on S3 with a relay out of it to the S3 server: case.run_group)
                    jobs = [{**j, "extra": {"run": run_dir.name, "rows": rows}} for j in jobs]
                    ranks, problems = run_group(python, SCRIPTS[system], jobs, env, ctx.log, timeout, watch)
                else:
                    ranks, problems = run_ranks(python, SCRIPTS[system], jobs, env, ctx.log, timeout, watch)
                rec["problems"] += problems
                epochs_ = per_epoch(ranks, epochs)
                rec["first_batch_s"] = first_batch_s(ranks)
                rec["notes"] = _notes(ranks)
                rec["epochs"] = [{k: v for k, v in e.items() if k != "batches"} for e in epochs_]
                orders = [quality.global_order(e["batches"]) for e in epochs_]
                rec["coverage"] = [quality.epoch_coverage(o, rows) for o in orders]
                rec["order_epoch0"] = orders[0].tolist() if len(orders) and len(orders[0]) else []
                if len(orders) and len(orders[0]) > 2 * s.batch and epochs_[0]["complete"]:
                    rec["quality"] = quality.figures(orders[0], s.batch, s.shard_rows(ds),
                                                     orders[1] if len(orders) > 1 else None)
                rec["peak_rss_mb_ranks"] = [next((e.get("peak_rss_mb") for e in evs if e["ev"] == "end"), None)
                                            for evs in ranks]
            watch._sample()
    finally:
        if server is not None:
            rec["server_cache"] = cache_metrics(server)
            server.stop()
        _shm_cleanup(rec, system, shm_before)
        rec["peak_local_disk_mb"] = watch.peak_disk / 1e6
        rec["peak_rss_mb"] = watch.peak_rss
        rec["watch_samples"] = watch.samples
        stats = st.stats()
        if stats:
            rec["storage"] = {k: stats[k] for k in ("requests", "bytes", "max_in_flight") if k in stats}
        rec["wall_s"] = time.perf_counter() - t_case
        shutil.rmtree(run_dir, ignore_errors=True)
    return rec


def server_args(job: Job) -> list[str]:
    """`croupier serve`'s flags for a case: a 10% cache is the server's memory cache at that many
    bytes (the peers' cache_limit / max_cache_size); otherwise the server's defaults (cache on)."""
    return ["--cache-memory", str(job.cache_limit), "--metrics-port", "0"] if job.cache_limit else ["--metrics-port", "0"]


#: The server's cache counters a case records (server/metrics.py; labelled ones summed).
CACHE_METRICS = ("croupier_cache_hit_ratio", "croupier_cache_storage_bytes_per_sample", "croupier_cache_fill_bytes",
                 "croupier_cache_evictions", "croupier_cache_resident_bytes")


def cache_metrics(server: Any) -> dict[str, float]:
    """The server's cache counters from its /metrics, scraped before it stops ({} when there is none)."""
    import urllib.request

    if not server.metrics_port:
        return {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        base = name.split("{", 1)[0].removesuffix("_total")
        if base in CACHE_METRICS:
            found[base] = found.get(base, 0.0) + float(value.rsplit(" ", 1)[-1])
    return found


def _notes(ranks: list[list[dict[str, Any]]]) -> list[str]:
    """What the runners said about their set-up ({"ev": "note"}), once each."""
    return sorted({e["text"] for evs in ranks for e in evs if e["ev"] == "note"})


#: The shared memory a Mosaic StreamingDataset makes, /dev/shm/<6-digit prefix>_<name>.
_MOSAIC_SHM = re.compile(r"^\d{6}_(barrier|cache_usage|locals|next_epoch|shard_access_times|shard_states)$")
#: What Python's multiprocessing leaves there when its processes are SIGKILLed (Grain's spawned workers:
#: the shared memory of their batches, psm_<hex>, and their pool's named semaphores, sem.mp-<name>).
_MP_SHM = re.compile(r"^(psm_[0-9a-f]+|sem\.mp-[\w-]+)$")
#: Per system, the /dev/shm entries a case of it may leave behind after the kill of the resume case.
_SHM_OF = {"mosaic": _MOSAIC_SHM, "grain": _MP_SHM}


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _mapped_shm() -> set[str]:
    """/dev/shm entries some live process has mapped (another program's, or one still in use)."""
    mapped: set[str] = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/maps") as f:
                    mapped |= {line.rsplit("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/" in line}
            except (OSError, IndexError):
                continue
    return mapped


def _shm_cleanup(rec: dict[str, Any], system: str, before: set[str]) -> None:
    """The entries this case made that a crash leaves (no process of the case is alive then): Mosaic's,
    as its clean_stale_shared_memory() does after a crash (its own stops at the first prefix without a
    leak, and leaves later prefixes behind); multiprocessing's that no live process maps."""
    pattern = _SHM_OF.get(system)
    if pattern is None:
        return
    left = {n for n in _shm() - before if pattern.match(n)}
    if system != "mosaic":
        left -= _mapped_shm()
    for name in sorted(left):
        try:
            os.unlink(f"/dev/shm/{name}")
        except OSError as exc:
            rec["problems"].append(f"{LABELS[system]}'s shared memory {name} not removed: {exc}")


# ---- the suite --------------------------------------------------------------------------------

def planned(suite: PeersSuite, only: str = "") -> list[tuple[Condition, str, str, str]]:
    """(condition, dataset, system, variant) of every case the suite runs, in order; `only` keeps those whose
    'dataset | storage | system | variant' contains it (the cases NOT_RUN names are in it, and reported skipped)."""
    plan = [(cond, ds, system, v) for cond in suite.conditions for ds in suite.datasets for system in suite.systems
            for v in VARIANTS.get(system, ("default",)) if v in suite.variants and not (v == "shards" and ds == "text")]
    return [p for p in plan if not only or only in f"{p[1]} | {p[0].name} | {p[2]} | {p[3]}"]


def not_run(system: str, storage: str, ds: str) -> str:
    """Why `system` does not run `ds` on `storage` here ("" when it does)."""
    return NOT_RUN.get((system, storage, ds)) or NOT_RUN.get((system, storage, "*")) or ""


def needed_venvs(suite: PeersSuite) -> list[str]:
    """The peers' venvs the suite runs in: each system's own (its writer runs there), then any other one
    a storage of the suite needs (STORAGE_VENVS)."""
    names = [s for s in suite.systems if s != "croupier"]
    for system in names[:]:
        for cond in suite.conditions:
            if venv_of(system, cond.key) not in names:
                names.append(venv_of(system, cond.key))
    return names


def _setup_systems(suite: PeersSuite, say: Callable[[str], None], rep: dict[str, Any]) -> dict[str, str]:
    """Python per venv name (croupier: this one); a venv that cannot be made is an error in the results."""
    pythons: dict[str, str] = {"croupier": sys.executable} if "croupier" in suite.systems else {}
    if "croupier" in suite.systems:
        import croupier

        rep["versions"]["croupier"] = {"croupier": getattr(croupier, "__version__", "0.1.0"),
                                       "revision": revision(short=True)}
    for name in needed_venvs(suite):
        env = venvs.PEERS[name]
        try:
            pythons[name] = str(venvs.ensure(env, say))
            rep["versions"][name] = venvs.versions(env)
        except Exception as exc:  # a peer that cannot be installed is reported, the others run
            rep["errors"].append(f"{name}: venv not made: {exc}")
            say(f"  {name}: no venv: {exc}")
    return pythons


def run_peers(suite: PeersSuite, out: Path, data_dir: Path, command: str, say: Callable[[str], None] = print,
              only: str = "") -> Report:
    """Runs `suite` (only the cases whose "dataset | storage | system | variant" contains `only`)
    and writes `<suite>.json`, `.md` and the plots under `out`."""
    from . import report

    def measure(rep: Report) -> None:
        rep.update({"data": asdict(suite.data), "world": suite.world, "batch": suite.batch, "epochs": suite.epochs,
                    "workers": suite.workers, "shards": suite.shards, "cache_fraction": suite.cache_fraction,
                    "versions": {}, "skipped": [], "cases": []})
        log = Path(tempfile.gettempdir()) / f"croupier-bench-{suite.name}-runs.log"  # kept: not a result
        log.write_text("")
        with tempfile.TemporaryDirectory(prefix=f"croupier-bench-{suite.name}-", dir=str(Path.home() / ".cache"),
                                         ignore_cleanup_errors=True) as work:
            ctx = _prepare(suite, rep, data_dir, Path(work), log, say)
            plan = planned(suite, only)
            ctx.total = len(plan)
            for cond in suite.conditions:
                _run_condition(ctx, rep, cond, [p for p in plan if p[0] == cond])
        rep["uniform_reference"] = {ds: quality.uniform_reference(suite.rows(ds), suite.batch, suite.shard_rows(ds))
                                    for ds in suite.datasets}
        rep["goal"] = report.goal(rep)

    return drive(suite.name, out, command, measure, report.markdown, report.plots, say)


def _prepare(suite: PeersSuite, rep: Report, data_dir: Path, work: Path, log: Path, say: Callable[[str], None]) -> Ctx:
    """The data, each peer's venv and its shards (written by its own writer); what was written
    goes into rep["written"]."""
    data = ensure_data(data_dir, suite.data, log=say)
    export_source(data, suite.data)
    ctx = Ctx(suite, data, work, log, say)
    ctx.pythons = _setup_systems(suite, say, rep)
    for system in suite.systems:
        if system in OWN_FILES or system not in ctx.pythons:
            continue
        for ds in suite.datasets:
            try:
                ctx.written[(system, ds)] = write_shards(suite, system, Path(ctx.pythons[system]), data, ds, log, say)
            except Exception as exc:
                rep["errors"].append(f"{system} {ds}: shards not written: {exc}")
                say(f"  {system}: {exc}")
    for ds in suite.datasets:
        src = data.text if ds == "text" else data.imagefolder
        for system in OWN_FILES:
            if system in suite.systems:
                ctx.written[(system, ds)] = {"bytes": sum(f.stat().st_size for f in src.rglob("*") if f.is_file())}
    rep["written"] = {f"{k[0]} {k[1]}": v for k, v in ctx.written.items()}
    return ctx


def _run_condition(ctx: Ctx, rep: Report, cond: Condition, todo: list[tuple[Condition, str, str, str]]) -> None:
    """The planned cases of one storage condition, on one mount or S3 server; each system's
    default run's order is the expected one its resume is checked against."""
    from . import report

    if not todo:
        return
    reason = _unusable(cond)
    if reason:
        rep["skipped"].append(f"{cond.name}: {reason}")
        ctx.say(f"skipping {cond.name}: {reason}")
        return
    with open_storage(cond, ctx.data) as st:
        expected: dict[tuple[str, str], np.ndarray] = {}
        for _, ds, system, variant in todo:
            ctx.done += 1
            what = f"{ds} | {cond.name} | {LABELS[system]} | {variant}"
            if venv_of(system, cond.key) not in ctx.pythons or (system, ds) not in ctx.written:
                rep["skipped"].append(f"{what}: not set up (see errors)")
                continue
            why = not_run(system, cond.key, ds)
            if why:
                rep["skipped"].append(f"{what}: {why}")
                continue
            ctx.say(f"[{ctx.done}/{ctx.total}] {what} ...")
            r = attempt(rep, what, lambda: run_system(ctx, st, system, ds, variant, ctx.done,
                                                      expected.get((system, ds))), ctx.say)
            if r is None:
                continue
            if variant == "default" and r.get("order_epoch0"):
                expected[(system, ds)] = np.asarray(r["order_epoch0"])
            r.pop("order_epoch0", None)
            rep["cases"].append(r)
            rep["errors"] += [f"{what}: {p}" for p in r["problems"]]
            ctx.say("    " + report.one_line(r))
