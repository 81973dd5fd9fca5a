"""The demo's processes: a croupier server and the trainer ranks, started and stopped cleanly.

Every wait here is bounded: the server must be ready within `ready_timeout_s`, the
ranks must finish within `timeout_s`, and a process that ignores SIGTERM is killed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on `host` (for the rendezvous of torch.distributed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> int:
    """SIGTERM, wait up to `grace_s`, then SIGKILL; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class ServerProcess:
    """`croupier serve` on a free loopback port, ready once it has written its ready file."""

    def __init__(self, datasets: Sequence[str], workdir: Path, extra_args: Sequence[str] = (), port: int = 0,
                 name: str = "server", host: str = "127.0.0.1"):
        self.workdir = workdir
        self.ready_file = workdir / f"{name}-ready.json"
        self.log = workdir / f"{name}.log"
        self.cmd = [sys.executable, "-m", "croupier.cli", "serve", *datasets, "--host", host, "--port", str(port),
                    "--ready-file", str(self.ready_file), "--grace", "5", *extra_args]
        self.proc: subprocess.Popen | None = None
        self.port = port
        self.metrics_port: int | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, ready_timeout_s: float = 60.0) -> "ServerProcess":
        self.ready_file.unlink(missing_ok=True)  # a restart waits for its own readiness
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + ready_timeout_s
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"croupier serve exited with {self.proc.returncode}:\n{tail(self.log)}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"croupier serve was not ready in {ready_timeout_s:.0f}s:\n{tail(self.log)}")
            time.sleep(0.05)
        ready = json.loads(self.ready_file.read_text())
        self.port, self.metrics_port = int(ready["port"]), ready.get("metrics_port")
        return self

    def stop(self) -> int | None:
        return None if self.proc is None else stop_process(self.proc, grace_s=15)


class RankGroup:
    """`world_size` trainer processes rendezvousing through torch.distributed's env variables.

    Rank 0 writes to this terminal (its progress bar and summary); the others to log
    files shown only if something fails.
    """

    def __init__(self, module: str, argv: Sequence[str], world_size: int, workdir: Path):
        self.world_size = world_size
        self.workdir = workdir
        port = free_port()
        threads = max(1, (os.cpu_count() or 1) // world_size)
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path | None] = []
        for rank in range(world_size):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                   "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                   "OMP_NUM_THREADS": str(threads)}
            log = None if rank == 0 else workdir / f"rank{rank}.log"
            out = None if log is None else open(log, "wb")
            try:
                self.procs.append(subprocess.Popen([sys.executable, "-m", module, *argv], env=env,
                                                   stdout=out, stderr=subprocess.STDOUT if out else None,
                                                   stdin=subprocess.DEVNULL))
            finally:
                if out is not None:
                    out.close()
            self.logs.append(log)

    def wait(self, timeout_s: float) -> list[int]:
        """Exit codes of all ranks; if one fails or time runs out, the others are stopped."""
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self.procs):
            failed = any(p.returncode not in (None, 0) for p in self.procs)
            if failed or time.monotonic() > deadline:
                self.stop()
                break
            time.sleep(0.1)
        return [p.returncode for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            stop_process(p, grace_s=10)

    def failure_report(self) -> str:
        parts = []
        for rank, (p, log) in enumerate(zip(self.procs, self.logs)):
            if p.returncode != 0 and log is not None:
                parts.append(f"--- rank {rank} (exit {p.returncode}) ---\n{tail(log)}")
        return "\n".join(parts)
