"""One case: a system's ranks (one runner process each) over one storage condition, watched.

The harness starts the ranks at once, reads their JSON lines (runners/_common.py), and polls
every `period` seconds what the issue asks of the trainer's machine: the bytes under the
local cache folder (peak local disk) and the resident memory of every process the system
runs there (ranks, their DataLoader workers, a croupier server: peak RSS, summed).

tf.data service runs as one `group` process in a network namespace with only loopback
(run_group); on S3 that namespace reaches the S3 server on the host's loopback through S3Relay,
a Unix socket that a relay process joins to the server (runners/_relay.py has the inner half).
The relay process is not counted in the RSS: it stands in for the network.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

RUNNERS = Path(__file__).parent / "runners"


def dir_bytes(path: str | os.PathLike) -> int:
    """Bytes of the files under `path` (what the cache holds on disk now); 0 if absent."""
    total = 0
    stack = [str(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            total += e.stat(follow_symlinks=False).st_blocks * 512
                    except OSError:
                        continue  # evicted meanwhile
        except OSError:
            continue
    return total


def tree_pids(root: int) -> list[int]:
    """`root` and its descendants (over every thread's children)."""
    out, stack = [], [root]
    while stack:
        pid = stack.pop()
        out.append(pid)
        try:
            for task in os.scandir(f"/proc/{pid}/task"):
                try:
                    with open(f"{task.path}/children") as f:
                        stack += [int(c) for c in f.read().split()]
                except OSError:
                    continue
        except OSError:
            continue
    return out


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Watcher:
    """Peak local disk of the cache folders and peak summed RSS of the process trees."""

    def __init__(self, folders: list[str], period: float = 0.1):
        self.folders, self.period = folders, period
        self.roots: list[int] = []
        self.peak_disk = 0
        self.peak_rss = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peers-watcher", daemon=True)

    def _sample(self) -> None:
        self.peak_disk = max(self.peak_disk, sum(dir_bytes(f) for f in self.folders))
        pids = {p for r in list(self.roots) for p in tree_pids(r)}
        self.peak_rss = max(self.peak_rss, sum(rss_mb(p) for p in pids))
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def __enter__(self) -> "Watcher":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)


class RankProc:
    """One runner process; its stdout lines parsed on a thread as they come."""

    def __init__(self, python: str, script: str, job: dict[str, Any] | list[dict[str, Any]], env: dict[str, str],
                 log: Path, prefix: tuple[str, ...] = (), command: str = "read"):
        self.events: list[dict[str, Any]] = []
        self._log = open(log, "a")
        self._log.write(f"\n=== {script} {command}: {json.dumps(job)[:400]}\n")
        self._log.flush()
        self.proc = subprocess.Popen([*prefix, python, str(RUNNERS / script), command, json.dumps(job)], cwd=str(RUNNERS),
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                try:
                    self.events.append(json.loads(line))
                except ValueError:
                    self._log.write(f"(unparsed) {line[:200]}\n")
            elif line:
                self._log.write(line + "\n")

    def wait(self, deadline: float) -> int | None:
        try:
            rc = self.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None
        if rc < 0:  # killed (the resume case's SIGKILL): its workers go with it, as under a launcher. Grain's
            # spawned workers outlive their rank for seconds, holding its stdout open: the reader would wait.
            try:
                os.killpg(self.proc.pid, 9)
            except OSError:
                pass  # none left
        self._reader.join(10)
        return rc

    def kill(self) -> None:
        """The rank's whole session: its DataLoader workers outlive a rank that was SIGKILLed."""
        try:
            os.killpg(self.proc.pid, 9)
        except OSError:
            pass  # nothing left in it
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(10)

    def close(self) -> None:
        self._log.close()


def run_ranks(python: str, script: str, jobs: list[dict[str, Any]], env: dict[str, str], log: Path,
              timeout: float, watch: Watcher, expect_kill: bool = False) -> tuple[list[list[dict[str, Any]]], list[str]]:
    """Every rank at once; returns each rank's events and the problems seen (a rank that failed,
    ran past `timeout`, or was killed when no kill was asked for)."""
    procs = [RankProc(python, script, j, env, log) for j in jobs]
    watch.roots += [p.proc.pid for p in procs]
    deadline = time.monotonic() + timeout
    problems: list[str] = []
    try:
        for r, p in enumerate(procs):
            rc = p.wait(deadline)
            if rc is None:
                problems.append(f"rank {r} ran past {timeout:.0f} s and was killed")
                for q in procs:
                    q.kill()
                break
            if rc != 0 and not (expect_kill and rc == -9):
                said = "; ".join(e["text"] for e in p.events if e["ev"] == "error")
                problems.append(f"rank {r} exited with {rc}" + (f": {said}" if said else f"; see {log}"))
    finally:
        for p in procs:
            p.kill()
            p.close()
    return [p.events for p in procs], problems


class S3Relay:
    """The outer half of the way from a loopback-only network namespace to the S3 server
    (runners/_relay.py): a listening Unix socket in a fresh /tmp folder (a short path: the limit is
    108 bytes), handed to a relay process that joins each connection to the server's host:port.
    `path` is what the process in the namespace relays its own loopback port to."""

    def __init__(self, endpoint: str, log: Path):
        import socket
        import tempfile
        import urllib.parse

        url = urllib.parse.urlsplit(endpoint)
        if url.scheme != "http" or not url.hostname or not url.port:
            raise ValueError(f"the S3 relay needs an http://host:port endpoint, not {endpoint!r}")
        self.host, self.port = url.hostname, url.port
        self.dir = tempfile.mkdtemp(prefix="croupier-s3relay-")
        self.path = os.path.join(self.dir, "s3.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.path)
            listener.listen(256)  # listening before the relay starts: no connection is refused
            self._log = open(log, "a")
            self.proc = subprocess.Popen([sys.executable, str(RUNNERS / "_relay.py"), "unix-to-tcp",
                                          str(listener.fileno()), self.host, str(self.port)],
                                         pass_fds=[listener.fileno()], stdout=self._log, stderr=self._log,
                                         start_new_session=True)
        finally:
            listener.close()  # the relay holds its own copy

    def __enter__(self) -> "S3Relay":
        return self

    def __exit__(self, *exc: Any) -> None:
        import shutil

        self.proc.kill()
        self.proc.wait(10)
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def run_group(python: str, script: str, jobs: list[dict[str, Any]], env: dict[str, str], log: Path,
              timeout: float, watch: Watcher) -> tuple[list[list[dict[str, Any]]], list[str]]:
    """Every rank under one `group` process in a network namespace with only loopback (the
    tf.data service's servers bind every interface); its lines carry "rank". Jobs with an S3
    `endpoint` get a relay to it (S3Relay; its path in extra["s3_relay"]): the namespace cannot
    see the host's loopback, where the S3 server listens."""
    import shutil

    if shutil.which("unshare") is None or shutil.which("ip") is None:
        raise RuntimeError("needs `unshare` and `ip` (util-linux, iproute2) to keep its servers on loopback")
    endpoint = jobs[0].get("endpoint", "") if jobs else ""
    with (S3Relay(endpoint, log) if endpoint else contextlib.nullcontext()) as relay:
        if relay is not None:
            jobs = [{**j, "extra": {**j.get("extra", {}), "s3_relay": relay.path}} for j in jobs]
        proc = RankProc(python, script, jobs, env, log, prefix=("unshare", "--net"), command="group")
        watch.roots.append(proc.proc.pid)
        problems: list[str] = []
        try:
            rc = proc.wait(time.monotonic() + timeout)
            if rc is None:
                problems.append(f"ran past {timeout:.0f} s and was killed")
            elif rc != 0:
                said = "; ".join(e["text"] for e in proc.events if e["ev"] == "error")
                problems.append(f"exited with {rc}" + (f": {said}" if said else f"; see {log}"))
        finally:
            proc.kill()
            proc.close()
    ranks = [[e for e in proc.events if e.get("rank") == j["rank"]] for j in jobs]
    return ranks, problems


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- figures from the events ------------------------------------------------------------------

def per_epoch(ranks: list[list[dict[str, Any]]], epochs: int) -> list[dict[str, Any]]:
    """Per epoch: samples, wall seconds (from the first rank's start of the epoch to the last
    batch of any rank), samples/s, each rank's span on that clock, and each rank's batches (ids).
    Ranks meet at each epoch's end (runners/_common.epoch_barrier), so an epoch's clock starts
    once all have ended the one before."""
    out = []
    starts = [next((e["t"] for e in evs if e["ev"] == "start"), None) for evs in ranks]
    for epoch in range(epochs):
        batches = [[e for e in evs if e["ev"] == "batch" and e["epoch"] == epoch] for evs in ranks]
        begins = _rank_begins(ranks, epoch, starts)
        begin = [t for t in begins if t is not None]
        last = [b[-1]["t"] for b in batches if b]
        samples = sum(len(x["ids"]) for b in batches for x in b)
        wall = (max(last) - min(begin)) if last and begin else float("nan")
        out.append({"epoch": epoch, "samples": samples, "wall_s": wall,
                    "samples_per_s": samples / wall if wall and wall == wall and wall > 0 else float("nan"),
                    "rank_spans_s": [[round(t - min(begin), 3), round(b[-1]["t"] - min(begin), 3)]
                                     for t, b in zip(begins, batches) if b and t is not None],
                    "batches": [[x["ids"] for x in b] for b in batches],
                    "complete": all(any(e["ev"] == "epoch_end" and e["epoch"] == epoch and not e.get("cut") for e in evs)
                                    for evs in ranks),
                    "cut": any(e["ev"] == "epoch_end" and e["epoch"] == epoch and e.get("cut") for evs in ranks for e in evs)})
    return out


def _rank_begins(ranks: list[list[dict[str, Any]]], epoch: int, starts: list[float | None]) -> list[float | None]:
    """When each rank began `epoch`: its start (epoch 0), its pass of the barrier before it, or
    (a run without one) its end of the epoch before."""
    if epoch == 0:
        return starts
    return [next((e["t"] for e in evs if e["ev"] == "epoch_start" and e["epoch"] == epoch),
                 next((e["t"] for e in evs if e["ev"] == "epoch_end" and e["epoch"] == epoch - 1), None))
            for evs in ranks]


def first_batch_s(ranks: list[list[dict[str, Any]]]) -> float:
    """The slowest rank's wait from building its loader to its first batch."""
    waits = []
    for evs in ranks:
        start = next((e["t"] for e in evs if e["ev"] == "start"), None)
        first = next((e["t"] for e in evs if e["ev"] == "batch"), None)
        if start is not None and first is not None:
            waits.append(first - start)
    return max(waits) if waits else float("nan")


def job_dict(job: Any, **changes: Any) -> dict[str, Any]:
    return asdict(replace(job, **changes))
