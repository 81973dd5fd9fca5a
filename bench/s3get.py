"""What one S3 range GET costs croupier's server in CPU: through obstore, or on the loop (s3http).

    python -m croupier.bench.s3get --out bench/results/s3get.md

The loopback S3 server (bench/s3server.py, its own process) serves one 8 MB object
with a fixed per-request latency (20 ms); an `ObjectStore` reads random ranges of SIZE
bytes, IN_FLIGHT at a time, from a uvloop loop, with the direct GET client on
(`fast_get=true`: the server's default where credentials are static keys) and off (every
GET through obstore). Each way runs in its own process for each in-flight level, alternated
over rounds, after warm-up GETs that open the connections. Reported: GETs/s, the reading
process's CPU per GET split into the event-loop thread and obstore's Tokio threads (the
scheduler's per-thread counts), and the S3 server's CPU per GET; medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from . import procstat
from .inflight import keep_in_flight
from .reporting import close_header, header_lines, run_header

OBJECT_BYTES = 8 << 20
BUCKET = "bench"
KEY = "blob.bin"


async def _drive(store, reads: int, in_flight: int, size: int, seed: int, callback_path: bool) -> float:
    """`reads` random GETs, `in_flight` at a time; seconds taken."""
    rng = random.Random(seed)
    span = OBJECT_BYTES - size
    loop = asyncio.get_running_loop()

    def start(landed) -> None:
        ranges = [(rng.randrange(span), size)]
        if not (callback_path and store.submit_ranges(KEY, ranges, lambda _parts, err: landed(err))):
            task = loop.create_task(store.read(KEY, *ranges[0]))
            task.add_done_callback(lambda t: landed(t.exception()))

    return await keep_in_flight(start, reads, in_flight)


def child(a: argparse.Namespace) -> int:
    import uvloop

    from croupier.server.storage.objectstore import ObjectStore

    store = ObjectStore(BUCKET, options={"endpoint": a.endpoint, "access_key_id": "bench", "secret_access_key": "bench",
                                         "region": "us-east-1", "fast_get": a.mode == "direct"})
    box: dict = {}

    async def both() -> None:
        await _drive(store, a.in_flight, a.in_flight, a.size, 99, a.mode == "direct")  # connections opened
        box["before"], box["c0"] = procstat.thread_cpu(), procstat.cpu_seconds()
        box["seconds"] = await _drive(store, a.reads, a.in_flight, a.size, a.seed, a.mode == "direct")
        box["after"], box["c1"] = procstat.thread_cpu(), procstat.cpu_seconds()

    uvloop.run(both())
    me = os.getpid()
    loop_s = box["after"][me][3] - box["before"][me][3]
    groups = procstat.thread_cpu_delta(box["before"], box["after"])
    tokio = sum(g["cpu"] for name, g in groups.items() if name.startswith("tokio"))
    cpu = max(box["c1"] - box["c0"], sum(g["cpu"] for g in groups.values()))  # ticks can round a short run to 0
    print(json.dumps({"reads": a.reads, "seconds": box["seconds"], "cpu_s": cpu, "loop_s": loop_s,
                      "tokio_s": tokio, "direct_gets": store.fast.done if store.fast else 0}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m croupier.bench.s3get", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="write the Markdown report here (and .json beside it)")
    p.add_argument("--reads", type=int, default=10_000)
    p.add_argument("--in-flight", type=int, action="append", help="GETs in flight (repeatable; default 256 and 1024)")
    p.add_argument("--size", type=int, default=1100, help="bytes per GET (about one text row)")
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="direct", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    levels = a.in_flight or [256, 1024]
    if a.child:
        a.in_flight = levels[0]
        return child(a)

    t0 = time.perf_counter()
    header = run_header(" ".join(["python -m croupier.bench.s3get", *(sys.argv[1:] if argv is None else argv)]))
    results = measure(a, levels)
    close_header(header, t0)
    md = report(results, a, levels, header)
    print(md)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(md)
        a.out.with_suffix(".json").write_text(json.dumps({**header, "results": results, "reads": a.reads,
                                                          "size": a.size, "latency_ms": a.latency_ms}, indent=1))
    return 0


def measure(a: argparse.Namespace, levels: list[int]) -> dict[str, list[dict]]:
    """Each way of reading at each in-flight level, in a child process each, `a.rounds` rounds
    alternated, against one loopback S3 server: the children's figures by "mode | level"."""
    from .s3server import Latency, running

    results: dict[str, list[dict]] = {}
    with running(None, latency=Latency.fixed(a.latency_ms), process=True) as s3:
        s3.create_bucket(BUCKET)
        s3.put(BUCKET, KEY, random.Random(0).randbytes(OBJECT_BYTES))
        server_pid = s3.proc.pid  # type: ignore[attr-defined]
        for rnd in range(a.rounds):
            for q in levels:
                for mode in ("obstore", "direct"):
                    s0 = procstat.cpu_seconds(server_pid)
                    cmd = [sys.executable, "-m", "croupier.bench.s3get", "--child", "--mode", mode, "--endpoint",
                           s3.endpoint, "--reads", str(a.reads), "--in-flight", str(q), "--size", str(a.size),
                           "--seed", str(rnd)]
                    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                    if r.returncode != 0:
                        raise RuntimeError(f"{mode} q={q}: {r.stderr.strip()[-600:]}")
                    out = json.loads(r.stdout.strip().splitlines()[-1])
                    # the server also served the warm-up GETs: counted per GET over both
                    out["server_s"] = procstat.cpu_seconds(server_pid) - s0
                    out["server_gets"] = a.reads + q
                    results.setdefault(f"{mode} | {q}", []).append(out)
                    print(f"round {rnd + 1}/{a.rounds} {mode} {q} in flight: {a.reads / out['seconds']:,.0f} GETs/s, "
                          f"{1e6 * out['cpu_s'] / a.reads:.0f} us CPU/GET", flush=True)
    return results


def report(results: dict[str, list[dict]], a: argparse.Namespace, levels: list[int], header: dict) -> str:
    """The Markdown: `header` (reporting.run_header, closed), then medians per way and level."""
    lines = [
        "# S3 GETs: CPU per GET through obstore and on the loop (s3http)", "",
        *header_lines(header),
        f"{a.reads:,} random GETs of {a.size:,} bytes of one 8 MB object on the loopback S3 server (own process, "
        f"fixed {a.latency_ms:g} ms per request), through `ObjectStore`; {a.rounds} rounds, alternated; medians.", "",
        "| GETs | in flight | GETs/s | reader CPU us/GET | event loop | obstore's Tokio threads | S3 server CPU us/GET |",
        "|---|---|---|---|---|---|---|",
    ]
    for q in levels:
        for mode in ("obstore", "direct"):
            rs = results.get(f"{mode} | {q}", [])
            if not rs:
                continue
            med = lambda key: statistics.median(1e6 * r[key] / r["reads"] for r in rs)  # noqa: E731
            server = statistics.median(1e6 * r["server_s"] / r["server_gets"] for r in rs)
            label = "through obstore" if mode == "obstore" else "on the loop (s3http)"
            lines.append(f"| {label} | {q} | {statistics.median(r['reads'] / r['seconds'] for r in rs):,.0f} | "
                         f"{med('cpu_s'):.0f} | {med('loop_s'):.0f} | {med('tokio_s'):.0f} | {server:.0f} |")
    lines += ["", "The direct GETs are `ObjectStore.submit_ranges` (the server's path for table rows); obstore's "
              "are `ObjectStore.read` awaited in a task each (its path for them). C/L is "
              f"in flight / {a.latency_ms:g} ms: {', '.join(f'{q / a.latency_ms * 1000:,.0f} GETs/s at {q}' for q in levels)}; "
              "the S3 server shares the machine's 2 cores.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
