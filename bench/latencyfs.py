"""latencyfs: really slow storage for benchmarks, as a FUSE mount (Linux only).

A read-only passthrough of a source folder whose every `read()` request sleeps for a
seeded random delay (bench/native/latencyfs.c, libfuse3). Every system we
benchmark reads the same files through the kernel and so pays the same latency.

    from croupier.bench import latencyfs

    reason = latencyfs.check_available()        # None when usable, else why not
    with latencyfs.mounted("/data/src", median_ms=5, sigma=0.5, seed=0) as fs:
        run_benchmark(fs.path)
        print(fs.stats()["requests"], fs.stats()["max_in_flight"])

    python -m croupier.bench.latencyfs mount SRC MNT --median-ms 5   # until Ctrl-C
    python -m croupier.bench.latencyfs mount SRC MNT --max-background 0  # kernel's cap (12)
    python -m croupier.bench.latencyfs stats MNT
    python -m croupier.bench.latencyfs evict MNT                     # make every file cold
    python -m croupier.bench.latencyfs check

See bench/native/README.md for the delay distributions, the statistics file,
and what readahead and the page cache do to the requests.

`max_background` is the kernel's per-mount cap on *background* FUSE requests, which is
how buffered reads and readahead reach the daemon. By default latencyfs raises it to its
thread count, so the cap never limits a benchmark; `max_background=KERNEL_DEFAULT` (0)
keeps the kernel's default of 12 (congestion at 9), as s3fs, rclone, gcsfuse and most FUSE
file systems are mounted, and any other number sets that cap.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from croupier.server.storage.mounts import unescape  # mountinfo's \ooo escapes

DISTRIBUTIONS = ("fixed", "uniform", "lognormal")
STATS_FILE = ".latencyfs-stats"
RESET_FILE = ".latencyfs-reset"
#: `max_background` value that keeps the kernel's default cap (12 background requests).
KERNEL_DEFAULT = 0
APT_PACKAGES = "fuse3 libfuse3-dev pkg-config"
_NATIVE = Path(__file__).resolve().parent / "native"  # C sources ship beside the harness
_INSTALL_HINT = (f"install them with `sudo apt-get install {APT_PACKAGES}` "
                 f"(or run bench/native/install-deps.sh as root)")


def source_file() -> Path:
    """The C source: $CROUPIER_LATENCYFS_SOURCE, else native/latencyfs.c beside this module."""
    env = os.environ.get("CROUPIER_LATENCYFS_SOURCE")
    return Path(env) if env else _NATIVE / "latencyfs.c"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "croupier" / "latencyfs"


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def _pkg_config_fuse3() -> list[str]:
    out = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"],
                         capture_output=True, text=True, check=True).stdout
    return shlex.split(out)


def build(source: str | os.PathLike | None = None, *, force: bool = False) -> Path:
    """Compile latencyfs.c (once per source text and flags) and return the binary's path.

    The binary lives at ~/.cache/croupier/latencyfs/<hash>/latencyfs, where the hash
    covers the source, the compiler and the fuse3 flags. Raises RuntimeError with the
    compiler's message when it cannot be built.
    """
    src = Path(source) if source is not None else source_file()
    if not src.is_file():
        raise RuntimeError(f"latencyfs source not found at {src} (a croupier source checkout is "
                           f"needed, or set CROUPIER_LATENCYFS_SOURCE)")
    cc = _compiler()
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc}) on PATH: install gcc (`sudo apt-get install gcc`)")
    if shutil.which("pkg-config") is None:
        raise RuntimeError(f"pkg-config is missing: {_INSTALL_HINT}")
    try:
        flags = _pkg_config_fuse3()
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"libfuse3 development files are missing (pkg-config fuse3: "
                           f"{e.stderr.strip() or 'not found'}): {_INSTALL_HINT}") from None
    cmd_tail = ["-O2", "-Wall", *flags, "-lm", "-pthread"]
    text = src.read_bytes()
    digest = hashlib.sha256(text + b"\0" + " ".join([cc, *cmd_tail]).encode()).hexdigest()[:16]
    out_dir = cache_root() / digest
    binary = out_dir / "latencyfs"
    if binary.is_file() and os.access(binary, os.X_OK) and not force:
        return binary
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".latencyfs.{os.getpid()}.{threading.get_ident()}"
    cmd = [cc, "-O2", "-Wall", "-o", str(tmp), str(src), *flags, "-lm", "-pthread"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"compiling latencyfs failed ({shlex.join(cmd)}):\n{res.stderr.strip()[-2000:]}")
    os.replace(tmp, binary)  # atomic: concurrent builders never see half a binary
    return binary


# ---- availability ---------------------------------------------------------------

_available: dict[str, str | None] = {}
_available_lock = threading.Lock()


def check_available(refresh: bool = False) -> str | None:
    """None when latencyfs can be built and mounted here, else a human reason why not.

    Checks, in order: Linux, /dev/fuse, the source, a compiler, pkg-config and the
    libfuse3 headers, fusermount3, the build, and finally a trial mount of an empty
    folder. The answer is cached for the process (`refresh=True` asks again).
    """
    with _available_lock:
        if refresh or "reason" not in _available:
            _available["reason"] = _check()
        return _available["reason"]


def _check() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"latencyfs needs Linux FUSE (this is {sys.platform})"
    if not os.path.exists("/dev/fuse"):
        return ("/dev/fuse does not exist: load the fuse module (`modprobe fuse`); in docker run with "
                "`--device /dev/fuse --cap-add SYS_ADMIN`")
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as e:
        return (f"cannot open /dev/fuse as uid {os.getuid()} ({e.strerror}): it should be mode 0666 (most "
                f"distributions' default) or run as root; in docker run with "
                f"`--device /dev/fuse --cap-add SYS_ADMIN`")
    if shutil.which("fusermount3") is None:
        return f"fusermount3 is missing (apt package fuse3): {_INSTALL_HINT}"
    try:
        binary = build()
    except RuntimeError as e:
        return str(e)
    try:
        with tempfile.TemporaryDirectory(prefix="latencyfs-check-") as tmp:
            src = Path(tmp) / "src"
            src.mkdir()
            (src / "probe").write_bytes(b"latencyfs")
            with mounted(src, Path(tmp) / "mnt", median_ms=0, distribution="fixed",
                         binary=binary, timeout=10) as fs:
                if (fs.path / "probe").read_bytes() != b"latencyfs":
                    return "a trial mount returned wrong bytes"
    except (RuntimeError, OSError) as e:
        return f"mounting a FUSE file system is not permitted here: {e}"
    return None


# ---- mounts -----------------------------------------------------------------------

def is_mounted(path: str | os.PathLike) -> bool:
    """Whether `path` is a mount point now (by /proc/self/mountinfo: a dead FUSE daemon's
    mount still counts, where os.path.ismount would say False)."""
    target = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split(" ")
                if len(fields) > 4 and unescape(fields[4]) == target:
                    return True
    except OSError:
        return os.path.ismount(target)
    return False


def _run_quiet(cmd: list[str]) -> None:
    if shutil.which(cmd[0]):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(cmd, capture_output=True, timeout=30)


def _unmount(path: str) -> str | None:
    """'clean', 'lazy' (it was busy: detached now, the daemon lives on until its files
    close), or None when still mounted."""
    for cmd in (["fusermount3", "-u", "-q", path], ["umount", path]):
        if not is_mounted(path):
            return "clean"
        _run_quiet(cmd)
    for cmd in (["fusermount3", "-u", "-z", "-q", path], ["umount", "-l", path]):
        if not is_mounted(path):
            return "lazy"
        _run_quiet(cmd)
    return None if is_mounted(path) else "lazy"


def unmount(path: str | os.PathLike) -> bool:
    """Unmount `path`: fusermount3 -u (or umount), then a lazy unmount if it is busy.
    True when it is no longer mounted."""
    return _unmount(os.path.realpath(path)) is not None


class LatencyFS:
    """A live latencyfs mount: `.path` to read through, `.stats()`, `.reset_stats()`."""

    def __init__(self, path: Path, source: Path, process: subprocess.Popen, config: dict, log: Path):
        self.path = path
        self.source = source
        self.process = process
        self.config = config
        self.log = log

    @property
    def pid(self) -> int:
        return self.process.pid

    def stats(self) -> dict:
        """A JSON snapshot of the daemon's counters (not delayed, not counted):
        requests, bytes, in_flight, max_in_flight, delay_ms_total, slept_ms_total,
        pread_ms_total, errors, opens, max_request_bytes, request_sizes, threads_seen,
        caller_tids (the thread ids whose reads reached the daemon since the last reset),
        resets, config, kernel (negotiated FUSE parameters; max_background 0: the
        kernel's default, 12), libfuse, pid, uptime_s."""
        with open(self.path / STATS_FILE, "rb") as f:
            return json.loads(f.read())

    def reset_stats(self) -> None:
        """Zero the counters and restart the delay sequence at k = 0; max_in_flight
        restarts at the reads in flight now. Synchronous: done when this returns."""
        with open(self.path / RESET_FILE, "rb") as f:
            f.read()

    def evict(self, paths: Sequence[str | os.PathLike] | None = None) -> int:
        """Make files cold again: drop the kernel's cached pages of every file under
        `paths` (default: the whole mount), also pages other processes have mapped.

        Without keep_cache, each open() through FUSE invalidates that file's page cache
        (unmapping mapped pages too), so this opens and closes each file: no root needed,
        works in containers where drop_caches is read-only. Returns the files touched."""
        n = 0
        for root in [self.path] if paths is None else [Path(p) for p in paths]:
            walk = [(str(root), [], [""])] if root.is_file() else os.walk(root)
            for folder, _, names in walk:
                for name in names:
                    f = os.path.join(folder, name) if name else folder
                    if os.path.islink(f):
                        continue
                    with contextlib.suppress(OSError):
                        os.close(os.open(f, os.O_RDONLY))
                        n += 1
        return n

    def threads(self) -> int:
        """The daemon's thread count now (libfuse starts workers on demand)."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
        return 0

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"LatencyFS({str(self.source)!r} -> {str(self.path)!r}, pid={self.pid}, {self.config})"


def daemon_args(*, median_ms: float, sigma: float = 0.5, distribution: str = "lognormal",
                seed: int = 0, max_threads: int = 1024, max_background: int | None = None,
                async_dio: bool = True) -> list[str]:
    """The daemon's options. `max_background`: None raises the kernel's cap on background
    requests to `max_threads` (the default), KERNEL_DEFAULT (0) keeps the kernel's 12, N sets N.
    `async_dio=False`: O_DIRECT reads reach the daemon as synchronous requests (--sync-dio)."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, not {distribution!r}")
    if median_ms < 0 or sigma < 0:
        raise ValueError("median_ms and sigma must be >= 0")
    if max_background is not None and not 0 <= max_background <= 65535:
        raise ValueError(f"max_background must be 0 (the kernel's default) to 65535, not {max_background}")
    args = ["--median-ms", repr(float(median_ms)), "--sigma", repr(float(sigma)),
            "--distribution", distribution, "--seed", str(int(seed)), "--max-threads", str(int(max_threads))]
    if max_background is not None:
        args += ["--max-background", str(int(max_background))]
    if not async_dio:
        args.append("--sync-dio")
    return args


@contextlib.contextmanager
def mounted(source: str | os.PathLike, mountpoint: str | os.PathLike | None = None, *,
            median_ms: float, sigma: float = 0.5, distribution: str = "lognormal", seed: int = 0,
            max_threads: int = 1024, max_background: int | None = None, fuse_options: Sequence[str] = (),
            binary: str | os.PathLike | None = None, timeout: float = 20.0,
            async_dio: bool = True) -> Iterator[LatencyFS]:
    """Mount `source` read-only at `mountpoint` (a fresh temporary folder when None) with
    every read request delayed, and yield a LatencyFS once the mount answers.

    On exit, also when the body raised: unmount (fusermount3 -u, then lazy), reap the
    daemon (SIGTERM, then SIGKILL), and remove the mount point if it was created here.
    `fuse_options` go to the daemon as `-o` options (e.g. "max_read=65536", "allow_other").
    `max_background`: None (default) raises the kernel's cap on background requests to
    `max_threads`; KERNEL_DEFAULT (0) keeps the kernel's 12, as most FUSE mounts have it.
    """
    src = Path(source).resolve()
    if not src.is_dir():
        raise FileNotFoundError(f"latencyfs source folder {src} does not exist")
    args = daemon_args(median_ms=median_ms, sigma=sigma, distribution=distribution,
                       seed=seed, max_threads=max_threads, max_background=max_background, async_dio=async_dio)
    exe = Path(binary) if binary is not None else build()
    work = Path(tempfile.mkdtemp(prefix="latencyfs-"))
    created: Path | None = None
    if mountpoint is None:
        mnt = created = work / "mnt"
        mnt.mkdir()
    else:
        mnt = Path(mountpoint)
        if not mnt.exists():
            mnt.mkdir(parents=True)
            created = mnt
        mnt = mnt.resolve()
    log = work / "latencyfs.log"
    cmd = [str(exe), "-f", *args]
    if threading.current_thread() is threading.main_thread():
        # PR_SET_PDEATHSIG fires when the spawning *thread* ends, so only from the main thread
        cmd.append("--die-with-parent")
    for opt in fuse_options:
        cmd += ["-o", opt]
    cmd += [str(src), str(mnt)]
    config = {"median_ms": median_ms, "sigma": sigma, "distribution": distribution, "seed": seed,
              "max_threads": max_threads, "max_background": max_background}
    proc: subprocess.Popen | None = None
    try:
        with open(log, "wb") as logf:
            # own session: a terminal's Ctrl-C reaches us, and we unmount in order
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                    start_new_session=True)
        fs = LatencyFS(mnt, src, proc, config, log)
        _wait_live(fs, timeout)
        yield fs
    finally:
        try:
            if proc is not None:
                _stop(proc, mnt)
        finally:
            if created is not None and not is_mounted(created):
                with contextlib.suppress(OSError):
                    created.rmdir()
            if not is_mounted(mnt):
                shutil.rmtree(work, ignore_errors=True)


def _log_tail(fs: LatencyFS) -> str:
    try:
        return fs.log.read_text(errors="replace").strip()[-2000:]
    except OSError:
        return ""


def _wait_live(fs: LatencyFS, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        rc = fs.process.poll()
        if rc is not None:
            raise RuntimeError(f"latencyfs exited with status {rc} before mounting {fs.path}: "
                               f"{_log_tail(fs) or '(no output)'}")
        if is_mounted(fs.path):
            with contextlib.suppress(OSError, ValueError):
                if fs.stats().get("pid") == fs.pid:
                    return
        if time.monotonic() > deadline:
            raise RuntimeError(f"latencyfs did not mount {fs.path} within {timeout:.0f}s: {_log_tail(fs)}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _stop(proc: subprocess.Popen, mnt: Path) -> None:
    try:
        how = _unmount(str(mnt))  # after a clean unmount the daemon's loop ends by itself
        if how != "clean" and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # busy (lazy) or stuck: the daemon exits and unmounts
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                proc.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                proc.send_signal(sig)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if is_mounted(mnt):  # a killed daemon leaves "Transport endpoint is not connected"
            _unmount(str(mnt))


# ---- page cache -------------------------------------------------------------------

def drop_page_cache() -> bool:
    """sync, then `echo 3 > /proc/sys/vm/drop_caches`: True when it worked, False where it
    is not permitted (not root, or a container's read-only /proc/sys).

    For files read through a latencyfs mount it is not needed: `LatencyFS.evict()` makes
    them cold without root (each open() through the mount drops that file's pages). Where
    neither applies, a benchmark must rely on a data set much larger than what one run
    touches, and report the daemon's `requests` next to the reads it made."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def print_delays(k: int, *, median_ms: float, sigma: float = 0.5, distribution: str = "lognormal",
                 seed: int = 0, binary: str | os.PathLike | None = None) -> list[float]:
    """The first `k` delays (ms) the daemon would apply with these settings, without mounting."""
    exe = Path(binary) if binary is not None else build()
    args = daemon_args(median_ms=median_ms, sigma=sigma, distribution=distribution, seed=seed)
    out = subprocess.run([str(exe), "--print-delays", str(int(k)), *args],
                         capture_output=True, text=True, check=True).stdout
    return [float(x) for x in out.split()]


# ---- CLI --------------------------------------------------------------------------

def _add_delay_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--median-ms", type=float, default=5.0, help="median delay per read request (default 5)")
    p.add_argument("--sigma", type=float, default=0.5, help="lognormal sigma (default 0.5)")
    p.add_argument("--distribution", choices=DISTRIBUTIONS, default="lognormal")
    p.add_argument("--seed", type=int, default=0)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m croupier.bench.latencyfs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("mount", help="mount SRC at MNT and stay in the foreground until Ctrl-C")
    p.add_argument("source")
    p.add_argument("mountpoint")
    _add_delay_args(p)
    p.add_argument("--max-threads", type=int, default=1024)
    p.add_argument("--max-background", type=int, default=None,
                   help="kernel cap on background FUSE requests (default: --max-threads; 0: the kernel's default, 12)")
    p.add_argument("-o", dest="fuse_options", action="append", default=[], help="FUSE mount option")
    p = sub.add_parser("stats", help="print a mount's statistics (JSON)")
    p.add_argument("mountpoint")
    p = sub.add_parser("reset", help="reset a mount's statistics")
    p.add_argument("mountpoint")
    p = sub.add_parser("evict", help="drop the page cache of every file under MNT (no root needed)")
    p.add_argument("mountpoint")
    p = sub.add_parser("unmount", help="unmount (fusermount3 -u, then lazy)")
    p.add_argument("mountpoint")
    p = sub.add_parser("delays", help="print the first K delays (ms) without mounting")
    p.add_argument("k", type=int)
    _add_delay_args(p)
    sub.add_parser("build", help="compile the daemon and print its path")
    sub.add_parser("check", help="say whether latencyfs is usable here, and why not")
    a = ap.parse_args(argv)

    if a.cmd == "build":
        print(build())
    elif a.cmd == "check":
        reason = check_available()
        print(reason or "latencyfs is usable here")
        return 1 if reason else 0
    elif a.cmd == "stats":
        print(json.dumps(json.loads((Path(a.mountpoint) / STATS_FILE).read_bytes()), indent=2))
    elif a.cmd == "reset":
        (Path(a.mountpoint) / RESET_FILE).read_bytes()
    elif a.cmd == "evict":
        n = 0
        for folder, _, names in os.walk(a.mountpoint):
            for name in names:
                with contextlib.suppress(OSError):
                    os.close(os.open(os.path.join(folder, name), os.O_RDONLY))
                    n += 1
        print(f"{n} files evicted")
    elif a.cmd == "unmount":
        return 0 if unmount(a.mountpoint) else 1
    elif a.cmd == "delays":
        for d in print_delays(a.k, median_ms=a.median_ms, sigma=a.sigma, distribution=a.distribution,
                              seed=a.seed):
            print(f"{d:.6f}")
    elif a.cmd == "mount":
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # also when started with SIGINT ignored
            signal.signal(sig, lambda *_: stop.set())
        with mounted(a.source, a.mountpoint, median_ms=a.median_ms, sigma=a.sigma,
                     distribution=a.distribution, seed=a.seed, max_threads=a.max_threads,
                     max_background=a.max_background, fuse_options=a.fuse_options) as fs:
            print(f"latencyfs: {fs.source} -> {fs.path} ({a.distribution}, median {a.median_ms} ms, "
                  f"sigma {a.sigma}, seed {a.seed}), daemon pid {fs.pid}; Ctrl-C to unmount", flush=True)
            try:
                while not stop.wait(0.5):
                    if fs.process.poll() is not None:
                        print(f"latencyfs: the daemon exited ({fs.process.returncode})", file=sys.stderr)
                        return 1
            except KeyboardInterrupt:
                pass
        print("latencyfs: unmounted", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
