"""What a bucket mount lets through when every sample is its own file (an ImageFolder).

    python -m croupier.bench.mount_files [--files 640] [--threads 64] [--out bench/results/mount-files.md]

The loopback S3 server (20 ms lognormal a request, sigma 0.5) holds small files (2,200 bytes,
a 64x64 JPEG's size) in 64 folders, and in one folder. Each row mounts the bucket afresh
(`rclone mount`, `s3fs`: their defaults, then the options a row names), lists the folders as
croupier's open does, then reads every file whole from `--threads` threads, twice: the first
pass is a cold epoch (the client looks each file up), the second a later one. The store
counts what each pass cost it: requests by method and the most in flight at once.

It answers what croupier's log line and `croupier probe` tell a user to change on such a
mount (server/storage/mounts.py, CLIENT_LIMITS): which limit is the client's own, not the
kernel's, and which option lifts it.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import s3server
from .bucket_mount import rclone_mounted, rclone_unusable, s3fs_mounted, s3fs_unusable
from .driver import attempt, drive
from .reporting import header_lines

SIZE = 2200
FOLDERS = 64
#: (client, options, layout): each a fresh mount.
ROWS = (
    ("rclone", (), "many"),
    ("rclone", (), "one"),
    ("rclone", ("--checkers", "32"), "many"),
    ("rclone", ("--use-server-modtime",), "many"),
    ("rclone", ("--use-server-modtime",), "one"),
    ("s3fs", (), "many"),
)
CLIENTS = {"rclone": (rclone_mounted, rclone_unusable), "s3fs": (s3fs_mounted, s3fs_unusable)}


def write_files(root: Path, files: int) -> None:
    rng = random.Random(0)
    for layout, folders in (("many", FOLDERS), ("one", 1)):
        for i in range(files):
            d = root / layout / f"c{i % folders:03d}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{i:06d}.jpg").write_bytes(rng.randbytes(SIZE))


def read_whole(path: str) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def one_row(s3: Any, mounted: Any, options: tuple[str, ...], layout: str, files: int, threads: int) -> dict[str, Any]:
    folders = FOLDERS if layout == "many" else 1
    with mounted(s3.endpoint, "bench", timeout=30, options=options) as mnt:
        paths = [str(mnt / layout / f"c{i % folders:03d}" / f"{i:06d}.jpg") for i in range(files)]
        row: dict[str, Any] = {}
        s3.reset_stats()
        t = time.perf_counter()
        listed = sum(len(os.listdir(mnt / layout / f"c{c:03d}")) for c in range(folders))
        row["list"] = {"seconds": time.perf_counter() - t, "files": listed, **_cost(s3.stats(), files)}
        for name in ("first pass", "second pass"):
            s3.reset_stats()
            t = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                sizes = list(pool.map(read_whole, paths))
            took = time.perf_counter() - t
            wrong = sum(n != SIZE for n in sizes)
            if wrong:
                raise RuntimeError(f"{wrong} of {files} files read short through the mount")
            row[name] = {"seconds": took, "files_per_s": files / took, **_cost(s3.stats(), files)}
        return row


def _cost(stats: dict[str, Any], files: int) -> dict[str, Any]:
    return {"requests_per_file": stats["requests"] / files, "by_method": stats["by_method"],
            "max_in_flight": stats["max_in_flight"]}


def measure(rep: dict[str, Any], files: int, threads: int) -> None:
    rep.update(files=files, threads=threads, size=SIZE, folders=FOLDERS, rows=[])
    root = Path(tempfile.mkdtemp(prefix="mount-files-"))
    write_files(root / "bench", files)
    with s3server.running(root, latency=s3server.Latency.lognormal(20.0, 0.5, 0), process=True) as s3:
        rep["latency"] = s3.latency.describe()
        for client, options, layout in ROWS:
            mounted, unusable = CLIENTS[client]
            why = unusable()
            what = f"{client} {' '.join(options) or '(defaults)'}, {layout} folder{'s' if layout == 'many' else ''}"
            if why:
                rep["errors"].append(f"{what}: {why}")
                continue
            print(f"{what} ...", flush=True)
            got = attempt(rep, what, lambda: one_row(s3, mounted, options, layout, files, threads), print)
            if got is not None:
                rep["rows"].append({"client": client, "options": list(options), "layout": layout, **got})
                print(f"    first pass {got['first pass']['files_per_s']:,.0f} files/s, "
                      f"second {got['second pass']['files_per_s']:,.0f}", flush=True)


def _methods(c: dict[str, Any], files: int) -> str:
    return ", ".join(f"{m} {n / files:.2f}" for m, n in sorted(c["by_method"].items())) or "none"


def markdown(rep: dict[str, Any], plots: list[str]) -> str:
    n = rep["files"]
    lines = ["# One file a sample through bucket mounts: what the client lets through", "", *header_lines(rep),
             f"{n:,} files of {rep['size']:,} bytes on the loopback S3 server ({rep['latency']}), in {rep['folders']} "
             "folders (`many`) or one (`one`); each row a fresh mount with the client's defaults plus the options "
             f"named; the folders listed, then every file opened and read whole from {rep['threads']} threads, twice. "
             "Requests per file and the most in flight at once are the store's own counts.", "",
             "| client, options | folders | list: s, requests/file | first pass files/s | requests/file | max in flight "
             "| second pass files/s | requests/file | max in flight |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        a, b, ls = r["first pass"], r["second pass"], r["list"]
        lines.append(f"| {r['client']} {' '.join(r['options']) or '(defaults)'} | {r['layout']} | {ls['seconds']:.2f}, "
                     f"{_methods(ls, n)} | {a['files_per_s']:,.0f} | {_methods(a, n)} | {a['max_in_flight']} | "
                     f"{b['files_per_s']:,.0f} | {_methods(b, n)} | {b['max_in_flight']} |")
    if rep["errors"]:
        lines += ["", "## Errors", "", *[f"- {e}" for e in rep["errors"]]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m croupier.bench.mount_files", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=640)
    p.add_argument("--threads", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("bench/results/mount-files.md"))
    a = p.parse_args(argv)
    command = " ".join(["python -m croupier.bench.mount_files", *(sys.argv[1:] if argv is None else argv)])
    drive(a.out.stem, a.out.parent, command, lambda rep: measure(rep, a.files, a.threads), markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
