"""The `croupier` command: serve, rewrite, demo, loadtest, health, probe (and bench, with the harness installed)."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Callable, Sequence

from croupier.server.serve_options import ENV_VARS, FAIR_LIMITS, SERVE_OPTIONS, ServeOption

SERVE_HELP = """\
Serve datasets to trainers over gRPC.

DATASET is a path (Arrow IPC file or folder, Hugging Face save_to_disk folder, Parquet
file or folder, ImageFolder tree, folder of WebDataset .tar shards), NAME=PATH to
choose its name, or NAME=synthetic:ROWS[:ROW_BYTES] for a virtual table of any size.
Flags override the environment, which overrides the config file; the config file is
YAML keyed by the settings' names: a flag's name with underscores, or the key in
[config: ...] after its help, in the setting's unit (bytes, seconds; latency.NAME is
NAME under latency:), e.g.  datasets: [digits=/data/digits]  port: 50051
max_reads: 4096  tls_cert: /certs/server.pem  latency: {median_ms: 5}.

Security (README, "Security"): plaintext is served only on a loopback --host; any other
host needs --tls-cert/--tls-key (or --insecure). --tokens-file makes every call carry a
bearer token (reread on SIGHUP and when the file changes); health checks and reflection
stay open unless --open-services says otherwise.
"""


def _serve_description() -> str:
    """SERVE_HELP and the environment variables of the table of options."""
    env = ", ".join(f"{var} ({option.flag})" for var, option in ENV_VARS.items())
    text = (f"Environment: {env}; CROUPIER_METRICS_AUTH (user:password, in place of a "
            "--metrics-auth-file).")
    return SERVE_HELP + "\n" + textwrap.fill(text, width=88, break_on_hyphens=False) + "\n"


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    """`croupier serve`: one argument per option of the table (server/serve_options.py)."""
    from croupier.server.config import setting_default

    p = sub.add_parser("serve", help="run the data server", description=_serve_description(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    groups: dict[str | None, argparse._ActionsContainer] = {None: p}
    for option in SERVE_OPTIONS:
        if option.action == "config_only":
            continue
        if option.group not in groups:
            groups[option.group] = p.add_argument_group(option.group)
        default = option.default if option.command else setting_default(option.name)
        _add_serve_argument(groups[option.group], option, option.help_text(default))
    p.set_defaults(func=cmd_serve)


def _add_serve_argument(group: argparse._ActionsContainer, option: ServeOption, help_text: str) -> None:
    if option.action == "positional":
        group.add_argument(option.dest, nargs="*", metavar=option.metavar, help=help_text)
        return
    kwargs: dict = {"dest": option.dest, "help": help_text}
    if option.action in ("switch", "negated"):
        # None, not False: a switch not given leaves the setting to the environment and the file.
        kwargs.update(action="store_true" if option.action == "switch" else "store_false", default=None)
    else:
        metavar = option.metavar
        if metavar is None and option.choices is None:
            metavar = option.flag.removeprefix("--").upper().replace("-", "_")
        kwargs.update(type=option.type, metavar=metavar, choices=option.choices, default=option.default)
        if option.action == "repeat":
            kwargs["action"] = "append"
    group.add_argument(option.flag, **kwargs)


#: The fair limits' flags as (flag, ServerConfig field, unit, help): a view of the table
#: that tests/test_limits.py walks, not a second definition.
_LIMIT_FLAGS = tuple((o.flag, o.name, o.unit, o.help) for o in SERVE_OPTIONS
                     if o.group == FAIR_LIMITS and o.name != "limits.max_batch_size")


def build_server_config(args: argparse.Namespace):
    """The ServerConfig of a parsed `croupier serve`: flags > environment > config file > defaults."""
    from croupier.server.config import layered_config

    flags = {option.name: getattr(args, option.dest) for option in SERVE_OPTIONS if option.action != "config_only"}
    return layered_config(args.config, os.environ, flags)


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
    ("croupier.healthcheck", "add_parser"),
    ("croupier.probe", "add_parser"),
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

    def explain(_args: argparse.Namespace) -> int:
        print(BENCH_INSTALL_HINT, file=sys.stderr)
        return 2

    p.set_defaults(func=explain, any_arguments=True)  # whatever flags follow, the answer is the hint


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
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
