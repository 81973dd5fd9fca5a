"""Prometheus metrics of one server process, on their own registry.

Exposed on `/metrics` by `serve(metrics_port=...)`. The scheduler reports reads through
the `FetchObserver` hooks; the service counts samples, bytes and streams.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_READ_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.samples = Counter("croupier_samples_served", "Samples sent to clients", ["dataset"], registry=r)
        self.bytes = Counter("croupier_bytes_served", "Payload bytes sent to clients", ["dataset"], registry=r)
        self.chunks = Counter("croupier_chunks_served", "Chunks (messages) sent", ["dataset"], registry=r)
        self.batches = Counter("croupier_batches_completed", "Batches fully sent", ["dataset"], registry=r)
        self.streams_total = Counter(
            "croupier_streams", "StreamEpoch calls by outcome (gRPC status name)", ["code"], registry=r
        )
        self.active_streams = Gauge("croupier_active_streams", "Streams open now", registry=r)
        self.reads_in_flight = Gauge("croupier_reads_in_flight", "Sample reads in flight now", registry=r)
        self.read_errors = Counter("croupier_read_errors", "Sample reads that failed", registry=r)
        self.read_latency = Histogram(
            "croupier_read_latency_seconds", "Latency of one sample read", buckets=_READ_BUCKETS, registry=r
        )

    # FetchObserver
    def read_started(self) -> None:
        self.reads_in_flight.inc()

    def read_finished(self, seconds: float, ok: bool) -> None:
        self.reads_in_flight.dec()
        self.read_latency.observe(seconds)
        if not ok:
            self.read_errors.inc()

    def serve_http(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the /metrics endpoint in a thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
