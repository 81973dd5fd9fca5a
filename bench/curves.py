"""The curves: throughput against reads in flight and against concurrent streams, and the
planner's time and memory against dataset size."""

from __future__ import annotations

import math
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from croupier.server.stream.fetch_limits import FetchLimits

from .cases import CROUPIER, Case, ServerProcess, latency, run_case, server_flags
from .procstat import cpu_seconds, load_into_page_cache
from .suites import Curves


def reads_in_flight(curves: Curves, paths: dict[str, Path], log: Path, say: Callable[[str], None]) -> list[dict]:
    """croupier unordered, one rank, text: the server's per-stream read limit C swept."""
    storage = latency(curves.in_flight_latency_ms)
    points = []
    for c in curves.in_flight:
        # A read-ahead horizon of 4C samples (as the defaults' 16 batches over 256 reads): with
        # a horizon of just C, a batch waiting on its slowest read starves the bound.
        prefetch = min(FetchLimits().max_prefetch, max(1, math.ceil(4 * c / 64)))
        system = replace(CROUPIER, label=f"croupier unordered, C={c}", prefetch=prefetch)
        case = Case("text", storage, system, world=1, max_batches=300, max_seconds=3.0, max_reads_per_stream=c)
        r = run_case(case, paths, log)
        ceiling = c / storage.mean_latency_s
        points.append({"reads_in_flight": c, "samples_per_s": r.samples_per_s, "ceiling_c_over_l": ceiling,
                       "fraction": r.samples_per_s / ceiling, "server_cpu_s_per_1k": r.server_cpu_s_per_1k})
        say(f"  C={c}: {r.samples_per_s:,.0f} samples/s (C/L {ceiling:,.0f})")
    return points


STREAM_BATCHES = 20


def concurrent_streams(curves: Curves, paths: dict[str, Path], rows: int, log: Path,
                       say: Callable[[str], None]) -> list[dict]:
    """N trainer streams (the load test, one channel each) against one server at a fixed latency.

    Each stream is rank i of N for up to STREAM_BATCHES batches of 64: fewer where the
    `rows`-row text set deals a rank fewer (the server refuses an end past the epoch).
    """
    from croupier.loadtest import LoadOptions, run_load

    storage = latency(curves.streams_latency_ms)
    load_into_page_cache([paths["text"]])
    server = ServerProcess([f"text={paths['text']}"], server_flags(storage), log)
    points = []
    try:
        for n in curves.streams:
            end_batch = min(STREAM_BATCHES, math.ceil(math.ceil(rows / n) / 64))
            data = ('{"dataset": "text", "batch_size": 64, "world_size": %d, "rank": {{.WorkerID}}, '
                    '"epoch": {{.RequestNumber}}, "end_batch": %d}' % (n, end_batch))
            cpu0 = cpu_seconds(server.pid)
            report = run_load(LoadOptions(target=server.address, data=data, concurrency=n, connections=n,
                                          total=None, duration_s=curves.streams_seconds, timeout_s=60))
            cpu = cpu_seconds(server.pid) - cpu0
            pct = report["batch_latency"].get("percentiles", {})
            points.append({
                "streams": n, "samples_per_s": report["samples_per_s"], "mb_per_s": report["mb_per_s"],
                "streams_per_s": report["streams_per_s"], "calls": report["calls"],
                "errors": report["calls"] - report["ok"], "batch_p50_ms": 1000 * pct.get("p50", math.nan),
                "batch_p99_ms": 1000 * pct.get("p99", math.nan),
                "server_cpu_s_per_1k": 1000 * cpu / max(report["samples"], 1),
            })
            say(f"  {n} streams: {report['samples_per_s']:,.0f} samples/s, batch p99 "
                f"{points[-1]['batch_p99_ms']:.0f} ms, errors {points[-1]['errors']}")
    finally:
        server.stop()
    return points


def _measure(fn: Callable[[], Any]) -> tuple[float, int]:
    """Seconds of fn(), then the peak bytes a second call allocates (numpy reports its
    buffers to tracemalloc; tracing slows calls, hence the separate timed run)."""
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    tracemalloc.start()
    try:
        fn()
        return seconds, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def planner_scaling(curves: Curves, say: Callable[[str], None], batch: int = 64, world: int = 8,
                    indices: int = 1_000_000) -> list[dict]:
    """EpochPlan: time to the first batch, indices/s over a million indices, peak memory; vs numpy."""
    from croupier.protocol.epoch_plan import EpochPlan

    points = []
    for n in curves.planner_sizes:
        first_s, _ = _measure(lambda: EpochPlan(n, 0, 0, batch, world).rank_batch(world - 1, 0))
        count = min(n, indices) // batch

        def deal() -> None:
            for _ in EpochPlan(n, 0, 0, batch, 1, drop_last=True).rank_batches(0, 0, count):
                pass

        deal_s, deal_bytes = _measure(deal)
        point = {"rows": n, "first_batch_ms": 1000 * first_s, "indices_per_s": count * batch / deal_s,
                 "plan_peak_mb": deal_bytes / 1e6, "numpy_permutation_s": None, "numpy_peak_mb": None}
        if n <= curves.numpy_limit:
            np_s, np_bytes = _measure(lambda: np.random.default_rng(0).permutation(n))
            point.update(numpy_permutation_s=np_s, numpy_peak_mb=np_bytes / 1e6)
        points.append(point)
        say(f"  {n:.0e} rows: first batch {point['first_batch_ms']:.2f} ms, {point['indices_per_s']:,.0f} indices/s, "
            f"peak {point['plan_peak_mb']:.2f} MB" + (f"; numpy permutation {point['numpy_permutation_s']:.3f} s, "
                                                     f"{point['numpy_peak_mb']:.0f} MB" if point["numpy_peak_mb"] else ""))
    return points
