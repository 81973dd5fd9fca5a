"""Server configuration: one dataclass, and how `croupier serve` fills it from the table of
options (serve_options.py): defaults < config file (YAML) < environment < flags."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from croupier.server.serve_options import ENV_VARS, SERVE_OPTIONS, YAML_KEYS
from croupier.server.stream.fetch_limits import FetchLimits
from croupier.server.stream.tuner import TUNED as TUNED_LIMITS  # one given in a config file or flag is pinned


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
    #: Off (the default): every file a local dataset touches (members, links, listed data
    #: files, shards, class folders) must resolve under the data roots, or, when there are
    #: none, under the dataset's own folder. On: links inside datasets may point anywhere.
    follow_symlinks_outside_roots: bool = False
    #: A dataset named here that fails to open stops the start (on), or is logged and left
    #: unserved while the others serve (off, the default).
    strict_datasets: bool = False
    #: Decode every image on the server before sending it (Pillow, in the CPU pool); off,
    #: only the cheap structural check of images.py runs.
    verify_images: bool = False
    #: Where indexes go when the data folder is read-only (tar offset indexes), and the
    #: cache's disk tier (its blocks/ folder) when cache_size is above 0.
    cache_dir: str | None = None
    #: The cache's memory budget: bytes ("8G") or a share of the memory the process may use
    #: ("25%": of min(RAM, the cgroup's memory.max)); "0" turns the cache off.
    cache_memory: str = "25%"
    #: The cache's disk tier bound ("100G"); "0": no disk tier.
    cache_size: str = "0"
    #: Fill the cache by large sequential reads: "auto" (where measured to pay; never on a
    #: local file system, whose page cache is the cache), "always", "never".
    cache_fill: str = "auto"
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
    #: Tune each stream's reads in flight, prefetch, chunk size and flush delay online
    #: (server/stream/tuner.py); off, every stream uses `limits` as given.
    autotune: bool = True
    #: Tuned settings the operator set (flags or config keys), which the tuner leaves alone:
    #: any of max_reads_per_stream, default_prefetch, chunk_samples, flush_delay_s.
    autotune_pinned: tuple[str, ...] = ()
    latency: LatencySpec | None = None
    #: Seconds SIGTERM waits for open streams to finish before cancelling them.
    grace_s: float = 30.0
    #: Seconds a draining server keeps answering (health NOT_SERVING, new streams
    #: UNAVAILABLE) even once no stream is open, so health checkers and clients see the
    #: drain instead of a refused connection. At most grace_s.
    drain_notice_s: float = 2.0
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
    #: Shared epochs (README "Shared epochs"): streams of the same rank of the same epoch
    #: (dataset, seed, epoch, world size, batch size, drop_last, columns) read each sample
    #: once; off, every stream does its own reads.
    shared_epochs: bool = True
    #: Completed-sample bytes one shared epoch holds for its slower streams; past it, a
    #: stream behind the others goes on with its own reads.
    shared_window_bytes: int = 256 << 20
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
    # ---- transport security and identity (README "Security") ----
    #: TLS for gRPC: the server's certificate chain and private key (PEM files), both or neither.
    tls_cert: str | None = None
    tls_key: str | None = None
    #: Mutual TLS: every client must present a certificate signed by this CA (PEM).
    tls_client_ca: str | None = None
    #: Serve plaintext on a non-loopback host anyway (behind a TLS-terminating proxy, or a
    #: private network); without it such a bind is refused.
    insecure: bool = False
    #: Bearer tokens (YAML, see server/access/auth.py); None: calls need no token.
    tokens_file: str | None = None
    #: Services a caller reaches without a token: any of "health", "reflection".
    open_services: tuple[str, ...] = ("health", "reflection")
    #: Tell clients where datasets live on the server (DatasetInfo.path, error messages).
    disclose_paths: bool = False
    #: TLS for /metrics (PEM files), and a file holding "user:password" for its basic auth
    #: (or the CROUPIER_METRICS_AUTH environment variable).
    metrics_tls_cert: str | None = None
    metrics_tls_key: str | None = None
    metrics_auth_file: str | None = None

    def __post_init__(self) -> None:
        if self.max_reads < 1:
            raise ValueError(f"max_reads must be at least 1, got {self.max_reads}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.grace_s < 0 or self.drain_notice_s < 0:
            raise ValueError(f"grace and drain_notice must be >= 0 seconds, got {self.grace_s} and {self.drain_notice_s}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be at least 1, got {self.io_threads}")
        for name in _NON_NEGATIVE:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative (0 turns it off), got {getattr(self, name)}")
        if self.shared_window_bytes < 1:
            raise ValueError(f"shared_window_bytes (--shared-window-mb) must be positive, got {self.shared_window_bytes}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be at least 1024, got {self.max_request_bytes}")
        for cert, key, flag in (("tls_cert", "tls_key", "--tls"), ("metrics_tls_cert", "metrics_tls_key", "--metrics-tls")):
            if (getattr(self, cert) is None) != (getattr(self, key) is None):
                raise ValueError(f"{flag}-cert and {flag}-key ({cert}, {key}) go together: give both or neither")
        bad = set(self.autotune_pinned) - set(TUNED_LIMITS)
        if bad:
            raise ValueError(f"autotune_pinned: {sorted(bad)[0]!r} is not a tuned setting; tuned: {list(TUNED_LIMITS)}")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key too")


_NON_NEGATIVE = (
    "max_streams", "max_streams_per_client", "max_streams_per_connection", "stream_idle_timeout_s",
    "max_total_buffered_bytes", "max_path_datasets", "path_dataset_idle_s", "keepalive_time_s",
    "keepalive_timeout_s", "min_client_ping_interval_s", "max_connection_idle_s", "max_connection_age_s",
    "max_connection_age_grace_s",
)


_DEFAULTS = ServerConfig()
_LIMIT_FIELDS = {f.name for f in dataclasses.fields(FetchLimits)}


def setting_default(name: str) -> Any:
    """ServerConfig's default of a setting of the table: "port", "limits.chunk_samples",
    "latency.sigma" (LatencySpec's, the latency being off by default); None where there is
    none (latency.median_ms, command options)."""
    part, _, leaf = name.rpartition(".")
    if part == "latency":
        default = {f.name: f.default for f in dataclasses.fields(LatencySpec)}[leaf]
        return None if default is dataclasses.MISSING else default
    return getattr(getattr(_DEFAULTS, part) if part else _DEFAULTS, leaf, None)


def _pinned(already: tuple[str, ...] | set[str], limits: Mapping[str, Any]) -> tuple[str, ...]:
    """The tuned settings to pin: those pinned already, and the tuned ones of `limits` (given by
    the operator)."""
    return tuple(sorted(set(already) | (set(limits) & set(TUNED_LIMITS))))


def env_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings the environment gives: the table's variables (serve_options.ENV_VARS) that
    are set and not empty."""
    return {option.name: environ[var] for var, option in ENV_VARS.items() if environ.get(var)}


def settings_from_flags(values: Mapping[str, Any]) -> dict[str, Any]:
    """The settings the command line gives: {option name: flag value} -> {setting: value in
    ServerConfig's unit}. A value of None (or an empty list) is a flag not given."""
    settings: dict[str, Any] = {}
    for option in SERVE_OPTIONS:
        value = values.get(option.name)
        if option.command or value is None or value == []:
            continue
        if option.convert:
            value = option.convert(value)
        elif option.sequence:
            value = tuple(value)
        elif option.unit:
            value = option.unit.to_setting(value)
        if isinstance(value, float) and type(setting_default(option.name)) is int:
            value = int(value)  # a fraction on a count or a byte size (2.5 streams, 1.5 MiB) is cut
        settings[option.name] = value
    return settings


def with_settings(config: ServerConfig, settings: Mapping[str, Any]) -> ServerConfig:
    """`config` with `settings` (names of the table) over it. A "limits.NAME" replaces that
    limit alone, and pins it when it is tuned; the latency parts apply when the median is
    among them (on `config.latency`, or on a new LatencySpec); `storage_options` add to
    `config`'s."""
    fields: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    latency: dict[str, Any] = {}
    for name, value in settings.items():
        part, _, leaf = name.rpartition(".")
        if part == "limits":
            limits[leaf] = value
        elif part == "latency":
            latency[leaf] = value
        elif name == "storage_options":
            fields[name] = {**config.storage_options, **value}
        else:
            fields[name] = value
    if limits:
        fields["limits"] = dataclasses.replace(config.limits, **limits)
        fields["autotune_pinned"] = _pinned(config.autotune_pinned, limits)
    if "median_ms" in latency:
        base = config.latency or LatencySpec(median_ms=latency["median_ms"])
        fields["latency"] = dataclasses.replace(base, **latency)
    return dataclasses.replace(config, **fields)


def layered_config(config_file: str | Path | None, environ: Mapping[str, str],
                   flags: Mapping[str, Any]) -> ServerConfig:
    """The configuration `croupier serve` runs with: flags > environment > config file >
    defaults. `flags` maps option names to flag values (None: not given)."""
    config = load_config_file(config_file) if config_file else ServerConfig()
    return with_settings(config, {**env_settings(environ), **settings_from_flags(flags)})


def _latency_spec(value: Any, source: str) -> LatencySpec:
    """A config file's `latency:` mapping, its mistakes named (not a bare TypeError)."""
    known = [f.name for f in dataclasses.fields(LatencySpec)]
    if not isinstance(value, dict):
        raise ValueError(f"{source}: latency must be a mapping of {known}, got {value!r}")
    bad = sorted(set(value) - set(known))
    if bad:
        raise ValueError(f"{source}: unknown latency setting {bad[0]!r}; known: {known}")
    if "median_ms" not in value:
        raise ValueError(f"{source}: latency needs median_ms (the median injected delay per read, in ms)")
    return LatencySpec(**value)


def config_from_mapping(raw: dict[str, Any], source: str = "config") -> ServerConfig:
    """Build a ServerConfig from a mapping (a parsed YAML file) keyed by the table's YAML keys
    (serve_options.YAML_KEYS; "-" may stand for "_"); an unknown key is an error naming it."""
    values: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    for key, value in raw.items():
        key = key.replace("-", "_")
        option = YAML_KEYS.get(key)
        if option is None:
            raise ValueError(f"{source}: unknown setting {key!r}; known: {sorted(YAML_KEYS)}")
        if option.name.startswith("limits."):
            limits[key] = value
        elif key == "limits":
            limits.update({k.replace("-", "_"): v for k, v in value.items()})
        elif key == "latency":
            values["latency"] = None if value is None else _latency_spec(value, source)
        else:
            values[key] = tuple(value) if option.sequence else value
    bad = set(limits) - _LIMIT_FIELDS
    if bad:
        raise ValueError(f"{source}: unknown limit {sorted(bad)[0]!r}; known: {sorted(_LIMIT_FIELDS)}")
    if limits:
        values["limits"] = FetchLimits(**limits)
        values["autotune_pinned"] = _pinned(values.get("autotune_pinned", ()), limits)
    return ServerConfig(**values)


def load_config_file(path: str | Path) -> ServerConfig:
    """The ServerConfig a YAML file gives (its settings over the defaults)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read config file {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"config file {path}: expected a mapping of settings, got {type(raw).__name__}")
    return config_from_mapping(raw, source=str(path))
