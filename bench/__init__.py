"""`croupier bench`: croupier against the loaders ML engineers use today, side by side.

    croupier bench                  # the full suite (~15-20 min on 2 cores)
    croupier bench --suite first    # the data plane's first benchmark -> first.md / first.json
    croupier bench --quick          # a one-minute smoke run on tiny data
    croupier bench --suite real     # really slow storage: a latency FUSE mount and a loopback S3 server
    croupier bench --suite real --quick   # its smoke run (seconds, tiny data) -> real-quick.md / .json
    croupier bench --suite peers    # beside Mosaic Streaming, LitData, tf.data service, torchdata (own venvs)
    croupier bench --suite peers --quick  # its smoke run (a couple of minutes) -> peers-quick.md / .json

Writes `<suite>.json`, `<suite>.md` and `<suite>-*.png` under `--out`
(default bench/results), printing progress as it goes.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:
    from .suites import SUITES

    p = sub.add_parser("bench", help="benchmark croupier against DataLoader, HF datasets, WebDataset",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=sorted([*SUITES, "reliability"]), default="full",
                   help="what to run (default full; reliability: the fuzz and fault report, ~5 min)")
    p.add_argument("--quick", action="store_true",
                   help="same as --suite quick; with --suite real or peers, its smoke run (real-quick, peers-quick)")
    p.add_argument("--out", default="bench/results", help="folder for the JSON, Markdown and PNGs")
    p.add_argument("--data-dir", help="where the generated data lives (default ~/.cache/croupier/bench-data/...)")
    p.add_argument("--only", default="", help="run only the cases whose 'dataset | storage | system' contains this "
                                              "(skips the curves; for development)")
    p.set_defaults(func=cmd_bench)


def default_data_dir(suite_name: str) -> Path:
    from .suites import SUITES

    spec = SUITES[suite_name]().data
    return Path.home() / ".cache" / "croupier" / "bench-data" / f"{spec.text_rows}-rows-{spec.images}-images"


def cmd_bench(args: argparse.Namespace) -> int:
    from .suites import SUITES

    name = args.suite
    command = " ".join(["croupier bench", *map(shlex.quote, sys.argv[2:])]) if sys.argv[1:2] == ["bench"] else ""
    say = lambda s: print(s, flush=True)  # noqa: E731
    if name == "reliability":
        from .reliability import run_reliability

        run_reliability(Path(args.out), command or "croupier bench --suite reliability", say=say)
        return 0
    if args.quick:
        name = next((f"{k}-quick" for k in ("real", "peers") if args.suite.startswith(k)), "quick")
    suite = SUITES[name]()
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir(name)
    report = _runner(suite)(suite, Path(args.out), data_dir, command or f"croupier bench --suite {name}",
                            say=say, only=args.only)
    return 1 if not report["cases"] else 0


def _runner(suite: object) -> Callable[..., dict[str, Any]]:
    """What measures a suite of this kind: the matrix (run.py), real (real.py) or peers
    (peers/suite.py); each goes through driver.drive."""
    from .peers.suite import PeersSuite, run_peers
    from .real import RealSuite, run_real
    from .run import run_suite

    if isinstance(suite, PeersSuite):
        return run_peers
    return run_real if isinstance(suite, RealSuite) else run_suite
