"""The `croupier` command: serve, rewrite, demo, bench, loadtest."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence

SERVE_HELP = """\
Serve datasets to trainers over gRPC.

DATASET is a path (Arrow IPC file or folder, Hugging Face save_to_disk folder, Parquet
file or folder, ImageFolder tree, folder of WebDataset .tar shards), NAME=PATH to
choose its name, or NAME=synthetic:ROWS[:ROW_BYTES] for a virtual table of any size.
Flags override the environment, which overrides the config file; the config file is
YAML with the same names (underscores), e.g.  datasets: [digits=/data/digits]
port: 50051  max_reads: 4096  tls_cert: /certs/server.pem.

Security (README, "Security"): plaintext is served only on a loopback --host; any other
host needs --tls-cert/--tls-key (or --insecure). --tokens-file makes every call carry a
bearer token (reread on SIGHUP and when the file changes); health checks and reflection
stay open unless --open-services says otherwise. Environment: CROUPIER_TLS_CERT,
CROUPIER_TLS_KEY, CROUPIER_TLS_CLIENT_CA, CROUPIER_TOKENS_FILE, CROUPIER_METRICS_TLS_CERT,
CROUPIER_METRICS_TLS_KEY, CROUPIER_METRICS_AUTH_FILE, CROUPIER_METRICS_AUTH (user:password).
"""


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    from croupier.server.config import ServerConfig

    d = ServerConfig()  # the defaults the help text quotes
    lim = d.limits
    p = sub.add_parser("serve", help="run the data server", description=SERVE_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("datasets", nargs="*", metavar="DATASET", help="datasets to serve (see above)")
    p.add_argument("--config", help="YAML config file; flags given here override it")
    g = p.add_argument_group("network")
    g.add_argument("--host", help="address to listen on (default 127.0.0.1; 0.0.0.0 or :: for all)")
    g.add_argument("--port", type=int, help="gRPC port (default 50051; 0 picks a free one)")
    g.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (default off; 0 picks a free one)")
    g.add_argument("--metrics-host", help="address of the metrics endpoint (default 127.0.0.1)")
    g.add_argument("--max-message-mb", type=int,
                   help=f"largest gRPC message in MiB; larger chunks are split (default {d.max_message_bytes >> 20})")
    g = p.add_argument_group("security")
    g.add_argument("--tls-cert", metavar="PEM", help="server certificate chain: serve gRPC over TLS (with --tls-key)")
    g.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    g.add_argument("--tls-client-ca", metavar="PEM",
                   help="mutual TLS: refuse clients without a certificate signed by this CA")
    g.add_argument("--insecure", action="store_true", default=None,
                   help="serve plaintext on a non-loopback --host anyway (behind a TLS proxy or in a private "
                   "network); refused without it")
    g.add_argument("--tokens-file", metavar="YAML",
                   help="bearer tokens (name, token or sha256, optional dataset scope): every call must carry "
                   "one; reread on SIGHUP and when the file changes")
    g.add_argument("--open-services", metavar="LIST",
                   help="services reachable without a token, comma-separated from health,reflection; "
                   "'none' for none (default health,reflection)")
    g.add_argument("--disclose-paths", action="store_true", default=None,
                   help="tell clients where datasets live on the server (DatasetInfo.path, paths in errors); "
                   "default: dataset names and member paths only")
    g.add_argument("--metrics-tls-cert", metavar="PEM", help="serve /metrics over HTTPS with this certificate")
    g.add_argument("--metrics-tls-key", metavar="PEM", help="its private key")
    g.add_argument("--metrics-auth-file", metavar="FILE",
                   help="file holding 'user:password': /metrics asks for HTTP basic auth "
                   "(or env CROUPIER_METRICS_AUTH)")
    g = p.add_argument_group("data")
    g.add_argument("--data-root", action="append", dest="data_roots",
                   help="folder clients may stream paths from (a relative path is looked up under each in "
                   "turn); dataset paths, and every file a dataset reads, must lie under one (repeatable)")
    g.add_argument("--cache-dir", help="where tar offset indexes go when the data folder is read-only")
    g.add_argument("--follow-symlinks-outside-roots", action="store_true", default=None,
                   help="let links inside a dataset point outside its roots (default: refused; a dataset's "
                   "roots are the --data-root folders, or without any, the dataset's own folder)")
    g.add_argument("--strict-datasets", action="store_true", default=None,
                   help="fail the start when a DATASET cannot be opened (default: log it, leave it unserved "
                   "and serve the others; clients asking for it get FAILED_PRECONDITION)")
    g.add_argument("--verify-images", action="store_true", default=None,
                   help="decode every image on the server before sending it (default: a cheap check of each "
                   "image's structure: signature, header, end marker, declared size)")
    g.add_argument("--storage-option", action="append", dest="storage_options", metavar="KEY=VALUE",
                   help="object-store setting for s3:// (gs://, az://) datasets, over the AWS_* environment "
                   "variables the cloud SDKs read: endpoint, region, access_key_id, secret_access_key, "
                   "session_token, skip_signature, fast_get=false (every S3 GET through obstore, not the event "
                   "loop's own HTTP client), ... (repeatable)")
    g = p.add_argument_group("concurrency and memory")
    g.add_argument("--max-reads", type=int, help=f"sample reads in flight over all streams (default {d.max_reads})")
    g.add_argument("--max-reads-per-stream", type=int, help=f"sample reads in flight per stream (default: tuned per stream; "
                   f"{lim.max_reads_per_stream} with --no-autotune)")
    g.add_argument("--prefetch", type=int, dest="default_prefetch",
                   help=f"batches reads may run ahead of the oldest unsent one, when the client "
                   f"does not say (default: tuned per stream; {lim.default_prefetch} with --no-autotune)")
    g.add_argument("--max-prefetch", type=int,
                   help=f"largest prefetch a client may ask for; larger requests are clamped "
                   f"(default {lim.max_prefetch})")
    g.add_argument("--max-buffered-mb", type=float,
                   help=f"completed-but-unsent MiB per stream before reading pauses (default {lim.max_buffered_bytes >> 20})")
    g.add_argument("--chunk-samples", type=int, help=f"samples per message at most (default: tuned per stream; "
                   f"{lim.chunk_samples} with --no-autotune)")
    g.add_argument("--chunk-kb", type=int,
                   help=f"payload KiB per message before it is flushed (default {lim.chunk_bytes >> 10}, under "
                   "grpc's default 4 MiB receive limit); a message never exceeds --max-message-mb")
    g.add_argument("--no-shared-epochs", dest="shared_epochs", action="store_false", default=None,
                   help="every stream does its own reads (default: streams of the same rank of the same epoch "
                   "- dataset, seed, epoch, world size, batch size, drop_last, columns - read each sample once "
                   "and share it; README \"Shared epochs\")")
    g.add_argument("--shared-window-mb", type=float,
                   help=f"MiB of completed samples one shared epoch holds for its slower streams; a stream "
                   f"further behind goes on with its own reads (default {d.shared_window_bytes >> 20})")
    g.add_argument("--flush-delay-ms", type=float, help=f"longest a completed sample waits for its chunk (default: tuned per stream; "
                   f"{lim.flush_delay_s * 1000:g} with --no-autotune)")
    g.add_argument("--no-autotune", action="store_false", dest="autotune", default=None,
                   help="turn the per-stream tuner off: every stream uses --max-reads-per-stream, --prefetch, "
                   "--chunk-samples and --flush-delay-ms (or their defaults) as given; with the tuner on (the "
                   "default) those four are tuned online unless set, and a setting given is pinned "
                   "(README \"Autotuning\")")
    g.add_argument("--workers", type=int, help=f"threads for CPU work: encoding chunks, Pillow (default {d.workers})")
    g.add_argument("--io-threads", type=int,
                   help=f"threads that wait on file-system reads, one pread each: file reads in flight at most "
                   f"(default {d.io_threads}, started on demand)")
    _limits_arguments(p, d)
    g = p.add_argument_group("injected storage latency (benchmarks)")
    g.add_argument("--latency-ms", type=float, help="median latency added to every read (default none)")
    g.add_argument("--latency-distribution", choices=["lognormal", "uniform", "fixed"], help="(default lognormal)")
    g.add_argument("--latency-sigma", type=float, help="lognormal sigma (default 0.5)")
    g.add_argument("--latency-seed", type=int, help="seed of the latency draws (default 0)")
    g = p.add_argument_group("lifecycle and logs")
    g.add_argument("--grace", type=float, dest="grace_s",
                   help="seconds SIGTERM lets open streams finish (default 30)")
    g.add_argument("--drain-notice", type=float, dest="drain_notice_s",
                   help="seconds a draining server keeps its port open after SIGTERM, answering health checks "
                   "NOT_SERVING and new streams UNAVAILABLE, even with no stream open (default 2; at most --grace)")
    g.add_argument("--ready-file", help="write {port, metrics_port, pid} as JSON here once serving")
    g.add_argument("--log-format", choices=["text", "json"], help="(default text)")
    g.add_argument("--log-level", default="INFO")
    p.set_defaults(func=cmd_serve)


#: Fair-limit flags: (flag, ServerConfig field, unit multiplier, help). 0 turns a limit off.
_LIMIT_FLAGS = (
    ("--max-streams", "max_streams", 1, "streams open at once on the whole server"),
    ("--max-streams-per-client", "max_streams_per_client", 1,
     "streams one client (its token name, else its client certificate's CN, else its IP address) may hold open"),
    ("--max-streams-per-connection", "max_streams_per_connection", 1, "streams one connection may hold open"),
    ("--stream-idle-timeout", "stream_idle_timeout_s", 1,
     "seconds a stream may wait on a client that reads nothing before it is ended (RESOURCE_EXHAUSTED)"),
    ("--max-buffered-total-mb", "max_total_buffered_bytes", 1 << 20,
     "completed-but-unsent MiB over all streams; past it a stream reads on only while it holds under a chunk"),
    ("--max-path-datasets", "max_path_datasets", 1,
     "datasets opened by path kept open at once (least recently used unused ones close first)"),
    ("--path-dataset-idle", "path_dataset_idle_s", 1, "seconds an unused dataset opened by path stays open"),
    ("--max-request-kb", "max_request_bytes", 1 << 10, "largest request message in KiB"),
    ("--keepalive-time", "keepalive_time_s", 1, "seconds between the server's keepalive pings"),
    ("--keepalive-timeout", "keepalive_timeout_s", 1, "seconds a ping may go unanswered before the connection drops"),
    ("--min-client-ping-interval", "min_client_ping_interval_s", 1,
     "seconds a client must leave between pings (closer pings: GOAWAY too_many_pings)"),
    ("--max-connection-idle", "max_connection_idle_s", 1, "seconds a connection without calls stays open"),
    ("--max-connection-age", "max_connection_age_s", 1,
     "seconds before a connection is told to go away (the Loader resumes on a new one)"),
    ("--max-connection-age-grace", "max_connection_age_grace_s", 1,
     "seconds calls of an aged connection get before they are cut"),
)


def _limits_arguments(p: argparse.ArgumentParser, d) -> None:
    g = p.add_argument_group("fair limits (0 turns one off; README \"Limits\")")
    for flag, name, unit, text in _LIMIT_FLAGS:
        default = getattr(d, name) / unit
        g.add_argument(flag, type=float, dest=f"limit_{name}", metavar="N",
                       help=f"{text} (default {default:g})")
    g.add_argument("--max-batch-size", type=int,
                   help=f"largest batch_size a stream may ask for (default {d.limits.max_batch_size})")


def _limits_changes(args: argparse.Namespace) -> dict:
    changes = {}
    for _flag, name, unit, _text in _LIMIT_FLAGS:
        value = getattr(args, f"limit_{name}")
        if value is not None:
            changes[name] = value * unit if name.endswith("_s") else int(value * unit)
    return changes


def build_server_config(args: argparse.Namespace):
    from croupier.server.config import LatencySpec, ServerConfig, env_settings, load_config_file

    config = load_config_file(args.config) if args.config else ServerConfig()
    changes: dict = env_settings(os.environ)
    for name in ("host", "port", "metrics_port", "metrics_host", "cache_dir", "max_reads", "workers", "io_threads",
                 "grace_s", "drain_notice_s", "log_format", "tls_cert", "tls_key", "tls_client_ca", "insecure",
                 "tokens_file", "disclose_paths", "metrics_tls_cert", "metrics_tls_key", "metrics_auth_file"):
        value = getattr(args, name)
        if value is not None:
            changes[name] = value
    for name in ("follow_symlinks_outside_roots", "strict_datasets", "verify_images"):  # confinement, bad data
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.open_services is not None:
        names = [n.strip() for n in args.open_services.split(",") if n.strip()]
        changes["open_services"] = tuple(n for n in names if n != "none")
    if args.datasets:
        changes["datasets"] = tuple(args.datasets)
    if args.data_roots:
        changes["data_roots"] = tuple(args.data_roots)
    changes.update(_limits_changes(args))
    if args.max_message_mb is not None:
        changes["max_message_bytes"] = args.max_message_mb << 20
    if args.shared_epochs is not None:
        changes["shared_epochs"] = args.shared_epochs
    if args.shared_window_mb is not None:
        changes["shared_window_bytes"] = max(1, int(args.shared_window_mb * (1 << 20)))
    if args.storage_options:
        options = dict(config.storage_options)
        for item in args.storage_options:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ValueError(f"--storage-option {item!r}: expected KEY=VALUE, e.g. endpoint=http://127.0.0.1:9000")
            options[key] = value
        changes["storage_options"] = options
    limits = {}
    for name in ("max_reads_per_stream", "default_prefetch", "max_prefetch", "chunk_samples", "max_batch_size"):
        if getattr(args, name) is not None:
            limits[name] = getattr(args, name)
    if args.max_buffered_mb is not None:
        limits["max_buffered_bytes"] = int(args.max_buffered_mb * (1 << 20))
    if args.chunk_kb is not None:
        limits["chunk_bytes"] = args.chunk_kb << 10
    if args.flush_delay_ms is not None:
        limits["flush_delay_s"] = args.flush_delay_ms / 1000
    if limits:
        changes["limits"] = dataclasses.replace(config.limits, **limits)
        from croupier.server.config import TUNED_LIMITS

        pinned = set(config.autotune_pinned) | (set(limits) & set(TUNED_LIMITS))
        changes["autotune_pinned"] = tuple(sorted(pinned))
    if args.autotune is not None:
        changes["autotune"] = args.autotune
    if args.latency_ms is not None:
        base = config.latency or LatencySpec(median_ms=args.latency_ms)
        changes["latency"] = dataclasses.replace(
            base,
            median_ms=args.latency_ms,
            **{k: v for k, v in (("distribution", args.latency_distribution), ("sigma", args.latency_sigma),
                                 ("seed", args.latency_seed)) if v is not None},
        )
    return dataclasses.replace(config, **changes)


def cmd_serve(args: argparse.Namespace) -> int:
    from croupier.logs import setup_logging

    try:
        config = build_server_config(args)
    except (ValueError, TypeError) as exc:
        print(f"croupier serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_format, args.log_level)
    if not config.datasets and not config.data_roots:
        print("croupier serve: name at least one DATASET or a --data-root (see --help)", file=sys.stderr)
        return 2
    from croupier.server.app import run
    from croupier.server.access.auth import TokenFileError
    from croupier.server.readers.base import DatasetError
    from croupier.server.access.tls import SecurityConfigError

    try:
        run(config, args.ready_file)
    except (SecurityConfigError, TokenFileError) as exc:
        print(f"croupier serve: {exc}", file=sys.stderr)
        return 2
    except (DatasetError, OSError) as exc:
        print(f"croupier serve: {exc}", file=sys.stderr)
        return 1
    return 0


REWRITE_HELP = """\
Rewrite a dataset into the layout croupier reads fastest: a folder DST of uncompressed
Arrow IPC file-format parts (part-00000.arrow, ...) in small record batches, the same
rows in the same order, schema metadata (Hugging Face features) kept. A random row then
costs its own bytes plus its batch's offsets, where Parquet decodes a whole page and
save_to_disk folders hold 1,000-row stream batches.

SRC is any dataset `croupier serve` reads (arrow, hf, parquet, imagefolder, webdataset);
images become rows {image: HF Image, label: HF ClassLabel}. DST is written as
DST.tmp-<pid> and renamed at the end; a non-empty DST needs --overwrite.
"""


def _rewrite_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rewrite", help="rewrite a dataset as small-batch Arrow IPC files (fastest random reads)",
                       description=REWRITE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="the dataset to read (format detected, or --format)")
    p.add_argument("dst", metavar="DST", help="the folder to write (must not exist, be empty, or --overwrite)")
    p.add_argument("--rows-per-batch", type=int, default=64, help="rows per record batch (default 64)")
    p.add_argument("--format", help="SRC's format: arrow, hf, parquet, imagefolder, webdataset (default: detected)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty DST (only once the rewrite succeeded)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (none either when stderr is not a terminal)")
    p.add_argument("--max-file-mb", type=int, default=2048,
                   help="start a new part once one passes this many MiB (default 2048)")
    p.set_defaults(func=cmd_rewrite)


def cmd_rewrite(args: argparse.Namespace) -> int:
    from croupier.rewrite import rewrite
    from croupier.server.readers.base import DatasetError

    try:
        result = rewrite(args.src, args.dst, rows_per_batch=args.rows_per_batch, format=args.format,
                         overwrite=args.overwrite, progress=not args.no_progress,
                         max_file_bytes=args.max_file_mb << 20)
    except (DatasetError, OSError, ValueError) as exc:
        print(f"croupier rewrite: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"croupier rewrite: interrupted; {args.dst} left as it was", file=sys.stderr)
        return 130
    print(result.summary())
    return 0


# Other subcommands register here: each module exposes add_parser(sub) -> None.
_EXTRA_COMMANDS: list[tuple[str, str]] = [
    ("croupier.demo", "add_parser"),
    ("croupier.bench", "add_parser"),
    ("croupier.loadtest", "add_parser"),
]


BENCH_INSTALL_HINT = (
    "croupier bench: the benchmark harness is not installed. It is the croupier-bench "
    "distribution in the bench/ folder of a croupier checkout, kept out of the product's "
    "wheel: from the checkout, run  pip install -e ./bench  (the dev setup in README.md "
    "installs it)."
)


def _bench_not_installed_parser(sub: argparse._SubParsersAction) -> None:
    """`croupier bench` without the harness: say how to install it instead of 'invalid choice'."""
    p = sub.add_parser("bench", help="benchmarks (needs the croupier-bench harness: pip install -e ./bench)",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)

    def explain(_args: argparse.Namespace) -> int:
        print(BENCH_INSTALL_HINT, file=sys.stderr)
        return 2

    p.set_defaults(func=explain)


def make_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="croupier", description="Deal a globally shuffled dataset to trainers.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _serve_parser(sub)
    _rewrite_parser(sub)
    for module, attr in _EXTRA_COMMANDS:
        # A broken optional command must not take `croupier serve` down with it;
        # each command's own tests catch the breakage.
        try:
            add: Callable = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            if os.environ.get("CROUPIER_DEBUG_CLI"):
                raise
            if not (isinstance(exc, ModuleNotFoundError) and exc.name == module):
                print(f"croupier: command module {module} unavailable: {exc}", file=sys.stderr)
            elif module == "croupier.bench":
                _bench_not_installed_parser(sub)
            continue
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
