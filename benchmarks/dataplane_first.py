"""The data plane's first benchmark: croupier unordered vs ordered vs DataLoader.

Same files (a Hugging Face save_to_disk text dataset), same injected storage latency
(lognormal, median 5 ms, sigma 0.5, applied per sample read to every system), batch 64,
2 trainer ranks, all in one run; then the same with the data in the page cache and no
injected latency. Each rank is its own process; throughput is counted at the trainer
from its first batch to its last, summed over ranks.

    python benchmarks/dataplane_first.py --out benchmarks/results/dataplane_first

The ceiling with C reads in flight and mean read latency L is C/L samples/s.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BATCH = 64
WORLD = 2


def make_dataset(path: Path, rows: int) -> None:
    import datasets

    rng = np.random.default_rng(0)
    words = np.array("the of and to in is was for on as with by at from his her an that which".split())
    texts = [" ".join(rng.choice(words, 40)) for _ in range(rows)]
    ds = datasets.Dataset.from_dict(
        {"text": texts, "label": (np.arange(rows) % 10).tolist(),
         "tokens": [rng.integers(0, 50000, 64, dtype=np.int32).tolist() for _ in range(rows)]}
    )
    ds.save_to_disk(str(path), max_shard_size="32MB")


# ---- baseline: DataLoader + DistributedSampler over the same files -------------------
class ArrowRows:
    """A map-style Dataset on the same Arrow files, read with pyarrow (no `datasets` overhead)."""

    def __init__(self, path: str, latency_ms: float, seed: int):
        self.path, self.latency_ms, self.seed = path, latency_ms, seed
        self.table = None
        self.sampler = None

    def _open(self) -> None:
        from croupier.server.readers import open_dataset
        from croupier.server.readers.latency import LatencySampler

        self.table = open_dataset(self.path).table
        worker = __import__("torch").utils.data.get_worker_info()
        wid = worker.id if worker else 0
        self.sampler = LatencySampler("lognormal", self.latency_ms, 0.5, self.seed * 1000 + wid)

    def __len__(self) -> int:
        if self.table is None:
            self._open()
        return self.table.num_rows

    def __getitem__(self, i: int) -> dict:
        if self.sampler is None:
            self._open()
        if self.latency_ms:
            time.sleep(self.sampler())
        row = self.table.slice(i, 1).to_pylist()[0]
        row["tokens"] = np.asarray(row["tokens"], dtype=np.int32)
        return row


def run_dataloader(rank: int, path: str, latency_ms: float, workers: int, max_batches: int, q) -> None:
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    ds = ArrowRows(path, latency_ms, seed=rank)
    sampler = DistributedSampler(ds, num_replicas=WORLD, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=workers,
                        persistent_workers=False, prefetch_factor=2 if workers else None)
    _consume(loader, rank, max_batches, q, lambda b: len(b["label"]), lambda b: b["tokens"].numel() * 4)


def run_croupier(rank: int, address: str, ordered: bool, max_batches: int, q) -> None:
    from croupier.client import Loader

    loader = Loader("text", servers=address, batch_size=BATCH, rank=rank, world_size=WORLD, ordered=ordered,
                    prefetch=2)
    _consume(loader, rank, max_batches, q, lambda b: len(b["label"]), lambda b: b["tokens"].numel() * 4)


def _consume(loader, rank, max_batches, q, count, nbytes) -> None:
    t0 = time.perf_counter()
    first = None
    n = nb = batches = 0
    lat = []
    last = t0
    for batch in loader:
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            n += count(batch)
            nb += nbytes(batch)
            lat.append(now - last)
        last = now
        batches += 1
        if batches >= max_batches:
            break
    end = time.perf_counter()
    q.put({"rank": rank, "samples": n, "bytes": nb, "seconds": end - first, "first_batch_s": first - t0,
           "batch_p50_ms": 1000 * float(np.percentile(lat, 50)), "batch_p99_ms": 1000 * float(np.percentile(lat, 99)),
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


def run_ranks(target, args_for_rank) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_for_rank(r), q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    samples = sum(r["samples"] for r in results)
    seconds = max(r["seconds"] for r in results)
    return {
        "samples_per_s": samples / seconds,
        "mb_per_s": sum(r["bytes"] for r in results) / seconds / 1e6,
        "first_batch_s": max(r["first_batch_s"] for r in results),
        "batch_p50_ms": max(r["batch_p50_ms"] for r in results),
        "batch_p99_ms": max(r["batch_p99_ms"] for r in results),
        "trainer_peak_rss_mb": max(r["peak_rss_mb"] for r in results),
        "samples": samples,
    }


def start_server(path: Path, latency_ms: float, tmp: Path) -> tuple[subprocess.Popen, str]:
    ready = tmp / f"ready-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "croupier.cli", "serve", f"text={path}", "--port", "0", "--ready-file", str(ready),
           "--log-level", "WARNING"]
    if latency_ms:
        cmd += ["--latency-ms", str(latency_ms), "--latency-distribution", "lognormal", "--latency-sigma", "0.5"]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{json.loads(ready.read_text())['port']}"


def server_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=60_000)
    ap.add_argument("--latency-ms", type=float, default=5.0)
    ap.add_argument("--croupier-batches", type=int, default=150, help="batches per rank for croupier unordered")
    ap.add_argument("--slow-batches", type=int, default=12, help="batches per rank for the one-at-a-time systems")
    ap.add_argument("--out", default="benchmarks/results/dataplane_first")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="croupier-bench-"))
    data = tmp / "text"
    print(f"writing {args.rows} rows to {data}", flush=True)
    make_dataset(data, args.rows)
    mean_l = args.latency_ms / 1000 * math.exp(0.5**2 / 2)
    rows = []
    for latency in (args.latency_ms, 0.0):
        srv, address = start_server(data, latency, tmp)
        try:
            systems = [
                ("croupier unordered (prefetch 2)", "croupier", False, args.croupier_batches),
                ("croupier ordered", "croupier", True, args.slow_batches if latency else args.croupier_batches),
                ("DataLoader + DistributedSampler, 2 workers", "dataloader", 2,
                 args.slow_batches * 2 if latency else args.croupier_batches),
            ]
            for label, kind, opt, batches in systems:
                print(f"[latency {latency} ms] {label} ...", flush=True)
                cpu0 = server_cpu_s(srv.pid)
                if kind == "croupier":
                    r = run_ranks(run_croupier, lambda rank: (rank, address, opt, batches))
                    r["server_cpu_s_per_1k"] = (server_cpu_s(srv.pid) - cpu0) / (r["samples"] + WORLD * BATCH) * 1000
                    in_flight = WORLD * (1 if opt else 3 * BATCH)
                else:
                    r = run_ranks(run_dataloader, lambda rank: (rank, str(data), latency, opt, batches))
                    r["server_cpu_s_per_1k"] = None
                    in_flight = WORLD * opt  # one read per worker at a time
                r.update(system=label, latency_ms=latency, reads_in_flight=in_flight)
                if latency:
                    r["ceiling_samples_per_s"] = in_flight / mean_l
                    r["fraction_of_ceiling"] = r["samples_per_s"] / r["ceiling_samples_per_s"]
                rows.append(r)
                print(f"    {r['samples_per_s']:.0f} samples/s", flush=True)
        finally:
            srv.terminate()
            srv.wait(30)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": f"{platform.machine()}, "
            f"{os.cpu_count()} cores, Python {platform.python_version()}", "rows": args.rows, "batch": BATCH,
            "ranks": WORLD, "latency": f"lognormal median {args.latency_ms} ms sigma 0.5 (mean {mean_l * 1000:.2f} ms)"}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    lines = [f"# Data plane, first benchmark\n", f"Command: `{meta['command']}`  ", f"Machine: {meta['machine']}  ",
             f"Data: {args.rows}-row HF save_to_disk text dataset (text, label, 64 int32 tokens); batch {BATCH}; "
             f"{WORLD} ranks; injected latency {meta['latency']}\n",
             "| latency | system | samples/s | MB/s | first batch s | batch p50 ms | batch p99 ms | reads in flight | "
             "ceiling C/L | of ceiling | server CPU s / 1k samples | trainer peak RSS MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ceiling = f"{r['ceiling_samples_per_s']:.0f}" if r.get("ceiling_samples_per_s") else "-"
        frac = f"{100 * r['fraction_of_ceiling']:.0f}%" if r.get("fraction_of_ceiling") else "-"
        cpu = f"{r['server_cpu_s_per_1k']:.3f}" if r["server_cpu_s_per_1k"] is not None else "-"
        lines.append(f"| {r['latency_ms']:g} ms | {r['system']} | {r['samples_per_s']:.0f} | {r['mb_per_s']:.2f} | "
                     f"{r['first_batch_s']:.2f} | {r['batch_p50_ms']:.1f} | {r['batch_p99_ms']:.1f} | "
                     f"{r['reads_in_flight']} | {ceiling} | {frac} | {cpu} | {r['trainer_peak_rss_mb']:.0f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
