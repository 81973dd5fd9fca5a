"""The table of `croupier serve` options: each option once, with its flag, its config-file
(YAML) key, its environment variable, its help and where its value lands in ServerConfig.

The command line builds its parser and its `--help` from this table, and
server/config.py reads the config file's keys and the environment from it, so a new
option is one row here (plus its ServerConfig field). The table names settings and
says how a flag's value becomes one; the defaults are ServerConfig's own (config.py's
`setting_default`), never copied here.

Precedence (config.py's `layered_config`): flags > environment > config file > defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

#: How an option appears on the command line:
#: "value" takes one value; "switch" turns a setting on (--insecure); "negated" turns
#: one off (--no-autotune); "repeat" may be given many times (--data-root DIR ...);
#: "positional" is the DATASET list; "config_only" has no flag (a YAML key only).
Action = Literal["value", "switch", "negated", "repeat", "positional", "config_only"]


@dataclass(frozen=True)
class Unit:
    """A flag's unit where it differs from its setting's (MiB on the command line, bytes in
    ServerConfig): converts a flag value to the setting and a default back to the flag."""

    to_setting: Callable[[float], float]
    to_flag: Callable[[float], float]


MIB = Unit(lambda mib: mib * (1 << 20), lambda b: b / (1 << 20))
KIB = Unit(lambda kib: kib * (1 << 10), lambda b: b / (1 << 10))
MS = Unit(lambda ms: ms / 1000, lambda s: s * 1000)


@dataclass(frozen=True)
class ServeOption:
    """One option of `croupier serve`.

    `name` is where the value lands: a ServerConfig field ("port"), or a field of one of
    its parts, "limits.NAME" (FetchLimits: a YAML key at the top level or under `limits:`)
    and "latency.NAME" (LatencySpec: YAML under `latency:`). A `command` option is read by
    the command itself (its config file, ready file, log level), not a setting.
    """

    name: str
    flag: str | None
    group: str | None
    #: "{default}" stands for ServerConfig's default, in the flag's unit.
    help: str = ""
    type: Callable[[str], Any] | None = None
    action: Action = "value"
    unit: Unit | None = None
    #: A flag value -> setting value conversion a unit does not describe (parsing, clamping).
    convert: Callable[[Any], Any] | None = None
    env: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    #: The setting is a tuple: a YAML list, a repeated flag.
    sequence: bool = False
    command: bool = False
    #: A command option's default (settings take theirs from ServerConfig).
    default: Any = None

    @property
    def dest(self) -> str:
        """The option's attribute in the parsed command line."""
        return self.name.replace(".", "_")

    @property
    def yaml_key(self) -> str | None:
        """Its key in a `--config` file; None where it has none (command options, and the
        latency parts, which a config file gives inside its `latency:` mapping)."""
        if self.command or self.name.startswith("latency."):
            return None
        return self.name.rpartition(".")[2]

    @property
    def config_key(self) -> str | None:
        """How a config file names it: its YAML key, or "latency.NAME" for a latency part."""
        return None if self.command else self.yaml_key or self.name

    def help_text(self, default: Any) -> str:
        """The help `--help` shows: `help` with `default` quoted in the flag's unit, and the
        config key where it is not the flag's name with underscores."""
        if isinstance(default, (int, float)) and not isinstance(default, bool) and self.unit:
            default = self.unit.to_flag(default)
        if isinstance(default, tuple):
            shown = ",".join(default)
        else:
            shown = f"{default:g}" if isinstance(default, float) else str(default)
        text = self.help.replace("{default}", shown)
        key = self.config_key
        if key and self.flag and key != self.flag.removeprefix("--").replace("-", "_"):
            text += f" [config: {key}: false]" if self.action == "negated" else f" [config: {key}]"
        return text


def _service_names(text: str) -> tuple[str, ...]:
    """--open-services "health,reflection" (or "none") -> the names."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    return tuple(n for n in names if n != "none")


def _storage_options(items: Sequence[str]) -> dict[str, str]:
    """--storage-option KEY=VALUE ... -> {KEY: VALUE}."""
    options: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option {item!r}: expected KEY=VALUE, e.g. endpoint=http://127.0.0.1:9000")
        options[key] = value
    return options


def _window_bytes(mib: float) -> int:
    # A fraction of a byte rounds up to one instead of down to a refused 0.
    return max(1, int(mib * (1 << 20)))


NETWORK = "network"
SECURITY = "security"
DATA = "data"
CONCURRENCY = "concurrency and memory"
FAIR_LIMITS = "fair limits (0 turns one off; README \"Limits\")"
LATENCY = "injected storage latency (benchmarks)"
LIFECYCLE = "lifecycle and logs"


def _fair(name: str, flag: str, help: str, unit: Unit | None = None) -> ServeOption:
    """A fair limit: a count or a timeout, where 0 turns it off."""
    return ServeOption(name, flag, FAIR_LIMITS, help + " (default {default})", type=float, unit=unit, metavar="N")


#: Every option, in `--help` order (argparse groups appear in the order of their first option).
SERVE_OPTIONS: tuple[ServeOption, ...] = (
    ServeOption("datasets", None, None, "datasets to serve (see above)", action="positional", metavar="DATASET",
                sequence=True),
    ServeOption("config", "--config", None, "YAML config file; flags given here override it", command=True),
    # ---- network ----
    ServeOption("host", "--host", NETWORK, "address to listen on (default {default}; 0.0.0.0 or :: for all)"),
    ServeOption("port", "--port", NETWORK, "gRPC port (default {default}; 0 picks a free one)", type=int),
    ServeOption("metrics_port", "--metrics-port", NETWORK, "Prometheus /metrics port (default off; 0 picks a free one)",
                type=int),
    ServeOption("metrics_host", "--metrics-host", NETWORK, "address of the metrics endpoint (default {default})"),
    ServeOption("max_message_bytes", "--max-message-mb", NETWORK,
                "largest gRPC message in MiB; larger chunks are split (default {default})", type=int, unit=MIB),
    # ---- security ----
    ServeOption("tls_cert", "--tls-cert", SECURITY, "server certificate chain: serve gRPC over TLS (with --tls-key)",
                metavar="PEM", env="CROUPIER_TLS_CERT"),
    ServeOption("tls_key", "--tls-key", SECURITY, "the certificate's private key", metavar="PEM",
                env="CROUPIER_TLS_KEY"),
    ServeOption("tls_client_ca", "--tls-client-ca", SECURITY,
                "mutual TLS: refuse clients without a certificate signed by this CA", metavar="PEM",
                env="CROUPIER_TLS_CLIENT_CA"),
    ServeOption("insecure", "--insecure", SECURITY, "serve plaintext on a non-loopback --host anyway (behind a TLS "
                "proxy or in a private network); refused without it", action="switch"),
    ServeOption("tokens_file", "--tokens-file", SECURITY, "bearer tokens (name, token or sha256, optional dataset "
                "scope): every call must carry one; reread on SIGHUP and when the file changes", metavar="YAML",
                env="CROUPIER_TOKENS_FILE"),
    ServeOption("open_services", "--open-services", SECURITY, "services reachable without a token, comma-separated "
                "from health,reflection; 'none' for none (default {default})", metavar="LIST",
                convert=_service_names, sequence=True),
    ServeOption("disclose_paths", "--disclose-paths", SECURITY, "tell clients where datasets live on the server "
                "(DatasetInfo.path, paths in errors); default: dataset names and member paths only", action="switch"),
    ServeOption("metrics_tls_cert", "--metrics-tls-cert", SECURITY, "serve /metrics over HTTPS with this certificate",
                metavar="PEM", env="CROUPIER_METRICS_TLS_CERT"),
    ServeOption("metrics_tls_key", "--metrics-tls-key", SECURITY, "its private key", metavar="PEM",
                env="CROUPIER_METRICS_TLS_KEY"),
    ServeOption("metrics_auth_file", "--metrics-auth-file", SECURITY, "file holding 'user:password': /metrics asks "
                "for HTTP basic auth (or env CROUPIER_METRICS_AUTH)", metavar="FILE", env="CROUPIER_METRICS_AUTH_FILE"),
    # ---- data ----
    ServeOption("data_roots", "--data-root", DATA, "folder clients may stream paths from (a relative path is looked "
                "up under each in turn); dataset paths, and every file a dataset reads, must lie under one "
                "(repeatable)", action="repeat", sequence=True),
    ServeOption("cache_dir", "--cache-dir", DATA, "where tar offset indexes go when the data folder is read-only, "
                "and the cache's disk tier (CACHE_DIR/blocks, with --cache-size)"),
    ServeOption("cache_memory", "--cache-memory", DATA, "memory the cache of blocks of the datasets' files may "
                "hold: bytes (8G) or a share of the memory the server may use, RAM or its cgroup's limit (default 25%%); "
                "0 turns the cache off (server/cache/README.md)", metavar="SIZE|PCT"),
    ServeOption("cache_size", "--cache-size", DATA, "bound of the cache's disk tier in --cache-dir (e.g. 100G; "
                "default {default}: no disk tier)", metavar="SIZE"),
    ServeOption("cache_fill", "--cache-fill", DATA, "fill the cache by large sequential reads: auto (where a "
                "timed large read beats the small ones it replaces; never on a local file system, whose page cache "
                "is the cache), always, never (default {default})", choices=("auto", "always", "never")),
    ServeOption("follow_symlinks_outside_roots", "--follow-symlinks-outside-roots", DATA, "let links inside a "
                "dataset point outside its roots (default: refused; a dataset's roots are the --data-root folders, "
                "or without any, the dataset's own folder)", action="switch"),
    ServeOption("strict_datasets", "--strict-datasets", DATA, "fail the start when a DATASET cannot be opened "
                "(default: log it, leave it unserved and serve the others; clients asking for it get "
                "FAILED_PRECONDITION)", action="switch"),
    ServeOption("verify_images", "--verify-images", DATA, "decode every image on the server before sending it "
                "(default: a cheap check of each image's structure: signature, header, end marker, declared size)",
                action="switch"),
    ServeOption("storage_options", "--storage-option", DATA, "object-store setting for s3:// (gs://, az://) "
                "datasets, over the AWS_* environment variables the cloud SDKs read: endpoint, region, "
                "access_key_id, secret_access_key, session_token, skip_signature, fast_get=false (every S3 GET "
                "through obstore, not the event loop's own HTTP client), ... (repeatable; the config file takes a "
                "mapping)", action="repeat", metavar="KEY=VALUE", convert=_storage_options),
    # ---- concurrency and memory ----
    ServeOption("max_reads", "--max-reads", CONCURRENCY, "sample reads in flight over all streams (default {default})",
                type=int),
    ServeOption("limits.max_reads_per_stream", "--max-reads-per-stream", CONCURRENCY, "sample reads in flight per "
                "stream (default: tuned per stream; {default} with --no-autotune)", type=int),
    ServeOption("limits.default_prefetch", "--prefetch", CONCURRENCY, "batches reads may run ahead of the oldest "
                "unsent one, when the client does not say (default: tuned per stream; {default} with --no-autotune)",
                type=int),
    ServeOption("limits.max_prefetch", "--max-prefetch", CONCURRENCY, "largest prefetch a client may ask for; larger "
                "requests are clamped (default {default})", type=int),
    ServeOption("limits.max_buffered_bytes", "--max-buffered-mb", CONCURRENCY, "completed-but-unsent MiB per stream "
                "before reading pauses (default {default})", type=float, unit=MIB),
    ServeOption("limits.chunk_samples", "--chunk-samples", CONCURRENCY, "samples per message at most (default: tuned "
                "per stream; {default} with --no-autotune)", type=int),
    ServeOption("limits.chunk_bytes", "--chunk-kb", CONCURRENCY, "payload KiB per message before it is flushed "
                "(default {default}, under grpc's default 4 MiB receive limit); a message never exceeds "
                "--max-message-mb", type=int, unit=KIB),
    ServeOption("shared_epochs", "--no-shared-epochs", CONCURRENCY, "every stream does its own reads (default: "
                "streams of the same rank of the same epoch - dataset, seed, epoch, world size, batch size, "
                "drop_last, columns - read each sample once and share it; README \"Shared epochs\")",
                action="negated"),
    ServeOption("shared_window_bytes", "--shared-window-mb", CONCURRENCY, "MiB of completed samples one shared epoch "
                "holds for its slower streams; a stream further behind goes on with its own reads (default "
                "{default})", type=float, unit=MIB, convert=_window_bytes),
    ServeOption("limits.flush_delay_s", "--flush-delay-ms", CONCURRENCY, "longest a completed sample waits for its "
                "chunk (default: tuned per stream; {default} with --no-autotune)", type=float, unit=MS),
    ServeOption("autotune", "--no-autotune", CONCURRENCY, "turn the per-stream tuner off: every stream uses "
                "--max-reads-per-stream, --prefetch, --chunk-samples and --flush-delay-ms (or their defaults) as "
                "given; with the tuner on (the default) those four are tuned online unless set, and a setting given "
                "is pinned (README \"Autotuning\")", action="negated"),
    ServeOption("workers", "--workers", CONCURRENCY, "threads for CPU work: encoding chunks, Pillow (default "
                "{default})", type=int),
    ServeOption("io_threads", "--io-threads", CONCURRENCY, "threads that wait on file-system reads, one pread each: "
                "file reads in flight at most (default {default}, started on demand)", type=int),
    ServeOption("limits", None, None, "a mapping of the per-stream limits above (FetchLimits fields), "
                "e.g. limits: {chunk_samples: 32}; each is also a key of its own", action="config_only"),
    ServeOption("autotune_pinned", None, None, "tuned settings the tuner leaves as given (any of "
                "max_reads_per_stream, default_prefetch, chunk_samples, flush_delay_s); one given as a flag or "
                "key is pinned anyway", action="config_only", sequence=True),
    # ---- fair limits ----
    _fair("max_streams", "--max-streams", "streams open at once on the whole server"),
    _fair("max_streams_per_client", "--max-streams-per-client", "streams one client (its token name, else its "
          "client certificate's CN, else its IP address) may hold open"),
    _fair("max_streams_per_connection", "--max-streams-per-connection", "streams one connection may hold open"),
    _fair("stream_idle_timeout_s", "--stream-idle-timeout", "seconds a stream may wait on a client that reads "
          "nothing before it is ended (RESOURCE_EXHAUSTED)"),
    _fair("max_total_buffered_bytes", "--max-buffered-total-mb", "completed-but-unsent MiB over all streams; past "
          "it a stream reads on only while it holds under a chunk", unit=MIB),
    _fair("max_path_datasets", "--max-path-datasets", "datasets opened by path kept open at once (least recently "
          "used unused ones close first)"),
    _fair("path_dataset_idle_s", "--path-dataset-idle", "seconds an unused dataset opened by path stays open"),
    _fair("max_request_bytes", "--max-request-kb", "largest request message in KiB; the one limit here that 0 "
          "does not turn off (every request needs room): at least 1", unit=KIB),
    _fair("keepalive_time_s", "--keepalive-time", "seconds between the server's keepalive pings"),
    _fair("keepalive_timeout_s", "--keepalive-timeout", "seconds a ping may go unanswered before the connection "
          "drops"),
    _fair("min_client_ping_interval_s", "--min-client-ping-interval", "seconds a client must leave between pings "
          "(closer pings: GOAWAY too_many_pings)"),
    _fair("max_connection_idle_s", "--max-connection-idle", "seconds a connection without calls stays open"),
    _fair("max_connection_age_s", "--max-connection-age", "seconds before a connection is told to go away (the "
          "Loader resumes on a new one)"),
    _fair("max_connection_age_grace_s", "--max-connection-age-grace", "seconds calls of an aged connection get "
          "before they are cut"),
    ServeOption("limits.max_batch_size", "--max-batch-size", FAIR_LIMITS, "largest batch_size a stream may ask for "
                "(default {default})", type=int),
    # ---- injected storage latency ----
    ServeOption("latency", None, None, "a mapping of LatencySpec fields: median_ms, distribution, sigma, seed, "
                "overrides (global index -> seconds); null for none", action="config_only"),
    ServeOption("latency.median_ms", "--latency-ms", LATENCY, "median latency added to every read (default none); "
                "the other latency flags apply with it", type=float),
    ServeOption("latency.distribution", "--latency-distribution", LATENCY, "(default {default})",
                choices=("lognormal", "uniform", "fixed")),
    ServeOption("latency.sigma", "--latency-sigma", LATENCY, "lognormal sigma (default {default})", type=float),
    ServeOption("latency.seed", "--latency-seed", LATENCY, "seed of the latency draws (default {default})", type=int),
    # ---- lifecycle and logs ----
    ServeOption("grace_s", "--grace", LIFECYCLE, "seconds SIGTERM lets open streams finish (default {default})",
                type=float),
    ServeOption("drain_notice_s", "--drain-notice", LIFECYCLE, "seconds a draining server keeps its port open after "
                "SIGTERM, answering health checks NOT_SERVING and new streams UNAVAILABLE, even with no stream open "
                "(default {default}; at most --grace)", type=float),
    ServeOption("ready_file", "--ready-file", LIFECYCLE, "write {port, metrics_port, pid} as JSON here once serving",
                command=True),
    ServeOption("log_format", "--log-format", LIFECYCLE, "(default {default})", choices=("text", "json")),
    ServeOption("log_level", "--log-level", LIFECYCLE, "(default INFO)", command=True, default="INFO"),
)

#: Config-file key -> option (every ServerConfig field and every FetchLimits field).
YAML_KEYS: dict[str, ServeOption] = {o.yaml_key: o for o in SERVE_OPTIONS if o.yaml_key}
#: Environment variable -> option.
ENV_VARS: dict[str, ServeOption] = {o.env: o for o in SERVE_OPTIONS if o.env}
