"""Sweeps that start apart: do they still read storage once? (issue 23, item 3)

    python -m croupier.bench.sweeps [--rows 200000] [--row-bytes 1000] [--jobs 4] [--apart 2]
        [--evict-every 0.5] [--out bench/results/sweeps.md]

A sweep of `jobs` identical jobs (same dataset, seed and epoch; 2 ranks each, batch 64; each
job one process whose two ranks are threads) on one `croupier serve`, over latencyfs at 5 ms
lognormal with the kernel's defaults (max_background 12), which counts every read request
that reaches it. Job i starts `i * apart` seconds after the first (0, 2, 4, 6 s). Each cache
setting (on: the defaults; off: `--cache-memory 0`, what shared epochs alone give) runs one job
alone, then the sweep, each on a fresh server with the page cache dropped:

- storage reads of the sweep / of one job alone (target <= 1.25), in requests and bytes;
- each job's samples/s against the job alone (target: within 10%, i.e. >= 0.9x);
- the server's cache and shared-epoch counters at the end.

The server holds the file open, so the kernel's page cache would keep all of it and share it
between jobs by itself; the benchmark drops the mount's page cache every `evict-every` seconds
(latencyfs.evict), in every run alike: it stands for a mount whose pages are not kept, or data
beyond the page cache, as with the images the issue measured (every open drops their pages).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from . import latencyfs
from .cache_tier import at_most, cache_flags, serve, stop, table_folder
from .driver import attempt, drive
from .reporting import header_lines, num, target

MEDIAN_MS, SIGMA = 5.0, 0.5
RANKS = 2
METRICS = ("croupier_cache_lookups_total", "croupier_cache_resident_bytes", "croupier_shared_joins_total",
           "croupier_storage_reads_total", "croupier_samples_served_total")


def job(port: int, result: Path) -> None:
    """One job of the sweep: RANKS ranks as threads, epoch 0, seed 0; writes its times and counts."""
    from croupier.client import Loader

    ranks: list[dict[str, Any]] = [{} for _ in range(RANKS)]

    def rank(r: int) -> None:
        t = time.time()
        loader = Loader("t", servers=f"127.0.0.1:{port}", rank=r, world_size=RANKS, batch_size=64, seed=0,
                        format="numpy")
        loader.set_epoch(0)
        n = sum(len(batch["id"]) for batch in loader)
        ranks[r] = {"start": t, "end": time.time(), "samples": n}

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(RANKS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    result.write_text(json.dumps(ranks))


class Evictor:
    """Drops the mount's page cache every `every` seconds on a thread, while in a `with` block."""

    def __init__(self, fs: latencyfs.LatencyFS, every: float):
        self.fs, self.every, self.done = fs, every, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.wait(self.every):
            self.fs.evict()

    def __enter__(self) -> Evictor:
        if self.every > 0:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        if self.thread.is_alive():
            self.thread.join()


def scrape(metrics_port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
            if ln.startswith(METRICS) and not ln.startswith("#")}


def run_jobs(fs: latencyfs.LatencyFS, flags: list[str], starts: list[float], args: argparse.Namespace,
             tmp: Path) -> dict[str, Any]:
    """One fresh server; jobs launched at `starts` (seconds after the first); storage counted."""
    fs.evict()
    proc, ready = serve([f"t={fs.path / 't.arrow'}"], [*flags, "--metrics-port", "0"], tmp)
    try:
        before = fs.stats()
        t0, jobs = time.time(), []
        with Evictor(fs, args.evict_every):
            for i, at in enumerate(starts):
                time.sleep(max(0.0, t0 + at - time.time()))
                out = tmp / f"job-{time.monotonic_ns()}.json"
                jobs.append((out, subprocess.Popen([sys.executable, "-m", "croupier.bench.sweeps", "--job",
                                                    "--port", str(ready["port"]), "--result", str(out)])))
            for out, p in jobs:
                if p.wait(args.timeout) != 0:
                    raise RuntimeError(f"a job exited {p.returncode}")
        after = fs.stats()
        metrics = scrape(ready["metrics_port"])
    finally:
        stop(proc)
    per_job = []
    for i, (out, _) in enumerate(jobs):
        ranks = json.loads(out.read_text())
        start, end = min(r["start"] for r in ranks), max(r["end"] for r in ranks)
        n = sum(r["samples"] for r in ranks)
        per_job.append({"job": i, "started_s": start - t0, "seconds": end - start, "samples": n,
                        "samples_per_s": n / (end - start)})
    return {"jobs": per_job, "storage_reads": after["requests"] - before["requests"],
            "storage_bytes": after["bytes"] - before["bytes"], "metrics": metrics}


def run_setting(fs: latencyfs.LatencyFS, setting: str, data_bytes: int, args: argparse.Namespace,
                tmp: Path) -> dict[str, Any]:
    flags = cache_flags(setting, data_bytes)
    alone = run_jobs(fs, flags, [0.0], args, tmp)
    print(f"cache {setting}, alone: {alone['jobs'][0]['seconds']:.1f} s, {alone['storage_reads']:,} reads", flush=True)
    sweep = run_jobs(fs, flags, [i * args.apart for i in range(args.jobs)], args, tmp)
    res = {"setting": setting, "alone": alone, "sweep": sweep,
           "reads_ratio": sweep["storage_reads"] / max(1, alone["storage_reads"]),
           "bytes_ratio": sweep["storage_bytes"] / max(1, alone["storage_bytes"]),
           "speed_vs_alone": [j["samples_per_s"] / alone["jobs"][0]["samples_per_s"] for j in sweep["jobs"]]}
    print(f"cache {setting}, sweep: reads x{res['reads_ratio']:.2f}, speeds "
          + ", ".join(f"{s:.2f}" for s in res["speed_vs_alone"]), flush=True)
    return res


def targets(rep: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for s in rep["settings"]:
        out.append(at_most(f"cache {s['setting']}: storage reads of {rep['jobs_n']} jobs / 1 job <= 1.25",
                           s["reads_ratio"], 1.25,
                           f"{s['sweep']['storage_reads']:,} / {s['alone']['storage_reads']:,} requests "
                           f"= {s['reads_ratio']:.2f} (bytes: {s['bytes_ratio']:.2f})"))
        slowest = min(s["speed_vs_alone"])
        out.append(target(f"cache {s['setting']}: every job's samples/s >= 0.9x the job alone", slowest, 0.9,
                          "jobs at " + ", ".join(f"{x:.2f}x" for x in s["speed_vs_alone"])))
    return out


HITS, MISSES = 'croupier_cache_lookups_total{result="hit"}', 'croupier_cache_lookups_total{result="miss"}'
RESIDENT = 'croupier_cache_resident_bytes{tier="memory"}'
JOINS = "croupier_shared_joins_total{"


def together(jobs: list[dict[str, Any]]) -> float:
    """All jobs' samples over the span from the first one's start to the last one's end."""
    span = max(j["started_s"] + j["seconds"] for j in jobs) - min(j["started_s"] for j in jobs)
    return sum(j["samples"] for j in jobs) / span


def counters(m: dict[str, float]) -> str:
    """The server's cache and shared-epoch counters, in words."""
    outcomes = {k[len(JOINS):].split("=")[1].strip('"}'): v for k, v in m.items() if k.startswith(JOINS)}
    joins = ", ".join(f"{k} {v:g}" for k, v in outcomes.items())
    cache = (f"cache hits {num(m[HITS])}, misses {num(m.get(MISSES))}, resident {num(m.get(RESIDENT))} B"
             if HITS in m else "no cache")
    return f"{cache}; shared-epoch joins: {joins or 'none'}"


def markdown(rep: dict[str, Any], plots: list[str]) -> str:
    apart = ", ".join(f"{i * rep['apart']:g}" for i in range(rep["jobs_n"]))
    lines = [f"# Sweeps that start apart: {rep['jobs_n']} identical jobs started {apart} s apart, one server",
             "", *header_lines(rep),
             f"{rep['rows']:,} rows of {rep['row_bytes']} B ({rep['data_bytes'] / 1e6:.0f} MB Arrow IPC), "
             f"latencyfs 5 ms lognormal, kernel defaults (max_background 12); 2 ranks per job, batch 64, "
             f"epoch 0, seed 0; the mount's page cache dropped every {rep['evict_every']} s in every run "
             "(a mount whose pages are not kept). Storage reads: the FUSE daemon's read requests, "
             "fills included.", ""]
    for s in rep["settings"]:
        a = s["alone"]["jobs"][0]
        lines += [f"## Cache {s['setting']}", "",
                  f"Alone: {a['seconds']:.1f} s epoch, {num(a['samples_per_s'])} samples/s, "
                  f"{s['alone']['storage_reads']:,} storage reads ({s['alone']['storage_bytes'] / 1e6:.0f} MB). "
                  f"Sweep: {s['sweep']['storage_reads']:,} reads ({s['sweep']['storage_bytes'] / 1e6:.0f} MB): "
                  f"**{s['reads_ratio']:.2f}x** one job (bytes {s['bytes_ratio']:.2f}x).", "",
                  "| job | started at s | epoch s | samples/s | vs alone |", "|---|---|---|---|---|"]
        lines += [f"| {j['job']} | {j['started_s']:.1f} | {j['seconds']:.1f} | {num(j['samples_per_s'])} | "
                  f"{v:.2f}x |" for j, v in zip(s["sweep"]["jobs"], s["speed_vs_alone"])]
        lines += ["", f"All jobs together: {num(together(s['sweep']['jobs']))} samples/s from the first start to the "
                  f"last end ({together(s['sweep']['jobs']) / a['samples_per_s']:.2f}x one job alone). "
                  f"Server counters at the sweep's end: {counters(s['sweep']['metrics'])}.", ""]
    lines += ["## Targets", ""] + [f"- {'met' if t['met'] else 'NOT met'}: {t['target']}: {t['detail']}"
                                   for t in rep["targets"]]
    lines += ["", f"On this machine ({rep['machine']['cores']} cores, shared with other sessions) jobs that overlap "
              "share the CPU: the server encodes every job's chunks apart and the jobs' ranks decode on the same "
              "cores, so with the cache, where one job alone already takes the cores, each of 4 overlapping jobs "
              "gets about a quarter; without it they share the mount's few background requests too (4 times the "
              "reads through the same 12). All jobs together against one job alone says how much of the machine "
              "one job already took. The load average counts threads waiting on the FUSE mount (the server's "
              "read pool), so it rises during the runs without the cache. A late job's ranks count as `late` "
              "(its start batch had left the shared epoch's window) or `started` in the shared-epoch joins."]
    if rep["errors"]:
        lines += ["", "## Errors", "", *[f"- {e}" for e in rep["errors"]]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m croupier.bench.sweeps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200000)
    p.add_argument("--row-bytes", type=int, default=1000)
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--apart", type=float, default=2.0, help="seconds between the jobs' starts")
    p.add_argument("--evict-every", type=float, default=0.5, help="seconds between page-cache drops (0: never)")
    p.add_argument("--settings", nargs="+", default=["on", "off"], choices=["on", "off"])
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a job may take")
    p.add_argument("--out", type=Path, default=Path("bench/results/sweeps.md"),
                   help="the Markdown report (its JSON beside it, named alike)")
    p.add_argument("--render", type=Path, help="rewrite --out from a JSON this script saved, without measuring")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job:
        job(args.port, args.result)
        return 0
    if args.render:
        args.out.write_text(markdown(json.loads(args.render.read_text()), []))
        return 0
    reason = latencyfs.check_available()
    if reason:
        print(f"latencyfs unusable here: {reason}")
        return 1
    command = " ".join(["python -m croupier.bench.sweeps", *(sys.argv[1:] if argv is None else argv)])

    def measure(rep: dict[str, Any]) -> None:
        with tempfile.TemporaryDirectory(prefix="sweeps-") as d:
            tmp = Path(d)
            src, data_bytes = table_folder(tmp, args.rows, args.row_bytes)
            rep.update(rows=args.rows, row_bytes=args.row_bytes, data_bytes=data_bytes, jobs_n=args.jobs,
                       apart=args.apart, evict_every=args.evict_every, settings=[])
            with latencyfs.mounted(src, median_ms=MEDIAN_MS, sigma=SIGMA,
                                   max_background=latencyfs.KERNEL_DEFAULT) as fs:
                for setting in args.settings:
                    got = attempt(rep, f"cache {setting}", lambda s=setting: run_setting(fs, s, data_bytes, args, tmp),
                                  print)
                    if got is not None:
                        rep["settings"].append(got)
        rep["targets"] = targets(rep)

    drive(args.out.stem, args.out.parent, command, measure, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
