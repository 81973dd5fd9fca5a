"""One abusive client against a real server: thousands of streams opened and never read,
while another client reads a whole epoch. Counted: streams admitted and refused (by
which limit), the other client's samples, and the server's CPU while only the stalled
streams are left (utime + stime ticks from /proc/PID/stat over a fixed window).

The abuser's channels turn off HTTP/2 window growth (BDP probing), so a stream it does
not read really stalls at 64 KiB; a default client's transport keeps accepting megabytes
per stream, which the server cannot tell from reading (see README, Limits).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from croupier.demo.procs import ServerProcess, free_port
from croupier.server.access.limits import LIMIT_METADATA_KEY
from croupier.v1 import croupier_pb2 as pb
from croupier.v1 import croupier_pb2_grpc as pb_grpc

from .procstat import cpu_seconds, rss_mb


def stalled_streams(workdir: Path, *, attempts: int = 2000, connections: int = 4, rows: int = 4000,
                    extra_args: tuple[str, ...] = (), window_s: float = 3.0,
                    log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """`attempts` streams from one client (127.0.0.1) over `connections` connections, never
    read past the header; another client (::1) reads an epoch of `rows` meanwhile."""
    from croupier.client import Loader, RetryPolicy

    workdir.mkdir(parents=True, exist_ok=True)
    server = ServerProcess([f"rows=synthetic:{rows}:4096"], workdir, ["--prefetch", "1", *extra_args],
                           port=free_port(), name="abuse-server", host="localhost").start()
    pid = server.proc.pid  # type: ignore[union-attr]
    result: dict[str, Any] = {"attempts": attempts, "connections": connections, "flags": list(extra_args)}
    loop = asyncio.new_event_loop()
    try:
        async def abuse():
            options = [("grpc.use_local_subchannel_pool", 1), ("grpc.http2.bdp_probe", 0)]
            chans = [grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=options) for _ in range(connections)]
            calls, outcome = [], Counter()
            for k in range(attempts):
                stub = pb_grpc.CroupierStub(chans[k % connections])
                call = stub.StreamEpoch(pb.StreamEpochRequest(dataset="rows", batch_size=4, seed=k))
                calls.append(call)
                try:
                    await call.read()
                    outcome["admitted"] += 1
                except grpc.aio.AioRpcError as exc:
                    limit = dict(exc.trailing_metadata() or ()).get(LIMIT_METADATA_KEY)
                    outcome[f"refused: {limit}" if limit else f"failed: {exc.code().name}"] += 1
            return chans, calls, outcome

        chans, calls, outcome = loop.run_until_complete(abuse())
        result["outcome"] = dict(outcome)
        log(f"  {attempts:,} stream attempts: {dict(outcome)}")
        loader = Loader("rows", servers=f"[::1]:{server.port}", batch_size=25, seed=7,
                        retry=RetryPolicy(initial_backoff_s=0.05))
        got = [i for b in loader.batches() for i in b.indices[~b.padding].tolist()]
        loader.close()
        result["other_client"] = {"expected": rows, "delivered": len(got), "distinct": len(set(got)),
                                  "complete": sorted(got) == list(range(rows))}
        log(f"  the other client's epoch: {len(got):,} of {rows:,} samples, {len(set(got)):,} distinct")
        deadline = time.monotonic() + 60
        while True:  # let the stalled streams fill their windows, then measure a fixed window
            t0 = cpu_seconds(pid)
            time.sleep(1.0)
            if cpu_seconds(pid) - t0 <= 0.05 or time.monotonic() > deadline:
                break
        t0 = cpu_seconds(pid)
        time.sleep(window_s)
        result["stalled_cpu_percent"] = 100.0 * (cpu_seconds(pid) - t0) / window_s
        result["server_rss_mb"] = rss_mb(pid)
        log(f"  server CPU with only the stalled streams open: {result['stalled_cpu_percent']:.1f}% over "
            f"{window_s:.0f} s; RSS {result['server_rss_mb']:.0f} MB")
        for call in calls:
            call.cancel()
        for ch in chans:
            loop.run_until_complete(ch.close())
    finally:
        loop.close()
        server.stop()
    return result
