"""python -m croupier.bench.peers: the same as `croupier bench --suite peers`."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from dataclasses import replace

    from .suite import CACHE_CONDITIONS, SCRIPTS, cache_targets, full, on_mounts, quick, resized, run_peers

    p = argparse.ArgumentParser(prog="python -m croupier.bench.peers", description=__doc__)
    p.add_argument("--quick", action="store_true", help="the smoke run: tiny data, croupier, Mosaic, LitData, latency FS")
    p.add_argument("--cache", nargs="?", const="both", choices=sorted(CACHE_CONDITIONS),
                   help="the cache-tier run (issue 25): croupier, Mosaic, LitData, default and a 10%% cache, on the "
                        "FUSE mount with the kernel's defaults and the raised one (both, the default: "
                        "peers-cache.md), only one of them (kernel, raised), S3 (s3), or the S3 bucket through "
                        "rclone mount and s3fs with their defaults (rclone, s3fs, mounts: both)")
    p.add_argument("--on-mounts", action="store_true",
                   help="issue 21's new peers (Lance, Grain + ArrayRecord, dataloader-rs) beside croupier on the "
                        "FUSE mount with the kernel's defaults and the S3 bucket through rclone mount and s3fs, each "
                        "epoch cut after 30 s (peers-mounts.md)")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--data-dir", help="where the generated data lives (default ~/.cache/croupier/bench-data/...)")
    p.add_argument("--only", default="", help="run only the cases whose 'dataset | storage | system | variant' "
                                               "contains this")
    p.add_argument("--text-rows", type=int, help="text rows instead of the suite's (e.g. 1280: the full matrix, tiny)")
    p.add_argument("--images", type=int, help="images instead of the suite's")
    p.add_argument("--systems", help="comma-separated subset of the suite's systems (croupier, mosaic, litdata, "
                                     "tfdata, torchdata, lance, dataloader-rs, grain)")
    args = p.parse_args(argv)
    base = (cache_targets(args.cache) if args.cache else on_mounts() if args.on_mounts else quick() if args.quick
            else full())
    suite = resized(base, args.text_rows, args.images)
    if args.systems:
        wanted = tuple(s.strip() for s in args.systems.split(",") if s.strip())
        unknown = [s for s in wanted if s not in SCRIPTS]
        if unknown:
            p.error(f"--systems: unknown {unknown}; known: {sorted(SCRIPTS)}")
        suite = replace(suite, systems=wanted)
    from .. import default_data_dir

    spec = suite.data
    data_dir = (Path(args.data_dir) if args.data_dir else
                default_data_dir("peers").parent / f"{spec.text_rows}-rows-{spec.images}-images")
    command = "python -m croupier.bench.peers " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))
    rep = run_peers(suite, Path(args.out), data_dir, command.strip(), say=lambda s: print(s, flush=True), only=args.only)
    return 0 if rep["cases"] else 1


if __name__ == "__main__":
    sys.exit(main())
