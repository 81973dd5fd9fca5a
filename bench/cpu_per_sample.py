"""Server CPU per delivered sample against the bare read floor, measured in the same run.

    python -m croupier.bench.cpu_per_sample --out bench/results/cpu_per_sample.md

Issue 21, item 4: the server's CPU per delivered sample should be at most 2x what bare C
reads of the same bytes through the same storage cost. Data (made once under
`--data-dir`): an Arrow IPC table of 100,000 rows of 1,000 bytes (text) and an ImageFolder
of 6,000 64x64 JPEGs (read whole, never decoded). Storage: the page-cached local file,
and latencyfs at 5 ms (lognormal, sigma 0.5) with the kernel's defaults (`max_background`
12), its pages evicted before each case. One `croupier serve` per case (its defaults; on
latencyfs with the cache tier on, the default, and off, `--cache-memory 0`; on the local
disk the tier stays out of the way, bench/results/cache_local.md, so only its default),
one Loader rank (format numpy, images undecoded). Server CPU is /proc's user+system of
the server process over the samples after the first batch (the open and the read-path
probe left out), also by thread group.

The floor, in the same run: `_preadpool.measure` on threads of its own, the CPU of those
threads per read, at the concurrency the server reached (its peak storage reads in
flight), by the read path the server used (its per-path read counters): for text, one
1,000-byte read per row at random row offsets of the same file; for images
(`_preadpool.measure_files`), the same image files each opened, fstat'ed, read whole and
closed by bare C threads, as many at once: the syscalls croupier's whole-file jobs make.
Runs before 2026-11-28 used a decomposition instead (one read of the mean image size at
each image's offset in a packed copy beside them, plus one Python thread's open, fstat and
close per file, which paid no cost of concurrency); it is still reported beside it.

Where read groups apply (table rows on a local file system), the same server with them
off (`bench/serve_ungrouped.py`: the per-sample path) runs beside it, alternated
`--ab-rounds` times. Then the profile of what remains: the same text and image cases on the local file under
`bench/profserve.py` (cProfile per thread by CPU clock), the top functions by self CPU
per delivered sample and the CPU by thread group (absolute figures inflated by the
profiler; the shares are what it is for).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from . import latencyfs, procstat
from .cache_local import make_data
from .driver import drive
from .reporting import header_lines

MEDIAN_MS = 5.0
SIGMA = 0.5
ROW_BYTES = 1000
SERVE = ("croupier.cli",)
#: The same server with read groups off (server/stream/read_groups.py): the per-sample path, same run.
UNGROUPED = ("croupier.bench.serve_ungrouped",)
CACHE_CASES = {"on (default)": (), "off": ("--cache-memory", "0")}
#: Thread groups of the server by what they do (procstat.thread_group names).
#: Import machinery: the server's start-up, not its per-sample work (left out of the profile's table).
STARTUP = ("builtins.compile", "marshal.loads", "_imp.", "builtins.exec", "<frozen importlib", "builtins.__build_class__")
GROUPS = {"croupier-read": "native read threads", "croupier-cpu": "encode pool (--workers)", "python": "event loop"}


def pack_images(images: Path, packed: Path) -> list[tuple[int, int]]:
    """Every image of the tree, concatenated into `packed` (made once): (offset, size) each."""
    files = sorted(p for p in images.rglob("*") if p.is_file())
    spans, offset = [], 0
    for p in files:
        size = p.stat().st_size
        spans.append((offset, size))
        offset += size
    if not packed.exists() or packed.stat().st_size != offset:
        tmp = packed.with_suffix(".tmp")
        with open(tmp, "wb") as out:
            for p in files:
                out.write(p.read_bytes())
        tmp.replace(packed)
    return spans


@contextlib.contextmanager
def serving(path: Path, flags: Sequence[str], prefix: Sequence[str]) -> Iterator[tuple[subprocess.Popen, dict]]:
    """`croupier serve d=path` (under `prefix`, e.g. profserve) until the body ends; SIGTERM then."""
    ready = Path(tempfile.mktemp(prefix="croupier-cpu-per-sample-"))
    cmd = [sys.executable, "-m", *prefix, "serve", f"d={path}", "--port", "0", "--metrics-port", "0",
           "--ready-file", str(ready), "--log-level", "WARNING", *flags]
    proc = subprocess.Popen(cmd)
    try:
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"croupier serve exited {proc.returncode}: {' '.join(cmd)}")
            time.sleep(0.05)
        time.sleep(0.1)  # the file is written before it is complete on some file systems
        yield proc, json.loads(ready.read_text())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        ready.unlink(missing_ok=True)


def scrape(port: int) -> dict[str, float]:
    """The server's /metrics as {'name{labels}': value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out


def storage_facts(metrics: dict[str, float]) -> tuple[str, int]:
    """(the read path that issued most reads, the most storage reads in flight at once)."""
    paths = {k.split('path="', 1)[1].split('"', 1)[0]: v for k, v in metrics.items()
             if k.startswith("croupier_storage_path_reads_total{") or k.startswith("croupier_storage_path_reads{")}
    peak = max((v for k, v in metrics.items() if k.startswith("croupier_storage_reads_in_flight_max")), default=1)
    return (max(paths, key=paths.__getitem__) if any(paths.values()) else "pread"), max(int(peak), 1)


def run_case(path: Path, dataset: str, flags: Sequence[str], samples: int,
             prefix: Sequence[str] = ("croupier.cli",)) -> dict[str, Any]:
    """Server CPU per sample (and by thread group) over `samples` delivered after the first batch."""
    from croupier.client import ImageDecoding, Loader

    with serving(path, flags, prefix) as (proc, ready):
        loader = Loader("d", servers=f"127.0.0.1:{ready['port']}", batch_size=64 if dataset == "images" else 256,
                        seed=0, epoch=0, format="numpy", decoding=ImageDecoding(output="none"))
        it, n = iter(loader), 0
        try:
            next(it)  # the open, the read-path probe and the first batch stay out of the count
            cpu0, threads0, t0 = procstat.cpu_seconds(proc.pid), procstat.thread_cpu(proc.pid), time.perf_counter()
            for batch in it:
                n += len(next(iter(batch.values())))
                if n >= samples:
                    break
            cpu1, threads1, wall = procstat.cpu_seconds(proc.pid), procstat.thread_cpu(proc.pid), time.perf_counter() - t0
        finally:
            loader.close()
        read_path, peak = storage_facts(scrape(ready["metrics_port"]))
    groups = procstat.thread_cpu_delta(threads0, threads1, cpu1 - cpu0)
    return {"samples": n, "wall_s": wall, "samples_per_s": n / wall, "server_cpu_s": cpu1 - cpu0,
            "us_per_sample": (cpu1 - cpu0) / n * 1e6,
            "groups_us_per_sample": {g: v["cpu"] / n * 1e6 for g, v in sorted(groups.items(), key=lambda kv: -kv[1]["cpu"])},
            "read_path": read_path, "peak_in_flight": peak}


def floor(file: Path, offsets: list[int], size: int, concurrency: int, read_path: str) -> dict[str, float]:
    """CPU per read of bare C threads: `offsets` of `file`, `size` bytes each, by `read_path`."""
    from croupier.server.storage import native

    fd = os.open(file, os.O_RDONLY)
    mapping = None
    try:
        if read_path == "mmap":
            mapping = native.Mapping(fd)
        seconds, errors, threads, _, _, cpu = native.measure(fd, mapping, offsets, size, min(concurrency, len(offsets)))
    finally:
        if mapping is not None:
            mapping.close()
        os.close(fd)
    return {"us_per_read": cpu / len(offsets) * 1e6, "reads_per_s": len(offsets) / seconds, "errors": errors,
            "threads": threads, "path": read_path}


def floor_files(files: Sequence[Path], concurrency: int) -> dict[str, Any]:
    """CPU per file of bare C threads reading `files` whole (open, fstat, read, close),
    `concurrency` at once: the same bytes through the same storage by the same syscalls."""
    from croupier.server.storage import native

    seconds, errors, threads, nbytes, cpu, _ = native.measure_files([str(f) for f in files], min(concurrency, len(files)))
    us = cpu / len(files) * 1e6
    return {"us_per_read": us, "us_per_sample": us,
            "reads_per_s": len(files) / seconds, "errors": errors, "threads": threads, "bytes": nbytes,
            "path": "open+read+close"}


def open_cost(files: Sequence[Path]) -> float:
    """CPU µs per file of the open, fstat and close an image read needs (one thread, its CPU clock)."""
    t0 = time.thread_time()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fstat(fd)
        os.close(fd)
    return (time.thread_time() - t0) / len(files) * 1e6


def text_offsets(table: Path, count: int, seed: int = 0) -> list[int]:
    """`count` random row-sized offsets inside the table file (rows are ROW_BYTES of text)."""
    size = table.stat().st_size
    rng = random.Random(seed)
    return [rng.randrange(0, (size - ROW_BYTES) // ROW_BYTES) * ROW_BYTES for _ in range(count)]


def measure_storage(condition: str, root: Path, data: dict[str, Path], spans: list[tuple[int, int]],
                    args: argparse.Namespace, evict: Any) -> list[dict[str, Any]]:
    """Every case of one storage: server CPU per sample, then the floor right after it."""
    rows = []
    cases = CACHE_CASES if condition.startswith("latencyfs") else {"on (default)": ()}
    image_files = sorted(p for p in data["images"].rglob("*") if p.is_file())
    for dataset in ("text", "images"):
        variants = [(cache, flags, SERVE) for cache, flags in cases.items()]
        if dataset == "text" and not condition.startswith("latencyfs"):  # where read groups apply
            pair = [*variants, *[(cache + ", read groups off", flags, UNGROUPED) for cache, flags in cases.items()]]
            variants = pair * args.ab_rounds  # alternated: the machine's drift falls on both
        for cache, flags, prefix in variants:
            evict()
            samples = args.text_samples if dataset == "text" else args.image_samples
            got = run_case(data[dataset], dataset, flags, samples, prefix)
            evict()
            if dataset == "text":
                fl = floor(data["text"], text_offsets(data["text"], args.floor_reads), ROW_BYTES,
                           got["peak_in_flight"], got["read_path"])
                fl["opens_us"] = 0.0
                fl["us_per_sample"] = fl["us_per_read"]
            else:
                fl = floor_files(image_files[:args.floor_reads], got["peak_in_flight"])
                # The decomposition earlier runs used (preads of a packed copy at that
                # concurrency, plus one thread's open, fstat and close), kept beside it.
                mean = round(sum(s for _, s in spans) / len(spans))
                packed = floor(root / "images.packed", [o for o, _ in spans][:args.floor_reads], mean,
                               got["peak_in_flight"], "pread")
                fl["packed"] = {**packed, "opens_us": open_cost(image_files[:args.floor_reads])}
            row = {"storage": condition, "dataset": dataset, "cache": cache, **got, "floor": fl,
                   "ratio": got["us_per_sample"] / fl["us_per_sample"]}
            rows.append(row)
            print(f"{condition} {dataset} cache {cache}: {got['samples_per_s']:,.0f} samples/s, server "
                  f"{got['us_per_sample']:.1f} us/sample, floor {fl['us_per_sample']:.1f} ({fl['path']}, "
                  f"{got['peak_in_flight']} in flight), ratio {row['ratio']:.1f}x", flush=True)
    return rows


def profile(data: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    """The text and image cases on the local file under profserve: what remains, by function."""
    out: dict[str, Any] = {}
    for dataset in ("text", "images"):
        report = Path(tempfile.mktemp(prefix="croupier-profserve-", suffix=".json"))
        samples = args.text_samples if dataset == "text" else args.image_samples
        from croupier.client import ImageDecoding, Loader

        with serving(data[dataset], (), ("croupier.bench.profserve", str(report))) as (_, ready):
            loader = Loader("d", servers=f"127.0.0.1:{ready['port']}", batch_size=64 if dataset == "images" else 256,
                            seed=0, epoch=0, format="numpy", decoding=ImageDecoding(output="none"))
            n = 0
            try:
                for batch in loader:
                    n += len(next(iter(batch.values())))
                    if n >= samples:
                        break
            finally:
                loader.close()
        got = json.loads(report.read_text())
        report.unlink(missing_ok=True)
        out[dataset] = {"samples": n, "python_cpu_s": got["python_cpu_s"],
                        "process_cpu_s": got["process_user_s"] + got["process_system_s"],
                        "threads": got["threads"],
                        "self": [f for f in got["self"] if not any(m in f["function"] for m in STARTUP)][:args.top]}
        print(f"profile {dataset}: {n} samples, process CPU {out[dataset]['process_cpu_s']:.1f} s", flush=True)
    return out


def measure(args: argparse.Namespace, rep: dict[str, Any]) -> None:
    root = args.data_dir
    data = make_data(root)
    spans = pack_images(data["images"], root / "images.packed")
    rows = []
    # The page-cached local file: read everything once so it is cached.
    procstat.load_into_page_cache([data["text"], data["images"], root / "images.packed"])
    rows += measure_storage("page-cached local file", root, data, spans, args, lambda: None)
    with latencyfs.mounted(root, median_ms=MEDIAN_MS, sigma=SIGMA, max_background=latencyfs.KERNEL_DEFAULT) as fs:
        mnt = Path(fs.path)
        over = {"text": mnt / data["text"].name, "images": mnt / data["images"].name}
        rows += measure_storage("latencyfs 5 ms, kernel defaults", mnt, over, spans, args, fs.evict)
    prof = profile(data, args) if args.top else {}
    before = json.loads(args.before.read_text()) if args.before else None
    rep.update(settings={"text_samples": args.text_samples, "image_samples": args.image_samples,
                         "floor_reads": args.floor_reads, "data_dir": str(root),
                         "revision_note": args.note}, rows=rows, profile=prof,
               before=before and {"code": before.get("code") or before.get("revision"),
                                   "note": before["settings"].get("revision_note", ""), "rows": before["rows"]})


def _fmt_groups(groups: dict[str, float]) -> str:
    return ", ".join(f"{GROUPS.get(g, g)} {v:.0f}" for g, v in list(groups.items())[:4] if v >= 0.5)


def _table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| storage | data | cache tier | samples/s | server CPU µs/sample | floor µs/sample (path, in flight) "
           "| ratio | server CPU by thread group, µs/sample |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fl = r["floor"]
        opens = f" + {fl['opens_us']:.1f} open" if fl.get("opens_us") else ""  # runs before the files floor
        packed = fl.get("packed")
        was = (f"; the earlier decomposition: {packed['us_per_read']:.1f} a pread of a packed copy + "
               f"{packed['opens_us']:.1f} open" if packed else "")
        out.append(f"| {r['storage']} | {r['dataset']} | {r['cache']} | {r['samples_per_s']:,.0f} | "
                   f"{r['us_per_sample']:.1f} | {fl['us_per_read']:.1f}{opens} ({fl['path']}, {r['peak_in_flight']}{was}) "
                   f"| **{r['ratio']:.1f}x** | {_fmt_groups(r['groups_us_per_sample'])} |")
    return out


def report(rep: dict[str, Any], plots: Sequence[str] = ()) -> str:
    s = rep["settings"]
    lines = ["# Server CPU per delivered sample against the bare read floor", "", *header_lines(rep),
             *([s["revision_note"], ""] if s.get("revision_note") else []),
             "Text: an Arrow IPC table of 100,000 rows of 1,000 bytes; images: an ImageFolder of 6,000 64x64 JPEGs "
             f"(read whole, not decoded). One server per case, one Loader rank; {s['text_samples']:,} text rows "
             f"and {s['image_samples']:,} images counted after the first batch. Server CPU: /proc user+system of "
             "the server process. Floor: `_preadpool.measure`, the CPU of its own threads per read of the same "
             "bytes through the same storage, at the server's peak storage reads in flight, by the path the server "
             f"used ({s['floor_reads']:,} reads); for images `_preadpool.measure_files`: bare threads opening, "
             "fstat'ing, reading whole and closing the same image files, as many at once.", "",
             *_table(rep["rows"])]
    if rep.get("before"):
        b = rep["before"]
        lines += ["", f"## Before, in an earlier run ({b['code']})", "", *([b["note"], ""] if b["note"] else []),
                  *_table(b["rows"])]
    for dataset, p in rep.get("profile", {}).items():
        n = p["samples"]
        lines += ["", f"## What remains: {dataset}, page-cached local file, under profserve", "",
                  f"{n:,} samples over the server's whole run (open included; import machinery left out of the "
                  "table); process CPU "
                  f"{p['process_cpu_s'] / n * 1e6:.0f} µs/sample under the profiler, Python threads "
                  f"{p['python_cpu_s'] / n * 1e6:.0f}. By thread group (µs/sample): "
                  + ", ".join(f"{g} {v / n * 1e6:.1f}" for g, v in p["threads"][:5]) + ".", "",
                  "| function | calls/sample | self µs/sample |", "|---|---|---|"]
        for f in p["self"]:
            lines.append(f"| `{f['function']}` | {f['calls'] / n:.2f} | {f['self_s'] / n * 1e6:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m croupier.bench.cpu_per_sample", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text-samples", type=int, default=40_000)
    p.add_argument("--image-samples", type=int, default=5_000)
    p.add_argument("--floor-reads", type=int, default=5_000)
    p.add_argument("--ab-rounds", type=int, default=2, help="rounds of read groups on and off (local text)")
    p.add_argument("--top", type=int, default=15, help="functions in each profile (0: no profile)")
    p.add_argument("--note", default="", help="a line for the report (e.g. which revision is measured)")
    p.add_argument("--before", type=Path, help="an earlier run's JSON, shown beside this one (another revision)")
    p.add_argument("--data-dir", type=Path,
                   default=Path.home() / ".cache" / "croupier" / "bench-data" / "cpu-per-sample")
    p.add_argument("--out", type=Path, default=Path("bench/results/cpu_per_sample.md"))
    args = p.parse_args(argv)
    command = shlex.join(["python", "-m", "croupier.bench.cpu_per_sample", *(sys.argv[1:] if argv is None else argv)])
    drive(args.out.stem, args.out.parent, command, lambda rep: measure(args, rep), report)
    print(args.out.read_text())


if __name__ == "__main__":
    main()
