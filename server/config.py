"""Server configuration: one dataclass, filled from a YAML file and then from flags."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .scheduler import FetchLimits


@dataclass(frozen=True)
class LatencySpec:
    """Injected storage latency applied to every read (benchmarks, tests)."""

    median_ms: float
    distribution: str = "lognormal"
    sigma: float = 0.5
    seed: int = 0
    #: Global index -> fixed delay in seconds, for reads that must be slow (tests).
    overrides: dict[int, float] | None = None


@dataclass(frozen=True)
class ServerConfig:
    #: Datasets to open at start: "PATH", "NAME=PATH", or "NAME=synthetic:ROWS[:ROW_BYTES]".
    datasets: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 50051
    #: Clients may also stream paths under these folders; dataset paths must lie in them.
    data_roots: tuple[str, ...] = ()
    #: Where indexes go when the data folder is read-only (tar offset indexes).
    cache_dir: str | None = None
    #: Port of the Prometheus /metrics endpoint; -1 turns it off, 0 picks a free port.
    metrics_port: int = -1
    metrics_host: str = "127.0.0.1"
    #: Sample reads in flight over all streams.
    max_reads: int = 4096
    #: Threads for CPU work (encoding chunks, Pillow, opening datasets); never wait on reads.
    workers: int = 4
    #: Threads that wait on file-system reads (one pread each): at most this many file
    #: reads are in flight, whatever --max-reads says. Started on demand.
    io_threads: int = 1024
    #: Object-store settings (s3://...) over the environment's AWS_* variables:
    #: endpoint, region, access_key_id, secret_access_key, session_token, ...
    storage_options: dict[str, str] = field(default_factory=dict)
    limits: FetchLimits = field(default_factory=FetchLimits)
    latency: LatencySpec | None = None
    #: Seconds SIGTERM waits for open streams to finish before cancelling them.
    grace_s: float = 30.0
    max_message_bytes: int = 64 << 20
    # Fair limits (README "Limits"); 0 turns a count or a timeout off.
    #: Streams open at once over the whole server, per client identity, per connection.
    max_streams: int = 1024
    max_streams_per_client: int = 256
    max_streams_per_connection: int = 128
    #: A stream whose client read nothing for this long while data was ready is ended.
    stream_idle_timeout_s: float = 120.0
    #: Completed-but-unsent bytes over all streams; past it a stream reads on only while
    #: it holds less than one chunk (so every stream still moves).
    max_total_buffered_bytes: int = 512 << 20
    #: Datasets opened by path kept open at once; unused ones close after the idle time.
    max_path_datasets: int = 32
    path_dataset_idle_s: float = 300.0
    #: Largest request message (requests are small; this bounds parsing work).
    max_request_bytes: int = 1 << 20
    #: Keepalive: the server pings each connection every keepalive_time_s and drops it
    #: when no answer comes in keepalive_timeout_s (dead peers); a client pinging more
    #: often than min_client_ping_interval_s gets GOAWAY too_many_pings.
    keepalive_time_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    min_client_ping_interval_s: float = 10.0
    #: A connection with no call for this long is closed (the client reconnects on demand).
    max_connection_idle_s: float = 900.0
    #: A connection is told to go away after this age; its calls get the grace to end,
    #: then are cut (the Loader resumes at its next batch on a new connection).
    max_connection_age_s: float = 3600.0
    max_connection_age_grace_s: float = 60.0
    log_format: str = "text"  # or "json"

    def __post_init__(self) -> None:
        if self.max_reads < 1:
            raise ValueError(f"max_reads must be at least 1, got {self.max_reads}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be at least 1, got {self.io_threads}")
        for name in _NON_NEGATIVE:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative (0 turns it off), got {getattr(self, name)}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be at least 1024, got {self.max_request_bytes}")


_NON_NEGATIVE = (
    "max_streams", "max_streams_per_client", "max_streams_per_connection", "stream_idle_timeout_s",
    "max_total_buffered_bytes", "max_path_datasets", "path_dataset_idle_s", "keepalive_time_s",
    "keepalive_timeout_s", "min_client_ping_interval_s", "max_connection_idle_s", "max_connection_age_s",
    "max_connection_age_grace_s",
)


_LIMIT_FIELDS = {f.name for f in dataclasses.fields(FetchLimits)}


def config_from_mapping(raw: dict[str, Any], source: str = "config") -> ServerConfig:
    """Build a ServerConfig from a mapping (a parsed YAML file); unknown keys are errors."""
    known = {f.name for f in dataclasses.fields(ServerConfig)}
    values: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    for key, value in raw.items():
        key = key.replace("-", "_")
        if key in _LIMIT_FIELDS:
            limits[key] = value
        elif key == "limits":
            limits.update({k.replace("-", "_"): v for k, v in value.items()})
        elif key == "latency":
            values["latency"] = None if value is None else LatencySpec(**value)
        elif key in known:
            values[key] = tuple(value) if key in ("datasets", "data_roots") else value
        else:
            raise ValueError(f"{source}: unknown setting {key!r}; known: {sorted(known | _LIMIT_FIELDS)}")
    bad = set(limits) - _LIMIT_FIELDS
    if bad:
        raise ValueError(f"{source}: unknown limit {sorted(bad)[0]!r}; known: {sorted(_LIMIT_FIELDS)}")
    if limits:
        values["limits"] = FetchLimits(**limits)
    return ServerConfig(**values)


def load_config_file(path: str | Path) -> ServerConfig:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read config file {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"config file {path}: expected a mapping of settings, got {type(raw).__name__}")
    return config_from_mapping(raw, source=str(path))
