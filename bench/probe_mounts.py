"""What `croupier probe` measures through the FUSE clients people mount buckets with.

    python -m croupier.bench.probe_mounts [--median-ms 5] [--out bench/results/readpaths-bucket-mounts.md]

The loopback S3 server (5 ms lognormal a request, sigma 0.5) holds one 64 MiB object; it is
mounted with `rclone mount` and with `s3fs`, each with its defaults (bench/bucket_mount.py),
and `croupier probe` (preads, page faults of a mapping, O_DIRECT reads, each swept up to 128
in flight) runs on the object through each mount: which read paths the client lets through
at once (whether it negotiates async direct I/O, whether page faults get past a cap), and
what croupier would choose and say.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import s3server
from .bucket_mount import rclone_mounted, rclone_unusable, s3fs_mounted, s3fs_unusable
from .driver import attempt, drive
from .reporting import header_lines

CLIENTS = (("rclone", rclone_mounted, rclone_unusable), ("s3fs", s3fs_mounted, s3fs_unusable))


def probe(path: Path) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "croupier.cli", "probe", str(path), "--max-concurrency", "128",
                           "--json"], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"croupier probe exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def measure(rep: dict[str, Any], median_ms: float) -> None:
    root = Path(tempfile.mkdtemp(prefix="probe-mounts-"))
    (root / "bench").mkdir()
    (root / "bench" / "data.bin").write_bytes(random.Random(0).randbytes(64 << 20))
    rep.update(median_ms=median_ms, clients={})
    with s3server.running(root, latency=s3server.Latency.lognormal(median_ms, 0.5, 0), process=True) as s3:
        for name, mounted, unusable in CLIENTS:
            why = unusable()
            if why:
                rep["errors"].append(f"{name}: {why}")
                continue

            def one(mounted=mounted) -> dict[str, Any]:
                with mounted(s3.endpoint, "bench", timeout=30) as mnt:
                    return probe(mnt / "data.bin")
            got = attempt(rep, name, one, print)
            if got is not None:
                rep["clients"][name] = got
                print(f"{name}: chosen {got['chosen']}", flush=True)


def markdown(rep: dict[str, Any], plots: list[str]) -> str:
    lines = ["# `croupier probe` through bucket mounts (rclone, s3fs; their defaults)", "", *header_lines(rep),
             f"One 64 MiB object on the loopback S3 server ({rep['median_ms']} ms lognormal a request, sigma 0.5), "
             "mounted by each client with its defaults; `croupier probe --max-concurrency 128` on it. Ceiling: "
             "the reads the path completed at once at its peak (Little's law: rate x one read's latency).", "",
             "| client | path | p50 ms | p99 ms | knee | peak reads/s | ceiling in flight | sweep (in flight: reads/s) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in rep["clients"].items():
        for path, p in r["paths"].items():
            if p.get("unavailable"):
                lines.append(f"| {name} | {path} | unavailable: {p['unavailable']} | | | | | |")
                continue
            sweep = ", ".join(f"{s['concurrency']}: {s['reads_per_s']:,.0f}" for s in p["sweep"])
            lines.append(f"| {name} | {path}{' (chosen)' if path == r['chosen'] else ''} | {p['latency_ms']['p50']:.2f} | "
                         f"{p['latency_ms']['p99']:.2f} | {p['knee_concurrency']} | {p['peak_reads_per_s']:,.0f} | "
                         f"{p['ceiling_in_flight']:.1f} | {sweep} |")
    lines += ["", "What croupier says:", ""]
    for name, r in rep["clients"].items():
        lines.append(f"- {name}: reads by {r['chosen']} ({r['reason']}); predicts {r['samples_per_s']:,.0f} samples/s "
                     "for 1 KiB text rows")
        lines += [f"  - to raise the ceiling: {x}" for x in r["remedies"]]
    if rep["errors"]:
        lines += ["", "## Errors", "", *[f"- {e}" for e in rep["errors"]]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m croupier.bench.probe_mounts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--median-ms", type=float, default=5.0)
    p.add_argument("--out", type=Path, default=Path("bench/results/readpaths-bucket-mounts.md"))
    p.add_argument("--render", type=Path, help="rewrite --out from a JSON this script saved, without measuring")
    a = p.parse_args(argv)
    if a.render:
        a.out.write_text(markdown(json.loads(a.render.read_text()), []))
        return 0
    command = " ".join(["python -m croupier.bench.probe_mounts", *(sys.argv[1:] if argv is None else argv)])
    drive(a.out.stem, a.out.parent, command, lambda rep: measure(rep, a.median_ms), markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
