"""What one read costs in CPU through croupier's read pool, against the floor, on the latency FS.

    python -m croupier.bench.readpool --out bench/results/readpool.md [--against REV]

Random reads of SIZE bytes, IN_FLIGHT at a time, of files on the latency file system
(bench/native, lognormal median 5 ms), the page cache of the files evicted before
each run. Each way of reading runs in its own process, alternated over rounds:

- `pool`: croupier's native read pool (server/storage/_preadpool.c) at this revision,
  driven from a uvloop loop the way the server drives it (`pread_ranges` + a callback);
- `pool-mmap`: the same pool reading by copies out of a read-only mapping of each file
  (the page faults taken on its threads: the second read path, server/storage/readpath.py);
- `pool-direct`: the same pool reading each file opened again with O_DIRECT (the third);
- `pool@REV` (with --against): the same, with the pool's C source of revision REV;
- `threads`: bench/native/rawreads.c, IN_FLIGHT threads doing blocking preads back
  to back: the least any pool of blocking threads costs;
- `io_uring`: the same program keeping IN_FLIGHT reads on an io_uring (built only where
  liburing's headers are installed: `apt-get install liburing-dev`).

`--max-background 0` mounts the latency FS with the kernel's default cap on background
FUSE requests (12), as most FUSE file systems are mounted; by default it is raised.
`--sync-dio` mounts it without async direct I/O (libfuse asks for it by default), so an
O_DIRECT read reaches the daemon as a synchronous request, outside that cap.

Reported per read: the process's CPU (for the pools, split into the event-loop thread and
the read threads, from the scheduler's per-thread counts) and the FUSE daemon's CPU, the
medians over rounds. The files are generated once (random bytes) under the cache folder.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import croupier.server.storage

from . import procstat
from .inflight import keep_in_flight
from .reporting import header_lines, num, run_header, utc

SOURCE = Path(__file__).resolve().parent / "native" / "rawreads.c"
# The product's pool, from the checkout the product is installed from (editable installs).
POOL_SOURCE = Path(croupier.server.storage.__file__).resolve().parent / "_preadpool.c"


def data_files(root: Path, files: int, mb: int) -> list[Path]:
    """`files` files of `mb` MB of random bytes (made once)."""
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(files):
        p = root / f"blob-{i:02d}.bin"
        if not p.exists() or p.stat().st_size != mb << 20:
            tmp = p.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                for _ in range(mb):
                    f.write(os.urandom(1 << 20))
            tmp.replace(p)
        out.append(p)
    return out


def build_raw(work: Path) -> dict[str, Path | str]:
    """{mode: binary, or why it is missing}."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return {"threads": "no C compiler", "io_uring": "no C compiler"}
    out: dict[str, Path | str] = {}
    plain = work / "rawreads"
    subprocess.run([cc, "-O2", "-o", str(plain), str(SOURCE), "-lpthread"], check=True)
    out["threads"] = plain
    uring = work / "rawreads-uring"
    r = subprocess.run([cc, "-O2", "-DWITH_URING", "-o", str(uring), str(SOURCE), "-lpthread", "-luring"],
                       capture_output=True, text=True)
    out["io_uring"] = uring if r.returncode == 0 else "liburing is not installed (apt-get install liburing-dev)"
    return out


def build_pool(rev: str, work: Path) -> Path:
    """The read pool's C source at git revision `rev`, compiled to a module in `work`."""
    src = subprocess.run(["git", "show", f"{rev}:server/storage/_preadpool.c"], capture_output=True, text=True,
                         check=True, cwd=POOL_SOURCE.parents[2]).stdout
    folder = work / f"pool-{rev}"
    folder.mkdir()
    (folder / "_preadpool.c").write_text(src)
    so = folder / ("_preadpool" + sysconfig.get_config_var("EXT_SUFFIX"))
    cc = shutil.which("cc") or shutil.which("gcc") or "cc"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", "-o", str(so),
                    str(folder / "_preadpool.c"), "-lpthread"], check=True)
    return so


# ---- the child: one run of a pool ------------------------------------------------------
async def _drive_pool(pool, fds: list[int], reads: int, in_flight: int, size: int, seed: int, maps=None,
                      directs=None) -> float:
    span = min(os.fstat(fd).st_size for fd in fds) - size
    rng = random.Random(seed)

    def start(landed) -> None:
        i = rng.randrange(len(fds))
        pool.pread_ranges(fds[i], "", [(rng.randrange(span), size)], lambda _parts, err: landed(err),
                          maps[i] if maps else None, directs[i] if directs else None)

    return await keep_in_flight(start, reads, in_flight)


def _ranges_one_by_one(pool_type: type) -> type:
    """A pool of a revision before `Pool.submit_ranges` (90984fd), driven by today's
    NativeReadPool: its ranges handed over one call each, as that revision's Python did."""

    class OneByOne:
        def __init__(self, max_threads: int):
            self._pool = pool_type(max_threads)

        def __getattr__(self, name: str):
            return getattr(self._pool, name)

        def submit_ranges(self, token0: int, target, ranges, align: int = 0) -> None:
            if not isinstance(target, int):
                raise TypeError("a pool of an earlier revision reads a mapping of its own module only: "
                                "--against runs preads")
            for i, (offset, size) in enumerate(ranges):
                if align > 0:
                    self._pool.submit_direct(token0 + i, target, offset, size, align)
                else:
                    self._pool.submit(token0 + i, target, offset, size)

    return OneByOne


def child(args: argparse.Namespace) -> int:
    import uvloop

    from croupier.server.storage import native

    if args.pool_so:
        spec = importlib.util.spec_from_file_location("_preadpool", args.pool_so)
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        native._NativePool = mod.Pool if hasattr(mod.Pool, "submit_ranges") else _ranges_one_by_one(mod.Pool)
    pool = native.NativeReadPool(args.in_flight * 2)
    fds = [os.open(f, os.O_RDONLY) for f in args.files]
    for fd in fds:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    maps = [native.Mapping(fd) for fd in fds] if args.read_path == "mmap" else None
    directs = [native.open_direct(f) for f in args.files] if args.read_path == "direct" else None
    before, t0 = procstat.thread_cpu(), procstat.cpu_seconds()
    seconds = uvloop.run(_drive_pool(pool, fds, args.reads, args.in_flight, args.size, args.seed, maps, directs))
    after, t1 = procstat.thread_cpu(), procstat.cpu_seconds()
    groups = procstat.thread_cpu_delta(before, after)
    loop_s = sum(cpu for tid, (_, _, _, cpu) in after.items() if tid == os.getpid()) - before[os.getpid()][3]
    # the process's tick count can round a short run to 0: the threads' exact counts, summed, bound it
    cpu = max(t1 - t0, sum(g["cpu"] for g in groups.values()))
    print(json.dumps({"reads": args.reads, "seconds": seconds, "cpu_s": cpu, "loop_s": loop_s,
                      "read_threads_s": groups.get("croupier-read", {}).get("cpu", 0.0)}))
    pool.close()
    return 0


# ---- the parent --------------------------------------------------------------------------
def run_one(mode: str, binary: Path | None, pool_so: Path | None, fs, files: list[Path], a: argparse.Namespace,
            seed: int) -> dict:
    mounted = [str(fs.path / f.name) for f in files]
    fs.evict()
    d0 = procstat.cpu_seconds(fs.pid)
    if binary is not None:
        cmd = [str(binary), mode, str(a.reads), str(a.in_flight), str(a.size), str(seed), *mounted]
    else:
        cmd = [sys.executable, "-m", "croupier.bench.readpool", "--child", "--reads", str(a.reads),
               "--in-flight", str(a.in_flight), "--size", str(a.size), "--seed", str(seed)]
        cmd += ["--pool-so", str(pool_so)] if pool_so is not None else []
        cmd += ["--read-path", mode.removeprefix("pool-")] if mode in ("pool-mmap", "pool-direct") else []
        cmd += mounted
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{mode}: {' '.join(cmd[:6])} ... failed: {r.stderr.strip()[-400:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["daemon_s"] = procstat.cpu_seconds(fs.pid) - d0
    if "cpu_s" not in out:
        out["cpu_s"] = out["user_s"] + out["system_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m croupier.bench.readpool", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="write the Markdown report here (and .json beside it)")
    p.add_argument("--against", action="append", default=[], metavar="REV",
                   help="also run the read pool's C source of this git revision (repeatable)")
    p.add_argument("--reads", type=int, default=20_000)
    p.add_argument("--in-flight", type=int, default=256)
    p.add_argument("--size", type=int, default=1100, help="bytes per read (about one text row)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--median-ms", type=float, default=5.0)
    p.add_argument("--data-dir", type=Path, default=Path.home() / ".cache" / "croupier" / "readpool-data")
    p.add_argument("--files", type=int, default=8, help="files of 64 MB to read from")
    p.add_argument("--max-background", type=int, default=None,
                   help="the latency FS's cap on background FUSE requests (0: the kernel's default, 12; default: raised)")
    p.add_argument("--sync-dio", action="store_true",
                   help="mount the latency FS without async direct I/O: O_DIRECT reads outside max_background")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--read-path", default="pread", help=argparse.SUPPRESS)
    p.add_argument("--pool-so", default="", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        a.files = a.paths
        return child(a)

    from . import latencyfs

    reason = latencyfs.check_available()
    if reason:
        print(f"latency file system unavailable: {reason}", file=sys.stderr)
        return 2
    files = data_files(a.data_dir, a.files, 64)
    started = time.time()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="readpool-") as tmp:
        work = Path(tmp)
        raw = build_raw(work)
        modes: list[tuple[str, Path | None, Path | None]] = [("pool", None, None), ("pool-mmap", None, None),
                                                             ("pool-direct", None, None)]
        modes += [(f"pool@{rev}", None, build_pool(rev, work)) for rev in a.against]
        skipped = {}
        for m in ("threads", "io_uring"):
            if isinstance(raw[m], Path):
                modes.append((m, raw[m], None))  # type: ignore[arg-type]
            else:
                skipped[m] = raw[m]
        results: dict[str, list[dict]] = {m: [] for m, _, _ in modes}
        with latencyfs.mounted(a.data_dir, median_ms=a.median_ms, max_background=a.max_background,
                               async_dio=not a.sync_dio) as fs:
            for rnd in range(a.rounds):
                for mode, binary, so in modes:
                    r = run_one(mode.split("@")[0], binary, so, fs, files, a, seed=rnd)
                    results[mode].append(r)
                    print(f"round {rnd + 1}/{a.rounds} {mode}: {r['reads'] / r['seconds']:,.0f} reads/s, "
                          f"{1e6 * r['cpu_s'] / r['reads']:.1f} us CPU/read (daemon {1e6 * r['daemon_s'] / r['reads']:.1f})",
                          flush=True)
    report = summarize(results, skipped, a, started, load0, os.getloadavg())
    print(report["markdown"])
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(report["markdown"])
        a.out.with_suffix(".json").write_text(json.dumps({k: v for k, v in report.items() if k != "markdown"}, indent=1))
    return 0


def summarize(results: dict[str, list[dict]], skipped: dict[str, str], a: argparse.Namespace, started: float,
              load0: tuple, load1: tuple) -> dict:
    def med(rs: list[dict], key: str) -> float | None:
        vals = [r[key] / r["reads"] * 1e6 for r in rs if key in r]
        return statistics.median(vals) if vals else None

    rows = {}
    for mode, rs in results.items():
        rows[mode] = {"reads_per_s": statistics.median(r["reads"] / r["seconds"] for r in rs),
                      "cpu_us": med(rs, "cpu_s"), "loop_us": med(rs, "loop_s"),
                      "read_threads_us": med(rs, "read_threads_s"), "daemon_us": med(rs, "daemon_s"), "runs": rs}
    cmd = ("python -m croupier.bench.readpool" + "".join(f" --against {r}" for r in a.against)
           + (f" --max-background {bg}" if (bg := getattr(a, "max_background", None)) is not None else "")
           + (" --sync-dio" if getattr(a, "sync_dio", False) else "") + (f" --out {a.out}" if a.out else ""))
    header = {**run_header(cmd), "started": utc(started), "load": {"start": list(load0), "end": list(load1)}}
    fmt = lambda v: num(v, ".1f")  # noqa: E731
    lines = [
        "# Read pool: CPU per read on the latency FS", "",
        *header_lines(header),
        f"{a.reads:,} random reads of {a.size:,} bytes, {a.in_flight} in flight, over {a.files} files of 64 MB on "
        f"latencyfs (lognormal median {a.median_ms:g} ms, sigma 0.5, max_background "
        f"{'raised' if bg is None else bg or 'the kernel default, 12'}"
        f"{', direct I/O synchronous' if getattr(a, 'sync_dio', False) else ''}); page cache of the files evicted before each run; "
        f"{a.rounds} rounds, modes alternated; medians. The load average counts the runs' own threads blocked in "
        "reads.", "",
        "| way of reading | reads/s | process CPU us/read | event loop | read threads | FUSE daemon us/read |",
        "|---|---|---|---|---|---|",
    ]
    for mode, r in rows.items():
        lines.append(f"| {mode} | {r['reads_per_s']:,.0f} | {fmt(r['cpu_us'])} | {fmt(r['loop_us'])} | "
                     f"{fmt(r['read_threads_us'])} | {fmt(r['daemon_us'])} |")
    for m, why in skipped.items():
        lines.append(f"| {m} | not run: {why} | | | | |")
    lines += ["", "`pool`: croupier's read pool driven from a uvloop loop as the server drives it (the loop's "
              "column is submitting and draining in Python); `threads`: blocking preads back to back on "
              f"{a.in_flight} threads in C (no hand-off at all); `io_uring`: one ring in C.", ""]
    return {"rows": rows, "skipped": skipped, **header, "markdown": "\n".join(lines)}


if __name__ == "__main__":
    sys.exit(main())
