"""Scale-out on loopback: replicas 1, 2, 4 x client streams 8, 16, 64, and 1,000 streams from
`croupier loadtest` against 2 and 4 replicas; per replica its CPU, RSS, streams and samples/s.

    python -m croupier.bench.scale_out --out bench/results
    python -m croupier.bench.scale_out --out bench/results --row-bytes 65536 --rows 16000 \
        --many-rows 64000 --name scale_out-64k

Each replica is a `croupier serve` process on 127.0.0.K sharing one port (the pods behind a
headless Service); the client is `croupier loadtest` (run_load) in this process, its target
dns:///NAME:PORT resolved to the replicas, so stream w goes to replica w % N as the
Loader's rank w would. Every cell is one epoch of a synthetic table (rows made in memory:
no storage cost, so the figures are the serving CPU alone) dealt to `streams` ranks, each
stream one rank's whole epoch. Per replica: CPU seconds (/proc), peak RSS (VmHWM), the
streams and samples its /metrics counted. The machine's own busy CPU over each cell
(/proc/stat) says how much other processes took.

The capacity model in deploy/README.md is fitted to this report's CPU per sample.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .driver import Report, attempt, drive
from .procstat import cpu_seconds, peak_rss_mb
from .promscrape import scrape
from .reporting import header_lines, num

NAME = "croupier.bench.svc"
REPLICAS = (1, 2, 4)
STREAMS = (8, 16, 64)
MANY = 1000
MANY_REPLICAS = (2, 4)

@dataclass(frozen=True)
class Sizes:
    """The synthetic tables: rows of the 8-64 stream cells, of the 1,000-stream cells, bytes a row."""

    rows: int = 64_000
    many_rows: int = 256_000
    row_bytes: int = 4096
BATCH = 32
#: Streams one connection carries at most: under the server's --max-streams-per-connection (128).
PER_CONNECTION = 100


def machine_busy_s() -> float:
    """CPU seconds all processes on the machine have used (not idle, not iowait) since boot."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _start_replicas(n: int, sizes: Sizes, workdir: Path) -> list:
    """n replicas on 127.0.0.1..n, one port; one loadtest process is one client to them, so the
    per-client stream limit (256 by default) is raised for the 1,000-stream cells."""
    from croupier.demo.procs import ServerProcess

    args = ["--metrics-port", "0", "--grace", "0", "--max-streams-per-client", str(2 * MANY)]
    data = [f"rows=synthetic:{sizes.rows}:{sizes.row_bytes}", f"many=synthetic:{sizes.many_rows}:{sizes.row_bytes}"]
    first = ServerProcess(data, workdir, args, name=f"r{n}-1").start()
    return [first] + [ServerProcess(data, workdir, args, port=first.port, name=f"r{n}-{k}", host=f"127.0.0.{k}").start()
                      for k in range(2, n + 1)]


def _counters(replica) -> tuple[int, int]:
    samples = scrape(replica.metrics_port)
    streams = sum(v for n, lab, v in samples if n == "croupier_streams_total" and lab == 'code="OK"')
    served = sum(v for n, lab, v in samples if n == "croupier_samples_served_total")
    return int(streams), int(served)


def _load(replicas: list, dataset: str, streams: int, end_batch: int = 0) -> dict[str, Any]:
    """`croupier loadtest dns:///NAME:PORT` with one stream per rank of a world of `streams`."""
    from croupier.loadtest import LoadOptions, run_load

    addresses = [f"127.0.0.{k}:{replicas[0].port}" for k in range(1, len(replicas) + 1)]
    data = ('{"dataset": "%s", "batch_size": %d, "world_size": %d, "rank": {{.WorkerID}}, "seed": 1, "end_batch": %d}'
            % (dataset, BATCH, streams, end_batch))
    connections = max(1, math.ceil(streams / len(replicas) / PER_CONNECTION))
    opts = LoadOptions(target=f"dns:///{NAME}:{replicas[0].port}", data=data, concurrency=streams,
                       connections=connections, total=streams, timeout_s=600)
    return run_load(opts, resolve=lambda host, port: addresses)


def run_cell(replicas: list, streams: int, dataset: str, rows: int, row_bytes: int) -> dict[str, Any]:
    """One epoch of `rows` dealt to `streams` ranks over the replicas; per replica what it did."""
    connections = max(1, math.ceil(streams / len(replicas) / PER_CONNECTION))
    before = [(_counters(r), cpu_seconds(r.proc.pid)) for r in replicas]
    client0, busy0, t0 = cpu_seconds(), machine_busy_s(), time.perf_counter()
    report = _load(replicas, dataset, streams)
    wall = time.perf_counter() - t0
    client_s, busy_s = cpu_seconds() - client0, machine_busy_s() - busy0
    time.sleep(0.3)  # a stream's outcome is counted as its handler exits, just after the client saw its end
    per = []
    for r, ((st0, sa0), c0) in zip(replicas, before):
        st, sa = _counters(r)
        cpu = cpu_seconds(r.proc.pid) - c0
        per.append({"address": f"127.0.0.{replicas.index(r) + 1}:{r.port}", "streams": st - st0, "samples": sa - sa0,
                    "cpu_s": cpu, "cores": cpu / wall, "samples_per_s": (sa - sa0) / wall,
                    "peak_rss_mb": peak_rss_mb(r.proc.pid)})
    server_cpu = sum(p["cpu_s"] for p in per)
    samples = sum(p["samples"] for p in per)
    return {"replicas": len(replicas), "streams": streams, "dataset": dataset, "rows": rows,
            "connections_per_replica": connections,
            "wall_s": wall, "ok": report["ok"], "calls": report["calls"], "samples": samples,
            "samples_per_s": samples / wall, "mb_per_s": samples * row_bytes / wall / 1e6,
            "server_cpu_us_per_sample": 1e6 * server_cpu / max(samples, 1),
            "client_cpu_us_per_sample": 1e6 * client_s / max(samples, 1),
            "client_cores": client_s / wall, "machine_busy_cores": busy_s / wall,
            "others_cores": max(0.0, (busy_s - client_s - server_cpu) / wall),
            "spread": _spread(per), "per_replica": per,
            "first_sample_p50_ms": 1e3 * report["time_to_first_sample"].get("percentiles", {}).get("p50", math.nan)}


def _spread(per: list[dict[str, Any]]) -> dict[str, float]:
    """Largest distance of a replica's streams and samples from the mean, as a fraction of it."""
    out = {}
    for key in ("streams", "samples"):
        values = [p[key] for p in per]
        mean = sum(values) / len(values)
        out[key] = max(abs(v - mean) for v in values) / mean if mean else math.nan
    return out


def measure(rep: Report, sizes: Sizes, say=print) -> None:
    rep["settings"] = {**asdict(sizes), "batch_size": BATCH,
                       "streams": list(STREAMS), "replicas": list(REPLICAS), "many": MANY,
                       "many_replicas": list(MANY_REPLICAS)}
    rep["cells"] = []
    with tempfile.TemporaryDirectory(prefix="croupier-scale-") as tmp:
        for n in REPLICAS:
            replicas = attempt(rep, f"{n} replicas: start", lambda: _start_replicas(n, sizes, Path(tmp)), say)
            if replicas is None:
                continue
            try:
                _load(replicas, "rows", 4 * n, end_batch=2)  # warm-up, not counted: imports, first plans
                for streams in STREAMS + ((MANY,) if n in MANY_REPLICAS else ()):
                    say(f"  {n} replicas, {streams} streams")
                    dataset, rows = ("many", sizes.many_rows) if streams == MANY else ("rows", sizes.rows)
                    cell = attempt(rep, f"{n} replicas x {streams} streams",
                                   lambda: run_cell(replicas, streams, dataset, rows, sizes.row_bytes), say)
                    if cell is not None:
                        rep["cells"].append(cell)
                        say(f"    {cell['samples_per_s']:,.0f} samples/s, server {cell['server_cpu_us_per_sample']:.1f}"
                            f" us/sample, spread {cell['spread']}")
            finally:
                for r in replicas:
                    r.stop()
    rep["fit"] = fit(rep["cells"])


def fit(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The model's constants: server CPU seconds = a x samples + b x streams, least squares over
    the cells (a: per sample sent, b: per stream opened, its plan and its end), and the median
    and range of the plain CPU per sample."""
    import numpy as np

    cells = [c for c in cells if c["samples"]]
    if not cells:
        return {}
    x = np.array([[c["samples"], c["streams"]] for c in cells], dtype=float)
    y = np.array([c["server_cpu_us_per_sample"] * c["samples"] / 1e6 for c in cells])
    (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
    worst = float(np.max(np.abs(x @ np.array([a, b]) - y) / y))
    values = sorted(c["server_cpu_us_per_sample"] for c in cells)
    return {"us_per_sample": float(a) * 1e6, "ms_per_stream": float(b) * 1e3, "worst_relative_error": worst,
            "median_us_per_sample": values[len(values) // 2], "min": values[0], "max": values[-1],
            "peak_rss_mb_max": max(p["peak_rss_mb"] for c in cells for p in c["per_replica"])}


def markdown(rep: Report, plots: list[str]) -> str:
    s = rep["settings"]
    lines = ["# Scale-out on loopback: replicas x client streams", "", *header_lines(rep),
             f"Each cell: one epoch of `synthetic:{s['rows']}:{s['row_bytes']}` (rows made in memory: no storage "
             f"cost) dealt to *streams* ranks, batch {s['batch_size']}, one `croupier loadtest` stream per rank "
             "(this process, the client), over *replicas* `croupier serve` processes on 127.0.0.K behind one "
             "dns:/// name. Everything shares the machine's cores: client, replicas and other processes "
             "(*others*: the machine's busy CPU less ours).", "",
             "| replicas | streams | samples/s | MB/s | server CPU us/sample | client CPU us/sample | client cores "
             "| others' cores | spread streams / samples | first sample p50 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in rep["cells"]:
        lines.append(f"| {c['replicas']} | {c['streams']:,} | {num(c['samples_per_s'])} | {num(c['mb_per_s'], '.0f')} "
                     f"| {num(c['server_cpu_us_per_sample'], '.1f')} | {num(c['client_cpu_us_per_sample'], '.1f')} "
                     f"| {num(c['client_cores'], '.2f')} | {num(c['others_cores'], '.2f')} "
                     f"| {c['spread']['streams']:.1%} / {c['spread']['samples']:.1%} "
                     f"| {num(c['first_sample_p50_ms'], '.0f')} ms |")
    lines += ["", "## Per replica", "",
              "| replicas | streams | replica | streams served | samples | samples/s | CPU cores | peak RSS MB |",
              "|---|---|---|---|---|---|---|---|"]
    for c in rep["cells"]:
        for p in c["per_replica"]:
            lines.append(f"| {c['replicas']} | {c['streams']:,} | {p['address']} | {p['streams']} | {p['samples']:,} "
                         f"| {num(p['samples_per_s'])} | {num(p['cores'], '.2f')} | {num(p['peak_rss_mb'], '.0f')} |")
    f = rep.get("fit") or {}
    if f:
        lines += ["", "## Fit", "",
                  f"Server CPU seconds = a x samples + b x streams, least squares over the cells: a = "
                  f"{f['us_per_sample']:.1f} us per sample of {s['row_bytes']:,} bytes, b = {f['ms_per_stream']:.2f} ms "
                  f"per stream (worst cell off the fit by {f['worst_relative_error']:.0%}). CPU per sample alone: "
                  f"median {f['median_us_per_sample']:.1f} us, {f['min']:.1f}-{f['max']:.1f} us over the cells. "
                  f"Peak RSS of a replica at most {f['peak_rss_mb_max']:.0f} MB. deploy/README.md's capacity model "
                  "uses these figures."]
    if rep.get("errors"):
        lines += ["", "## Errors", "", *[f"- {e}" for e in rep["errors"]]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--rows", type=int, default=Sizes.rows, help="rows of an epoch in the 8-64 stream cells")
    ap.add_argument("--many-rows", type=int, default=Sizes.many_rows, help=f"rows of an epoch in the {MANY:,}-stream cells")
    ap.add_argument("--row-bytes", type=int, default=Sizes.row_bytes, help="bytes of a row (default 4096)")
    ap.add_argument("--name", default="scale_out", help="the report's file names (default scale_out)")
    a = ap.parse_args(argv)
    command = "python -m croupier.bench.scale_out " + " ".join(argv if argv is not None else sys.argv[1:])
    sizes = Sizes(a.rows, a.many_rows, a.row_bytes)
    drive(a.name, a.out, command.strip(), lambda rep: measure(rep, sizes), markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
