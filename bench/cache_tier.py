"""The cache tier against no cache, side by side in one run (issue 25, item 5).

    python -m croupier.bench.cache_tier [--rows 40000] [--row-bytes 1000] [--epochs 3]
        [--out bench/results/cache_tier.md] [--skip s3 raised]
    python -m croupier.bench.cache_tier --data images [--images 6000] --skip s3 \
        --out bench/results/cache_tier-images.md

One text table (Arrow IPC, `rows` rows of `row-bytes` bytes), or with `--data images` an
ImageFolder of `images` 64x64 JPEGs (read whole, not decoded), on slow storage; for every
condition, one `croupier serve` process per cache setting (on: the defaults; 10%: a
`--cache-memory` of a tenth of the file in whole 1 MiB blocks; off: `--cache-memory 0`), one rank, batch 64,
`epochs` epochs. Each epoch's samples/s, and what storage served per delivered sample:
requests (the FUSE daemon's read requests, or the S3 server's GETs) and bytes (as a share
of the data's bytes: 1.0 = the data read once that epoch).

Conditions (5 ms lognormal per read, sigma 0.5):
- fuse-default: latencyfs with the kernel's defaults (max_background 12, readahead 128 KB),
  as s3fs, rclone and gcsfuse are mounted; the page cache dropped before the first epoch only.
  The server keeps the file open, so the kernel's page cache keeps what any epoch read:
  later epochs read nothing from the mount even without the cache.
- fuse-default, no page cache: the same mount with the page cache dropped before every epoch
  (`latencyfs.evict`): what a mount whose pages are not kept, or data beyond the page cache,
  costs (within an epoch, readahead pages still serve their neighbours). The 10% cache runs here.
- fuse-raised: latencyfs with max_background 1024 (what a tuned mount allows), no page cache.
- s3: the loopback S3 server (bench/s3server.py, its own process), no page cache exists.
- rclone, s3fs: that bucket through `rclone mount` or `s3fs`, each with its defaults
  (bench/bucket_mount.py), the path given to croupier; before every epoch the kernel's page
  cache dropped (drop_caches: pages a process has mapped stay) and every file stat'ed (names
  warm, data cold: see `cold_data_warm_names`). Storage reads: the S3 server's GETs.

Target (issue 25): storage reads per delivered sample over `epochs` (3) epochs of data that
fits, at most 1/3 + 0.05, i.e. the data read from storage at most once: measured in bytes
(storage bytes over the server's whole run / bytes of the data delivered), with the cache on,
under every condition (it counts where the page cache cannot help: all but fuse-default).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from croupier.client import Loader

from . import latencyfs
from .driver import attempt, drive
from .reporting import header_lines, num

MEDIAN_MS, SIGMA = 5.0, 0.5
RAISED = 1024
#: One storage's counters: (read requests or GETs, bytes served) since it started.
Counter = Callable[[], tuple[int, int]]


@dataclass(frozen=True)
class Storage:
    dataset: str  # the `croupier serve` argument NAME=URL
    counter: Counter
    evict: Callable[[], object]  # drops the page cache of the data (a no-op where there is none)
    env: dict[str, str]  # what `croupier serve` needs to reach it


@dataclass(frozen=True)
class Condition:
    key: str
    title: str
    settings: tuple[str, ...]  # cache settings run under it: "on", "10%", "off"
    evict_every_epoch: bool


CONDITIONS = (
    Condition("fuse-default", "latencyfs 5 ms, kernel defaults (max_background 12), page cache kept",
              ("on", "off"), False),
    Condition("fuse-default-nopc", "latencyfs 5 ms, kernel defaults, page cache dropped before every epoch",
              ("on", "10%", "off"), True),
    Condition("fuse-raised", f"latencyfs 5 ms, max_background {RAISED}, page cache dropped before every epoch",
              ("on", "off"), True),
    Condition("s3", "loopback S3 server, 5 ms lognormal per request", ("on", "off"), False),
    Condition("rclone", "rclone mount (defaults) of the loopback S3 server's bucket, 5 ms lognormal per request, "
              "page cache dropped before every epoch", ("on", "off"), True),
    Condition("s3fs", "s3fs (defaults) mount of the loopback S3 server's bucket, 5 ms lognormal per request, "
              "page cache dropped before every epoch", ("on", "off"), True),
)


def write_table(path: Path, rows: int, row_bytes: int) -> None:
    table = pa.table({"id": np.arange(rows, dtype=np.int64), "text": ["x" * row_bytes] * rows})
    with pa.ipc.new_file(str(path), table.schema) as w:
        w.write_table(table, max_chunksize=1000)


def table_folder(tmp: Path, rows: int, row_bytes: int) -> tuple[Path, int]:
    """tmp/src holding t.arrow (see write_table), and the file's size."""
    (tmp / "src").mkdir()
    write_table(tmp / "src" / "t.arrow", rows, row_bytes)
    return tmp / "src", (tmp / "src" / "t.arrow").stat().st_size


def image_folder(tmp: Path, images: int) -> tuple[Path, int]:
    """tmp/src/t: an ImageFolder of `images` 64x64 JPEGs in 10 classes, and their bytes."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(images):
        folder = tmp / "src" / "t" / f"c{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(folder / f"{i}.jpg", quality=85)
    return tmp / "src", sum(f.stat().st_size for f in (tmp / "src" / "t").rglob("*.jpg"))


def serve(datasets: list[str], extra: list[str], tmp: Path, env: dict[str, str] | None = None
          ) -> tuple[subprocess.Popen, dict[str, int]]:
    """A `croupier serve` process on a free port, its log appended to tmp/server.log, and its
    ready file ({"port", "metrics_port", "pid"})."""
    ready = tmp / f"ready-{time.monotonic_ns()}.json"
    proc = subprocess.Popen([sys.executable, "-m", "croupier.cli", "serve", *datasets, "--port", "0",
                             "--ready-file", str(ready), "--log-level", "INFO", *extra],
                            stdout=open(tmp / "server.log", "a"), stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"croupier serve exited {proc.returncode}: {(tmp / 'server.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def tenth(data_bytes: int) -> int:
    """A tenth of the data, in whole 1 MiB blocks (the cache admits whole blocks only)."""
    return max(1, round(data_bytes / 10 / 2**20)) * 2**20


def cache_flags(setting: str, data_bytes: int) -> list[str]:
    return {"on": [], "off": ["--cache-memory", "0"], "10%": ["--cache-memory", str(tenth(data_bytes))]}[setting]


def one_epoch(port: int, epoch: int) -> tuple[int, float]:
    """(samples, seconds) of one rank's epoch at batch 64 (images undecoded)."""
    from croupier.client import ImageDecoding

    loader = Loader("t", servers=f"127.0.0.1:{port}", batch_size=64, seed=0, format="numpy",
                    decoding=ImageDecoding(output="none"))
    loader.set_epoch(epoch)
    t, n = time.perf_counter(), 0
    for batch in loader:
        n += len(next(iter(batch.values())))
    return n, time.perf_counter() - t


def run_setting(port: int, epochs: int, counter: Counter, data_bytes: int,
                before_epoch: Callable[[], object]) -> list[dict[str, Any]]:
    """Each epoch's figures; its storage counts run from the previous epoch's end (a fill
    still going after an epoch counts in the next)."""
    out = []
    reads, nbytes = counter()
    for epoch in range(epochs):
        before_epoch()
        n, secs = one_epoch(port, epoch)
        reads2, nbytes2 = counter()
        out.append({"epoch": epoch, "samples": n, "seconds": secs, "samples_per_s": n / secs,
                    "storage_reads": reads2 - reads, "storage_bytes": nbytes2 - nbytes,
                    "reads_per_sample": (reads2 - reads) / n, "data_read": (nbytes2 - nbytes) / data_bytes})
        reads, nbytes = reads2, nbytes2
    return out


@contextlib.contextmanager
def fuse_storage(src: Path, max_background: int, name: str) -> Iterator[Storage]:
    with latencyfs.mounted(src, median_ms=MEDIAN_MS, sigma=SIGMA, max_background=max_background) as fs:
        def counter() -> tuple[int, int]:
            s = fs.stats()
            return s["requests"], s["bytes"]
        yield Storage(f"t={fs.path / name}", counter, fs.evict, {})


@contextlib.contextmanager
def s3_storage(src: Path, name: str, through: str | None = None) -> Iterator[Storage]:
    """The loopback S3 server holding `src` as s3://bench/ds; `through` "rclone" or "s3fs":
    that bucket mounted by that FUSE client (its defaults), the data given by its path there."""
    from . import s3server
    from .bucket_mount import rclone_mounted, s3fs_mounted

    root = Path(tempfile.mkdtemp(prefix="cache-tier-s3-"))
    (root / "bench").mkdir()
    (root / "bench" / "ds").symlink_to(src.resolve(), target_is_directory=True)
    with s3server.running(root, latency=s3server.Latency.lognormal(MEDIAN_MS, SIGMA, 0), process=True) as server:
        env = {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": "bench",
               "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}

        def counter() -> tuple[int, int]:
            s = server.stats()
            return s["by_method"].get("GET", 0), s["bytes"]
        if through is None:
            where = "s3://bench/ds" if name.endswith(".arrow") else f"s3://bench/ds/{name}"  # the table: its folder
            yield Storage(f"t={where}", counter, lambda: None, env)
            return
        mount = rclone_mounted if through == "rclone" else s3fs_mounted
        with mount(server.endpoint, "bench", timeout=30) as mnt:
            yield Storage(f"t={mnt / 'ds' / name}", counter, lambda: cold_data_warm_names(mnt / "ds"), {})


def cold_data_warm_names(root: Path) -> None:
    """The kernel's page cache dropped (root; mapped pages stay), then every file under
    `root` stat'ed: a mount in use knows its names, its data is cold. Without this the first
    server on a fresh rclone mount ran its cold epoch at half the second's speed, whichever
    cache setting it had (835 vs 1,519 images/s, 6,000 JPEGs)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")
    for folder, _, names in os.walk(root):
        for n in names:
            os.stat(os.path.join(folder, n))


def run_condition(cond: Condition, src: Path, data_bytes: int, epochs: int, tmp: Path,
                  say: Callable[[str], None], name: str = "t.arrow") -> dict[str, Any]:
    res: dict[str, Any] = {"key": cond.key, "title": cond.title, "settings": {}}
    if cond.key in ("s3", "rclone", "s3fs"):
        storage: Any = s3_storage(src, name, through=None if cond.key == "s3" else cond.key)
    else:
        storage = fuse_storage(src, RAISED if cond.key == "fuse-raised" else latencyfs.KERNEL_DEFAULT, name)
    with storage as st:
        for setting in cond.settings:
            st.evict()
            start = st.counter()
            proc, ready = serve([st.dataset], cache_flags(setting, data_bytes), tmp, st.env)
            try:
                drop = st.evict if cond.evict_every_epoch else (lambda: None)
                res["settings"][setting] = run_setting(ready["port"], epochs, st.counter, data_bytes, drop)
            finally:
                stop(proc)
            end = st.counter()
            # everything the server read, its open and any fill left after the last epoch included
            res.setdefault("whole_run", {})[setting] = {"storage_reads": end[0] - start[0],
                                                        "storage_bytes": end[1] - start[1]}
            e = res["settings"][setting]
            say(f"{cond.key} cache {setting}: " + ", ".join(
                f"{x['samples_per_s']:,.0f}/s {x['reads_per_sample']:.3f} r/s {x['data_read']:.2f}x" for x in e))
    return res


def totals(cond: dict[str, Any], setting: str, data_bytes: int) -> dict[str, float]:
    """Storage reads per delivered sample and the data's bytes read per epoch: over the
    setting's whole run (the server's start to its end: the read-path probe at open, every
    epoch, any fill left after the last), and over its epochs only."""
    epochs, whole = cond["settings"][setting], cond["whole_run"][setting]
    n = sum(e["samples"] for e in epochs)
    return {"reads_per_sample": whole["storage_reads"] / n,
            "data_read_per_epoch": whole["storage_bytes"] / data_bytes / len(epochs),
            "epochs_reads_per_sample": sum(e["storage_reads"] for e in epochs) / n,
            "epochs_data_read_per_epoch": sum(e["storage_bytes"] for e in epochs) / data_bytes / len(epochs)}


def at_most(name: str, measured: float | None, limit: float, detail: str) -> dict[str, Any]:
    """A target met when `measured` is at most `limit` (reporting.target's shape)."""
    return {"target": name, "measured": measured, "want": limit,
            "met": bool(measured is not None and measured <= limit), "detail": detail}


def targets(rep: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    limit = 1 / rep["epochs"] + 0.05
    for cond in rep["conditions"]:
        if "on" not in cond["settings"]:
            continue
        on = totals(cond, "on", rep["data_bytes"])
        off = totals(cond, "off" if "off" in cond["settings"] else "on", rep["data_bytes"])
        out.append(at_most(
            f"{cond['key']}: storage reads per delivered sample over {rep['epochs']} epochs "
            f"<= 1/{rep['epochs']} + 0.05",
            on["data_read_per_epoch"], limit,
            f"cache on: the data's bytes read {on['data_read_per_epoch']:.3f} times per epoch over the server's "
            f"whole run ({on['reads_per_sample']:.4f} requests per sample), {on['epochs_data_read_per_epoch']:.3f} "
            f"in its epochs alone; cache off: {off['data_read_per_epoch']:.3f} ({off['reads_per_sample']:.4f} "
            f"requests per sample), {off['epochs_data_read_per_epoch']:.3f} in its epochs"))
    return out


def markdown(rep: dict[str, Any], plots: list[str]) -> str:
    what = (f"{rep['images']:,} 64x64 JPEGs ({rep['data_bytes'] / 1e6:.1f} MB ImageFolder, read whole, not decoded)"
            if rep.get("data") == "images" else
            f"{rep['rows']:,} rows of {rep['row_bytes']} B ({rep['data_bytes'] / 1e6:.1f} MB Arrow IPC)")
    lines = [f"# Cache tier: {what}, 1 rank, batch 64, {rep['epochs']} epochs", "", *header_lines(rep),
             "Storage reads: the FUSE daemon's read requests (128 KiB at most each) or the S3 server's GETs. "
             "Data read: storage bytes / the data's bytes, per epoch (1.00 = every byte read once that epoch). "
             "Whole run: from the server's start to its end, its read-path probe of the mount at open included "
             "(about 540 reads of 4 KiB on latencyfs); epochs only: the epochs' own. "
             "Settings: on = the defaults (`--cache-memory 25%`), "
             f"10% = `--cache-memory {tenth(rep['data_bytes'])}` ({tenth(rep['data_bytes']) / rep['data_bytes']:.1%} "
             "of the file, whole 1 MiB blocks), off = `--cache-memory 0`.", ""]
    for cond in rep["conditions"]:
        lines += [f"## {cond['title']}", "", "| cache | epoch | samples/s | storage reads per sample | data read |",
                  "|---|---|---|---|---|"]
        for setting, epochs in cond["settings"].items():
            lines += [f"| {setting} | {e['epoch']} | {num(e['samples_per_s'])} | {e['reads_per_sample']:.4f} | "
                      f"{e['data_read']:.3f} |" for e in epochs]
            t = totals(cond, setting, rep["data_bytes"])
            lines.append(f"| {setting} | whole run | | {t['reads_per_sample']:.4f} | {t['data_read_per_epoch']:.3f} per epoch |")
            lines.append(f"| {setting} | epochs only | | {t['epochs_reads_per_sample']:.4f} | "
                         f"{t['epochs_data_read_per_epoch']:.3f} per epoch |")
        lines.append("")
    lines += ["## Targets", ""] + [f"- {'met' if t['met'] else 'NOT met'}: {t['target']}: {t['detail']}"
                                   for t in rep["targets"]]
    lines += ["", "## Not measured here", "", *[f"- {x}" for x in rep["not_measured"]]]
    if rep["errors"]:
        lines += ["", "## Errors", "", *[f"- {e}" for e in rep["errors"]]]
    return "\n".join(lines) + "\n"


NOT_MEASURED = [
    "Peers side by side: `python -m croupier.bench.peers --cache` (bench/results/peers-cache.md) runs croupier, "
    "Mosaic Streaming and LitData, each with its cache at its default and at 10% of the data, on the FUSE mount "
    "with the kernel's defaults and the raised one (`--cache s3`: on S3).",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m croupier.bench.cache_tier", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=40000)
    p.add_argument("--row-bytes", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--data", choices=("text", "images"), default="text")
    p.add_argument("--images", type=int, default=6000, help="with --data images: how many JPEGs")
    p.add_argument("--skip", nargs="*", default=[], choices=[c.key for c in CONDITIONS], help="conditions left out")
    p.add_argument("--out", type=Path, default=Path("bench/results/cache_tier.md"),
                   help="the Markdown report (its JSON beside it, named alike)")
    p.add_argument("--render", type=Path, help="rewrite --out from a JSON this script saved, without measuring")
    args = p.parse_args(argv)
    if args.render:
        args.out.write_text(markdown({**json.loads(args.render.read_text()), "not_measured": NOT_MEASURED}, []))
        return 0
    reason = latencyfs.check_available()
    if reason:
        print(f"latencyfs unusable here: {reason}")
        return 1
    command = " ".join(["python -m croupier.bench.cache_tier", *(sys.argv[1:] if argv is None else argv)])

    def measure(rep: dict[str, Any]) -> None:
        with tempfile.TemporaryDirectory(prefix="cache-tier-") as d:
            tmp = Path(d)
            if args.data == "images":
                src, data_bytes = image_folder(tmp, args.images)
            else:
                src, data_bytes = table_folder(tmp, args.rows, args.row_bytes)
            rep.update(rows=args.rows, row_bytes=args.row_bytes, images=args.images, data=args.data, epochs=args.epochs,
                       data_bytes=data_bytes, conditions=[], not_measured=list(NOT_MEASURED))
            name = "t" if args.data == "images" else "t.arrow"
            for cond in CONDITIONS:
                if cond.key in args.skip:
                    continue
                got = attempt(rep, cond.key,
                              lambda c=cond: run_condition(c, src, data_bytes, args.epochs, tmp, print, name), print)
                if got is not None:
                    rep["conditions"].append(got)
        rep["targets"] = targets(rep)

    drive(args.out.stem, args.out.parent, command, measure, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
