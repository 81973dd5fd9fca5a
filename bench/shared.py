"""`python -m croupier.bench.shared`: K identical jobs against one server, on really slow storage.

A sweep's K trials stream the same epoch with the same seed. For K = 1, 2, 4, 8 (one
fresh `croupier serve` each), K jobs each stream R ranks (default 1) of the same epoch
at once; each job is its own process (raw gRPC streams, no decode: the server is what
is measured). Storage conditions:

* fuse: the dataset mounted through latencyfs (every read request sleeps a seeded
  lognormal draw, median --latency-ms, sigma 0.5), its pages evicted before each K;
* pagecache: the plain files, read into the page cache first (nothing to wait for).

Reported per (condition, K): storage reads per delivered sample (croupier's store
counter, and the FUSE daemon's requests), each job's samples/s and its ratio to K = 1
(alone), the server's peak RSS, and the shared-epoch counters (joins, detaches).
With --compare-off, each K also runs with `--no-shared-epochs`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import latencyfs
from .cases import ServerProcess
from .driver import drive
from .procstat import load_into_page_cache, peak_rss_mb
from .promscrape import scrape
from .reporting import header_lines


def write_dataset(folder: Path, rows: int, row_bytes: int) -> Path:
    """One Arrow IPC file of `rows` rows (an id and `row_bytes` random bytes), made once."""
    import pyarrow as pa

    path = folder / f"shared-{rows}x{row_bytes}.arrow"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    tmp = path.with_suffix(".tmp")
    schema = pa.schema([("id", pa.int64()), ("blob", pa.binary())])
    with pa.ipc.new_file(str(tmp), schema) as w:
        for start in range(0, rows, 1024):
            n = min(1024, rows - start)
            w.write_batch(pa.record_batch([pa.array(np.arange(start, start + n)),
                                           pa.array([rng.bytes(row_bytes) for _ in range(n)], pa.binary())],
                                          schema=schema))
    tmp.rename(path)
    return path


def _job(address: str, ranks: int, batch_size: int, seed: int, out: Any, ready: Any, go: Any) -> None:
    """One job: `ranks` streams of the same epoch at once; puts (samples, seconds).
    Jobs start together: each connects, says it is ready, and waits for `go`."""
    import grpc

    from croupier.protocol.options import StreamOptions
    from croupier.v1 import croupier_pb2_grpc as pb_grpc

    async def rank(stub, r: int) -> int:
        n = 0
        opts = StreamOptions(dataset="data", batch_size=batch_size, seed=seed, rank=r, world_size=ranks)
        async for msg in stub.StreamEpoch(opts.to_proto()):
            if msg.WhichOneof("kind") == "chunk":
                n += len(msg.chunk.indices)
        return n

    async def main() -> tuple[int, float]:
        async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
            stub = pb_grpc.CroupierStub(ch)
            await ch.channel_ready()
            ready.release()
            await asyncio.get_running_loop().run_in_executor(None, go.wait)
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(rank(stub, r) for r in range(ranks)))
            return sum(counts), time.perf_counter() - t0

    out.put(asyncio.run(main()))


def _metrics(port: int | None) -> dict[str, float]:
    if not port:
        return {}
    out: dict[str, float] = {}
    for base, labels, value in scrape(port):
        if base.startswith(("croupier_storage_reads_total", "croupier_samples_served_total", "croupier_shared_")):
            # Storage reads summed over schemes; the others kept by label.
            key = f"{base}{{{labels}}}" if labels and not base.startswith("croupier_storage_reads_total") else base
            out[key] = out.get(key, 0.0) + value
    return out


def run_k(path: Path, k: int, args: argparse.Namespace, log: Path, shared: bool, fs: Any = None) -> dict[str, Any]:
    flags = ["--metrics-port", "0", "--workers", str(args.workers)]
    if not shared:
        flags.append("--no-shared-epochs")
    server = ServerProcess([f"data={path}"], flags, log)
    try:
        if fs is not None:
            fs.evict()
            fs.reset_stats()
        ctx = mp.get_context("spawn")
        q, ready, go = ctx.Queue(), ctx.Semaphore(0), ctx.Event()
        jobs = [ctx.Process(target=_job, args=(server.address, args.ranks, args.batch_size, args.seed, q, ready, go))
                for _ in range(k)]
        for j in jobs:
            j.start()
        for _ in jobs:
            if not ready.acquire(timeout=120):
                raise RuntimeError("a job did not connect in 120 s")
        go.set()
        results = [q.get(timeout=args.timeout) for _ in jobs]
        for j in jobs:
            j.join(30)
        m = _metrics(server.metrics_port)
        fuse_reads = fs.stats()["requests"] if fs is not None else None
        rss = peak_rss_mb(server.pid)
    finally:
        server.stop()
    delivered = sum(n for n, _ in results)
    rates = sorted(n / s for n, s in results)
    storage = m.get("croupier_storage_reads_total", 0.0)
    return {
        "k": k, "shared": shared, "ranks_per_job": args.ranks, "delivered": delivered,
        "storage_reads": storage, "storage_reads_per_sample": storage / max(delivered, 1),
        "fuse_requests": fuse_reads,
        "fuse_requests_per_sample": None if fuse_reads is None else fuse_reads / max(delivered, 1),
        "job_samples_per_s": rates, "server_peak_rss_mb": rss,
        "shared_metrics": {key: v for key, v in m.items() if key.startswith("croupier_shared_")},
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| storage | K | sharing | reads/sample (store) | FUSE requests/sample | job samples/s (min..max) "
             "| vs alone | detaches | server peak RSS MB |", "|---|---|---|---|---|---|---|---|---|"]
    alone = {(r["condition"], r["shared"]): min(r["job_samples_per_s"]) for r in rows if r["k"] == 1}
    for r in rows:
        base = alone.get((r["condition"], r["shared"])) or alone.get((r["condition"], True))
        lo, hi = min(r["job_samples_per_s"]), max(r["job_samples_per_s"])
        fuse = "-" if r["fuse_requests_per_sample"] is None else f"{r['fuse_requests_per_sample']:.3f}"
        lines.append(f"| {r['condition']} | {r['k']} | {'on' if r['shared'] else 'off'} | "
                     f"{r['storage_reads_per_sample']:.3f} | {fuse} | {lo:,.0f}..{hi:,.0f} | "
                     f"{lo / base:.2f}x | {r['shared_metrics'].get('croupier_shared_detaches_total', 0):.0f} | "
                     f"{r['server_peak_rss_mb']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m croupier.bench.shared", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small run (4,000 rows, K = 1, 2, 4) to check it works")
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--row-bytes", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--ranks", type=int, default=1, help="ranks (streams) per job (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ks", default="1,2,4,8")
    p.add_argument("--conditions", default="fuse,pagecache")
    p.add_argument("--latency-ms", type=float, default=5.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--compare-off", action="store_true", help="also run every K with --no-shared-epochs")
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "croupier-bench-shared"))
    p.add_argument("--out", default="bench/results/shared")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--note", default="", help="a line for the report (e.g. 'busy machine')")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.ks = min(args.rows, 4000), "1,2,4"
    ks = [int(k) for k in args.ks.split(",")]
    log = Path(tempfile.gettempdir()) / "croupier-bench-shared-server.log"  # not a result: kept out of --out
    command = "python -m croupier.bench.shared " + " ".join(argv if argv is not None else sys.argv[1:])

    def measure(rep: dict[str, Any]) -> None:
        rep.update(rows=args.rows, row_bytes=args.row_bytes, batch_size=args.batch_size, ranks=args.ranks,
                   latency_ms=args.latency_ms, note=args.note, cpus=os.cpu_count())
        path = write_dataset(Path(args.data_dir), args.rows, args.row_bytes)
        rep["results"] = [r for cond in args.conditions.split(",") for r in sweep(cond, path, ks, args, log)]

    rep = drive("shared", Path(args.out), command.strip(), measure, markdown)
    print(table(rep["results"]))
    return 0


def sweep(cond: str, path: Path, ks: list[int], args: argparse.Namespace, log: Path) -> list[dict[str, Any]]:
    """Every K on one storage condition ("fuse": the latency FS, its pages evicted before each K;
    "pagecache": the plain files, read into the page cache first), sharing on (and off too with
    --compare-off); nothing where the latency FS is unusable here (said on stderr)."""
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        fs = None
        serve_path = path
        if cond == "fuse":
            problem = latencyfs.check_available()
            if problem:
                print(f"skipping fuse: {problem} (bench/native/install-deps.sh)", file=sys.stderr)
                return rows
            fs = stack.enter_context(latencyfs.mounted(path.parent, median_ms=args.latency_ms))
            serve_path = Path(fs.path) / path.name
        elif cond == "pagecache":
            load_into_page_cache([str(path)])
        else:
            raise SystemExit(f"unknown condition {cond!r}: fuse or pagecache")
        for shared in (True, False) if args.compare_off else (True,):
            for k in ks:
                r = run_k(serve_path, k, args, log, shared, fs)
                r["condition"] = cond if cond != "fuse" else f"fuse {args.latency_ms:g} ms"
                rows.append(r)
                print(json.dumps(r), flush=True)
    return rows


def markdown(rep: dict[str, Any], plots: list[str]) -> str:
    head = ["# Shared epochs: K identical jobs, one server", "", *header_lines(rep),
            f"{rep['rows']:,} rows of {rep['row_bytes']:,} bytes (Arrow IPC), batch {rep['batch_size']}, "
            f"{rep['ranks']} rank(s) per job, {rep['cpus']} CPUs shared by the server, the jobs and the "
            f"storage; fuse: latencyfs, lognormal median {rep['latency_ms']:g} ms sigma 0.5, pages evicted "
            "before each K; pagecache: the plain files, read into the page cache first. Goal: reads per "
            "delivered sample 1/K while the jobs keep pace.", ""]
    if rep["note"]:
        head += [rep["note"], ""]
    return "\n".join(head) + "\n" + table(rep["results"]) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
