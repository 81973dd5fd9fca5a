"""Launch RTP worker programs as real processes on loopback gloo, bounded by a timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

WORKER = Path(__file__).resolve().parent / "rtp_workers.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmds: list[tuple[list[str], dict[str, str]]], out: Path, timeout: float) -> None:
    procs, logs = [], []
    for i, (cmd, env) in enumerate(cmds):
        log = out / f"log{i}.txt"
        logs.append(log)
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    failure = None
    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            failure = f"a worker exited with {codes}"
            break
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            failure = f"workers still running after {timeout}s"
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    tails = "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in logs)
    raise RuntimeError(f"{failure}\n{tails}")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def launch(scenario: str, nprocs: int, out: Path, timeout: float = 240.0) -> list[dict[str, Any]]:
    """One process per rank, rendezvous over env:// on a free loopback port."""
    port = str(_free_port())
    cmds = [([sys.executable, str(WORKER), scenario, str(out)],
             _env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
            for r in range(nprocs)]
    _run(cmds, out, timeout)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]


def launch_torchrun(scenario: str, nprocs: int, out: Path, timeout: float = 240.0) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
           str(WORKER), scenario, str(out)]
    _run([(cmd, _env())], out, timeout)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]
