"""The cache tier on a local disk costs nothing: cache on (the default) against --cache-memory 0.

    python -m croupier.bench.cache_local --out bench/results/cache_local.md

On a local file system the kernel's page cache already is the cache, so the server's cache
must stay out of the way: no fill, and files read whole (images) not cached at all (their
key check, a realpath and a stat per read, once cost more than the read: 2.0-2.5x fewer
image samples/s). Side by side in one run, `rounds` times each, alternated: an ImageFolder of
6,000 64x64 JPEGs and an Arrow IPC table of 100,000 rows of 1,000 bytes, on the disk under
`--data-dir`, one `croupier serve` per case, one Loader (format numpy, images undecoded), 3
epochs: samples/s per epoch and the server's CPU seconds for the whole run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .driver import drive
from .reporting import header_lines

CASES = (("cache on (default)", ()), ("cache off (--cache-memory 0)", ("--cache-memory", "0")))


def make_data(root: Path) -> dict[str, Path]:
    """The two datasets, made once under `root`."""
    import pyarrow as pa
    import pyarrow.ipc as ipc
    from PIL import Image

    images, table = root / "images", root / "text.arrow"
    if not images.exists():
        rng = np.random.default_rng(0)
        for c in range(10):
            (images / f"c{c}").mkdir(parents=True)
            for i in range(600):
                Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(images / f"c{c}" / f"{i}.jpg",
                                                                                          quality=85)
    if not table.exists():
        t = pa.table({"id": np.arange(100_000), "text": ["x" * 1000] * 100_000})
        with ipc.new_file(str(table), t.schema) as w:
            w.write_table(t, max_chunksize=1000)
    return {"images": images, "text": table}


def run_case(dataset: str, path: Path, flags: Sequence[str], epochs: int) -> dict[str, Any]:
    """One server with `flags`, `epochs` epochs of one Loader; samples/s and server CPU."""
    from croupier.client import ImageDecoding, Loader

    ready = Path(tempfile.mktemp(prefix="croupier-cache-local-"))
    proc = subprocess.Popen([sys.executable, "-m", "croupier.cli", "serve", f"d={path}", "--port", "0", "--ready-file",
                             str(ready), "--log-level", "WARNING", *flags])
    try:
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"croupier serve exited {proc.returncode}")
            time.sleep(0.05)
        port = json.loads(ready.read_text())["port"]
        rates = []
        for epoch in range(epochs):
            loader = Loader("d", servers=f"127.0.0.1:{port}", batch_size=64 if dataset == "images" else 256, seed=0,
                            epoch=epoch, format="numpy", decoding=ImageDecoding(output="none"))
            t, n = time.perf_counter(), 0
            for batch in loader:
                n += len(next(iter(batch.values())))
            rates.append(n / (time.perf_counter() - t))
            loader.close()
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    finally:
        proc.terminate()
        proc.wait(30)
        ready.unlink(missing_ok=True)
    return {"samples_per_s": rates, "server_cpu_s": cpu}


def measure(args: argparse.Namespace, rep: dict[str, Any]) -> None:
    data = make_data(args.data_dir)
    rows = []
    for r in range(args.rounds):
        for dataset, path in data.items():
            for name, flags in CASES:
                got = run_case(dataset, path, flags, args.epochs)
                rows.append({"round": r, "dataset": dataset, "case": name, **got})
                print(f"round {r} {dataset} {name}: {[round(x) for x in got['samples_per_s']]} samples/s, "
                      f"server CPU {got['server_cpu_s']:.1f} s", flush=True)
    rep.update(settings={"rounds": args.rounds, "epochs": args.epochs, "data_dir": str(args.data_dir)}, rows=rows)


def report(rep: dict[str, Any], plots: Sequence[str] = ()) -> str:
    s = rep["settings"]
    lines = ["# The cache tier on a local disk: cache on (the default) against off", "", *header_lines(rep),
             f"Data on the local disk under {s['data_dir']}: an ImageFolder of 6,000 64x64 JPEGs (read whole, not "
             "decoded) and an Arrow IPC table of 100,000 rows of 1,000 bytes; one server per case, one Loader, "
             f"{s['epochs']} epochs; {s['rounds']} rounds, cases alternated. Medians over the rounds, per epoch.", "",
             "| dataset | case | samples/s per epoch | server CPU s (whole run) |", "|---|---|---|---|"]
    for dataset in dict.fromkeys(r["dataset"] for r in rep["rows"]):
        for name, _ in CASES:
            rs = [r for r in rep["rows"] if r["dataset"] == dataset and r["case"] == name]
            per_epoch = [statistics.median(r["samples_per_s"][e] for r in rs) for e in range(s["epochs"])]
            cpu = statistics.median(r["server_cpu_s"] for r in rs)
            lines.append(f"| {dataset} | {name} | {', '.join(f'{x:,.0f}' for x in per_epoch)} | {cpu:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m croupier.bench.cache_local", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--data-dir", type=Path, default=Path.home() / ".cache" / "croupier" / "bench-data" / "cache-local")
    p.add_argument("--out", type=Path, default=Path("bench/results/cache_local.md"))
    args = p.parse_args(argv)
    command = " ".join(["python -m croupier.bench.cache_local", *(sys.argv[1:] if argv is None else argv)])
    drive(args.out.stem, args.out.parent, command, lambda rep: measure(args, rep), report)
    print(args.out.read_text())


if __name__ == "__main__":
    main()
