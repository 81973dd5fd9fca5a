"""One benchmark case: a system, a dataset, a storage condition; its ranks run side by side.

For croupier the case starts a fresh `croupier serve` (so its peak RSS and CPU are the
case's own, and a cold-disk case maps no page a previous case loaded), then one
trainer process per rank; baselines only need the trainer processes.
"""

from __future__ import annotations

import json
import os
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .procstat import cpu_seconds, drop_from_page_cache, load_into_page_cache, peak_rss_mb
from .trainer import RankJob

SIGMA = 0.5


@dataclass(frozen=True)
class Storage:
    name: str
    latency_ms: float = 0.0
    cold: bool = False
    #: Inject even a 0 ms latency: croupier then takes its unordered path with no wait,
    #: which measures that path's CPU ceiling.
    inject: bool = False

    @property
    def mean_latency_s(self) -> float:
        """Mean of the lognormal read latency (median * exp(sigma^2 / 2))."""
        return self.latency_ms / 1000 * math.exp(SIGMA**2 / 2)


PAGE_CACHE = Storage("page cache")
COLD_DISK = Storage("cold disk", cold=True)
NO_WAIT = Storage("0 ms injected (no wait)", inject=True)


def latency(ms: float) -> Storage:
    return Storage(f"{ms:g} ms lognormal", latency_ms=ms)


@dataclass(frozen=True)
class System:
    label: str
    kind: str  # RankJob.system
    workers: int = 0
    ordered: bool = False
    prefetch: int = 0
    #: The shuffle it gives, as the table names it.
    shuffle: str = "global (full permutation)"

    def reads_in_flight(self, batch: int, max_reads_per_stream: int | None = None) -> int:
        """Sample reads one rank keeps in flight: C in the ceiling C/L."""
        if self.kind == "croupier":
            if self.ordered:
                return 1
            from croupier.server.stream.fetch_limits import FetchLimits

            limits = FetchLimits()  # the server's defaults, which the benchmark does not change
            window = ((self.prefetch or limits.default_prefetch) + 1) * batch
            return min(max_reads_per_stream or limits.max_reads_per_stream, window)
        return max(1, self.workers)  # every worker reads one sample at a time

    def warmup_batches(self) -> int:
        """Batches that may arrive in a burst after the first, having been read while it was
        awaited; the steady rate is measured after them."""
        if self.kind == "croupier":
            if self.ordered:
                return 2
            from croupier.server.stream.fetch_limits import FetchLimits

            return (self.prefetch or FetchLimits().default_prefetch) + 1 + 4  # server window + Loader buffer
        return max(2, 2 * self.workers)  # DataLoader's prefetch_factor 2 per worker


CROUPIER = System("croupier unordered", "croupier")
CROUPIER_ORDERED = System("croupier ordered", "croupier", ordered=True)


def dataloader(workers: int) -> System:
    return System(f"DataLoader + DistributedSampler, {workers} workers", "dataloader", workers=workers)


HF_SHUFFLE = System("HF datasets .shuffle() + DataLoader, 2 workers", "hf", workers=2,
                    shuffle="global (indices mapping)")
WEBDATASET = System("WebDataset, 2 workers", "webdataset", workers=2,
                    shuffle="shard shuffle + buffer of 1000")


@dataclass(frozen=True)
class Case:
    dataset: str  # "text", "imagefolder", "shards"
    storage: Storage
    system: System
    batch: int = 64
    world: int = 2
    max_batches: int = 200
    max_seconds: float = 4.0
    #: Steady batches wanted after the warm-up ones, time permitting: at least this many and
    #: `steady_per_warmup` times the warm-up, so that batches read ahead during a slow start
    #: (8 DataLoader workers starting on 2 cores) cannot pass for a steady rate.
    steady_batches: int = 4
    steady_per_warmup: int = 3
    seed: int = 0
    #: `croupier serve --max-reads-per-stream` (the reads-in-flight curve); None keeps the default.
    max_reads_per_stream: int | None = None


@dataclass
class CaseResult:
    case: Case
    samples_per_s: float
    mb_per_s: float
    first_batch_s: float
    batch_p50_ms: float
    batch_p99_ms: float
    samples: int
    batches: int
    cpu_s_per_1k: float
    server_cpu_s_per_1k: float | None
    server_peak_rss_mb: float | None
    trainer_peak_rss_mb: float
    workers_private_rss_mb: float
    reads_in_flight: int
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["case"] = asdict(self.case)
        return d


class ServerProcess:
    """`croupier serve` on 127.0.0.1, a free port, in a subprocess."""

    def __init__(self, datasets: list[str], args: list[str], log: Path,
                 launcher: tuple[str, ...] = ("-m", "croupier.cli")):
        self.ready = Path(tempfile.mkstemp(prefix="croupier-bench-ready-", suffix=".json")[1])
        self.ready.unlink()
        cmd = [sys.executable, *launcher, "serve", *datasets, "--host", "127.0.0.1", "--port", "0",
               "--ready-file", str(self.ready), "--log-level",
               os.environ.get("CROUPIER_BENCH_SERVER_LOG_LEVEL", "WARNING"), *args]
        self._log = open(log, "a")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"croupier serve did not start; see {log}")
            time.sleep(0.05)
        info = json.loads(self.ready.read_text())
        self.address = f"127.0.0.1:{info['port']}"
        self.metrics_port = info.get("metrics_port")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        self.ready.unlink(missing_ok=True)


def server_flags(storage: Storage) -> list[str]:
    if not storage.latency_ms and not storage.inject:
        return []
    return ["--latency-ms", f"{storage.latency_ms:g}", "--latency-distribution", "lognormal",
            "--latency-sigma", f"{SIGMA:g}"]


def run_ranks(jobs: list[RankJob], timeout: float) -> tuple[list[dict[str, Any]], list[str]]:
    """Start every rank at once; each prints one JSON line. Returns the results and warnings
    (a rank that reported and then died on exit: its figures stand, the crash is reported)."""
    procs = [subprocess.Popen([sys.executable, "-m", "croupier.bench.trainer", j.to_json()],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for j in jobs]
    out, warnings = [], []
    for rank, p in enumerate(procs):
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"a trainer rank ran past {timeout:.0f}s")
        lines = stdout.strip().splitlines()
        if not lines or not lines[-1].startswith("{"):
            raise RuntimeError(f"trainer rank {rank} failed ({p.returncode}):\n{stderr[-3000:]}")
        if p.returncode != 0:
            warnings.append(f"rank {rank} exited with {p.returncode} after reporting: {stderr.strip()[-300:]}")
        out.append(json.loads(lines[-1]))
    return out, warnings


def steady_skip(arrivals: list[float], warmup: int) -> int:
    """Batches left out of the steady rate: the warm-up burst, or 10% if more (at least one,
    and never so many that fewer than two arrivals remain)."""
    return max(1, min(max(warmup, len(arrivals) // 10), len(arrivals) - 2))


def aggregate(case: Case, ranks: list[dict[str, Any]], reads_in_flight: int) -> CaseResult:
    """Steady throughput: each rank's samples after its warm-up batches over the time they took, summed."""
    rate = mb = 0.0
    intervals: list[float] = []
    for r in ranks:
        t = r["arrivals_s"]
        if len(t) > 1:
            skip = steady_skip(t, case.system.warmup_batches())
            per_batch = np.asarray(r["batch_samples"], dtype=float)
            span = t[-1] - t[skip - 1]
            steady = per_batch[skip:].sum()
            rate += steady / span
            mb += r["bytes"] * steady / per_batch.sum() / span / 1e6
            intervals += np.diff(t).tolist()
    samples = sum(r["samples"] for r in ranks)
    pct = (lambda q: 1000 * float(np.percentile(intervals, q))) if intervals else (lambda q: float("nan"))
    return CaseResult(
        case=case,
        samples_per_s=rate,
        mb_per_s=mb,
        first_batch_s=max(r["arrivals_s"][0] if r["arrivals_s"] else float("nan") for r in ranks),
        batch_p50_ms=pct(50),
        batch_p99_ms=pct(99),
        samples=samples,
        batches=sum(len(r["arrivals_s"]) for r in ranks),
        cpu_s_per_1k=1000 * sum(r["cpu_s"] for r in ranks) / max(samples, 1),
        server_cpu_s_per_1k=None,
        server_peak_rss_mb=None,
        trainer_peak_rss_mb=max(r["peak_rss_mb"] for r in ranks),
        workers_private_rss_mb=sum(r["workers_private_rss_mb"] for r in ranks),
        reads_in_flight=reads_in_flight * case.world,
    )


def run_case(case: Case, paths: dict[str, Path], log: Path) -> CaseResult:
    path = paths[case.dataset]
    if case.storage.cold:
        drop_from_page_cache([path])
    else:
        load_into_page_cache([path])
    sysm = case.system
    job = RankJob(system=sysm.kind, dataset=case.dataset, path=str(path), rank=0, world=case.world,
                  batch=case.batch, max_batches=case.max_batches, max_seconds=case.max_seconds,
                  min_batches=sysm.warmup_batches() * (1 + case.steady_per_warmup) + case.steady_batches,
                  workers=sysm.workers, ordered=sysm.ordered, prefetch=sysm.prefetch,
                  latency_ms=case.storage.latency_ms, latency_sigma=SIGMA, seed=case.seed)
    timeout = job.hard_seconds + 120
    in_flight = sysm.reads_in_flight(case.batch, case.max_reads_per_stream)
    if sysm.kind != "croupier":
        ranks, warnings = run_ranks([replace(job, rank=r) for r in range(case.world)], timeout)
        result = aggregate(case, ranks, in_flight)
        result.extra["warnings"] = warnings
        return result
    flags = server_flags(case.storage)
    if case.max_reads_per_stream:
        flags += ["--max-reads-per-stream", str(case.max_reads_per_stream)]
    server = ServerProcess([f"{case.dataset}={path}"], flags, log)
    try:
        job = replace(job, path=case.dataset, address=server.address)
        cpu0 = cpu_seconds(server.pid)
        ranks, warnings = run_ranks([replace(job, rank=r) for r in range(case.world)], timeout)
        server_cpu = cpu_seconds(server.pid) - cpu0
        server_rss = peak_rss_mb(server.pid)
    finally:
        server.stop()
    result = aggregate(case, ranks, in_flight)
    result.server_cpu_s_per_1k = 1000 * server_cpu / max(result.samples, 1)
    result.cpu_s_per_1k += result.server_cpu_s_per_1k
    result.server_peak_rss_mb = server_rss
    result.extra["warnings"] = warnings
    return result
