"""Prometheus metrics of one server process, on their own registry.

Exposed on `/metrics` by `serve(metrics_port=...)`. Per-read figures (reads in flight,
read latency) are kept as plain numbers and turned into metric families only when
scraped: a prometheus_client call per read would cost more than the read's own
scheduling. Per-stream and per-chunk counters use prometheus_client directly.
"""

from __future__ import annotations

import threading

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

READ_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ReadStats:
    """Reads in flight, failures and a latency histogram, fed cheaply from the event loop."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.failures = 0
        self._pending: list[float] = []
        self._lock = threading.Lock()  # folding races only with a scrape, never per read
        self._counts = np.zeros(len(READ_BUCKETS) + 1, dtype=np.int64)
        self._sum = 0.0

    # FetchObserver
    def read_started(self, count: int = 1) -> None:
        self.in_flight += count

    def read_finished(self, seconds: float, ok: bool, count: int = 1) -> None:
        self.in_flight -= count
        if not ok:
            self.failures += count
        if count == 1:
            self._pending.append(seconds)
        else:
            self._pending.extend([seconds] * count)  # a group's reads landed together: one latency each
        if len(self._pending) >= 1 << 16:
            self._fold()

    def reads_abandoned(self, count: int) -> None:
        self.in_flight -= count

    def _fold(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            if pending:
                lat = np.asarray(pending)
                self._counts += np.bincount(np.searchsorted(READ_BUCKETS, lat, side="left"),
                                            minlength=len(self._counts))
                self._sum += float(lat.sum())

    def histogram(self) -> tuple[list[tuple[str, float]], float]:
        self._fold()
        with self._lock:
            cumulative = np.cumsum(self._counts)
            buckets = [(str(b), float(c)) for b, c in zip(READ_BUCKETS, cumulative)]
            buckets.append(("+Inf", float(cumulative[-1])))
            return buckets, self._sum

    def collect(self):
        yield GaugeMetricFamily("croupier_reads_in_flight", "Sample reads in flight now", value=self.in_flight)
        errors = CounterMetricFamily("croupier_read_errors", "Sample reads that failed")
        errors.add_metric([], self.failures)
        yield errors
        buckets, total = self.histogram()
        h = HistogramMetricFamily("croupier_read_latency_seconds", "Latency of one sample read")
        h.add_metric([], buckets, total)
        yield h


class StorageStats:
    """The stores' own counters (every range read and pread, metadata included), by
    scheme: what the storage really served, for read amplification and IOPS."""

    def __init__(self) -> None:
        self.stores: list = []  # croupier.server.storage.Store

    def add(self, store) -> None:
        # A dataset's ConfinedStore shares its stats with the server's store: count once.
        if all(s is not store and s.stats is not store.stats for s in self.stores):
            self.stores.append(store)

    def collect(self):
        reads = CounterMetricFamily("croupier_storage_reads", "Range reads issued to storage", labels=["scheme"])
        nbytes = CounterMetricFamily("croupier_storage_read_bytes", "Bytes returned by storage", labels=["scheme"])
        errors = CounterMetricFamily("croupier_storage_read_errors", "Storage reads that failed", labels=["scheme"])
        now = GaugeMetricFamily("croupier_storage_reads_in_flight", "Storage reads in flight now", labels=["scheme"])
        peak = GaugeMetricFamily("croupier_storage_reads_in_flight_max", "Most storage reads in flight at once",
                                 labels=["scheme"])
        totals: dict[str, dict[str, int]] = {}
        for store in self.stores:
            snap = store.stats.snapshot()
            t = totals.setdefault(store.scheme, dict.fromkeys(snap, 0))
            for k, v in snap.items():
                t[k] = max(t[k], v) if k == "max_in_flight" else t[k] + v
        for scheme, t in totals.items():
            reads.add_metric([scheme], t["reads"])
            nbytes.add_metric([scheme], t["bytes"])
            errors.add_metric([scheme], t["errors"])
            now.add_metric([scheme], t["in_flight"])
            peak.add_metric([scheme], t["max_in_flight"])
        yield from (reads, nbytes, errors, now, peak)
        yield from self._read_paths()

    def _read_paths(self):
        """Each mount's read path (LocalStore measures it, storage/readpath.py) and the
        concurrency each path measured (R * L0)."""
        path = GaugeMetricFamily("croupier_storage_read_path", "The read path a mount uses (1)",
                                 labels=["mount", "fs_type", "path"])
        ceiling = GaugeMetricFamily("croupier_storage_concurrency_ceiling",
                                    "Reads a mount completed at once in the probe (Little's law: rate x latency)",
                                    labels=["mount", "path"])
        reads = CounterMetricFamily("croupier_storage_path_reads", "Reads issued by each read path", labels=["path"])
        inline = CounterMetricFamily("croupier_storage_inline_reads",
                                     "Reads done on the loop from the page cache (RWF_NOWAIT): "
                                     "ranges of open files, small files whole")
        limit = GaugeMetricFamily("croupier_storage_read_limit",
                                  "Reads a daemon-bound mount may have in flight at once (storage/gate.py)",
                                  labels=["mount"])
        waiting = GaugeMetricFamily("croupier_storage_reads_waiting",
                                    "Reads waiting in croupier for a daemon-bound mount's gate now", labels=["mount"])
        inline_count = 0
        for store in self.stores:
            for choice in getattr(store, "read_paths", lambda: [])():
                path.add_metric([choice.mount.point, choice.mount.fs_type, choice.path], 1)
                for name, value in choice.ceilings.items():
                    ceiling.add_metric([choice.mount.point, name], value)
            for name, count in getattr(store, "path_reads", {}).items():
                reads.add_metric([name], count)
            inline_count += getattr(store, "inline_reads", 0)
            for point, gate in getattr(store, "gates", dict)().items():
                limit.add_metric([point], gate.limit)
                waiting.add_metric([point], gate.waiting)
        inline.add_metric([], inline_count)
        yield from (path, ceiling, reads, inline, limit, waiting)


class CacheCollector:
    """The server cache's counters (server/cache): lookups served from it and from storage,
    each tier's fills, residents and evictions, and storage bytes per delivered sample."""

    def __init__(self, cache, metrics: "ServerMetrics") -> None:
        self.cache, self.metrics = cache, metrics

    def _samples(self) -> float:
        return sum(s.value for m in self.metrics.samples.collect() for s in m.samples if s.name.endswith("_total"))

    def collect(self):
        c, st = self.cache, self.cache.stats
        lookups = CounterMetricFamily("croupier_cache_lookups", "Range reads of cached files, by where they were served",
                                      labels=["result"])
        lookups.add_metric(["hit"], st.hits)
        lookups.add_metric(["miss"], st.misses)
        yield lookups
        yield GaugeMetricFamily("croupier_cache_hit_ratio", "Share of range reads served from the cache", value=st.hit_ratio)
        storage_bytes = sum(s.stats.bytes for s in self.metrics.storage.stores)
        samples = self._samples()
        yield GaugeMetricFamily("croupier_cache_storage_bytes_per_sample", "Bytes read from storage per sample delivered",
                                value=storage_bytes / samples if samples else 0.0)
        filled = CounterMetricFamily("croupier_cache_fill_bytes", "Bytes admitted to each cache tier", labels=["tier"])
        resident = GaugeMetricFamily("croupier_cache_resident_bytes", "Bytes each cache tier holds", labels=["tier"])
        evicted = CounterMetricFamily("croupier_cache_evictions", "Blocks each cache tier dropped", labels=["tier"])
        tiers = [("memory", c.memory.filled, c.memory.resident, c.memory.evictions)]
        if c.disk is not None:
            tiers.append(("disk", c.disk.filled, c.disk.used, c.disk.evictions))
        for tier, f, r, e in tiers:
            filled.add_metric([tier], f)
            resident.add_metric([tier], r)
            evicted.add_metric([tier], e)
        yield from (filled, resident, evicted)
        corrupt = CounterMetricFamily("croupier_cache_corrupt_blocks", "Disk-tier blocks that failed their checksum")
        corrupt.add_metric([], c.disk.corrupt if c.disk is not None else 0)
        yield corrupt


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reads = ReadStats()
        r.register(self.reads)
        self.storage = StorageStats()
        r.register(self.storage)
        self.samples = Counter("croupier_samples_served", "Samples sent to clients", ["dataset"], registry=r)
        self.bytes = Counter("croupier_bytes_served", "Payload bytes sent to clients", ["dataset"], registry=r)
        self.chunks = Counter("croupier_chunks_served", "Chunks (messages) sent", ["dataset"], registry=r)
        self.batches = Counter("croupier_batches_completed", "Batches fully sent", ["dataset"], registry=r)
        self.streams_total = Counter(
            "croupier_streams", "StreamEpoch calls by outcome (gRPC status name)", ["code"], registry=r
        )
        self.active_streams = Gauge("croupier_active_streams", "Streams open now", registry=r)
        self.limit_refusals = Counter(
            "croupier_limit_refusals", "Calls refused or streams ended by a fair limit", ["limit"], registry=r
        )
