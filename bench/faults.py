"""Faults on purpose, with the samples counted: replicas killed and restarted, connections
cut, trainers killed and resumed from `state_dict()`.

Each run returns how many samples the trainers should have received and how many were
lost and duplicated (the goal is 0 and 0). The test suite runs these at small sizes; the
reliability report (`croupier bench --suite reliability`) at the sizes it states.

Everything listens on 127.0.0.1 only, and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from croupier.demo.procs import ServerProcess, free_port, tail

#: Slow enough that an epoch of a few thousand rows spans the faults, on any machine.
#: This injected latency only paces the run; it measures nothing.
PACED = ["--latency-ms", "3", "--latency-distribution", "fixed", "--max-reads-per-stream", "8", "--prefetch", "1",
         "--grace", "0", "--drain-notice", "0"]

#: Faults fall at least this many batches (of all ranks) before the epoch's end: a rank
#: has more of its stream left than the client buffers (buffer_batches, one 64 KiB
#: window, the server's prefetch), so its stream is still open.
TAIL = 20


@dataclass
class FaultResult:
    what: str
    faults: int
    expected: int
    delivered: int
    lost: int
    duplicated: int
    reconnects: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and self.delivered == self.expected

    def summary(self) -> str:
        return (f"{self.what}: {self.faults} faults, {self.expected:,} samples expected, {self.delivered:,} delivered, "
                f"{self.lost} lost, {self.duplicated} duplicated ({self.reconnects} reconnects, {self.seconds:.0f}s)")


def count(expected: Sequence[int], delivered: Sequence[int]) -> tuple[int, int]:
    """(lost, duplicated): indices of `expected` never delivered, and deliveries beyond one."""
    seen, wanted = Counter(delivered), set(expected)
    lost = sum(1 for i in wanted if seen[i] == 0)
    duplicated = sum(n - 1 for n in seen.values() if n > 1) + sum(n for i, n in seen.items() if i not in wanted)
    return lost, duplicated


class _Rank(threading.Thread):
    """One trainer rank in a thread; consumes a batch only while `gate()` allows."""

    def __init__(self, loader, gate: Callable[[], None], on_batch: Callable[[], None]):
        super().__init__(daemon=True)
        self.loader, self.gate, self.on_batch = loader, gate, on_batch
        self.indices: list[int] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for b in self.loader.batches():
                self.indices += b.indices[~b.padding].tolist()
                self.on_batch()
                self.gate()
        except BaseException as exc:  # reported by the caller
            self.error = exc


def _open_streams(server: ServerProcess) -> float:
    """The server's croupier_active_streams gauge (0 if it does not answer)."""
    from .promscrape import scrape

    try:
        samples = scrape(server.metrics_port, timeout=5)  # type: ignore[arg-type]
    except OSError:
        return 0.0
    return sum(v for name, _, v in samples if name.startswith("croupier_active_streams"))


def replica_churn(workdir: Path, *, kills: int = 20, seed: int = 0, rows: int = 4000, world: int = 2,
                  batch_size: int = 16, row_bytes: int = 8192,
                  log: Callable[[str], None] = lambda s: None) -> FaultResult:
    """Two replicas serve `world` ranks; one of them (the one serving more ranks) is killed
    (SIGKILL or SIGTERM, drawn) at `kills` random points of the epoch and restarted on its
    port. Rows are large enough (`row_bytes`), and each stream's flow-control window
    small enough (no BDP probing: 64 KiB), that a rank's stream cannot run ahead into the
    client's buffers and be over before the fault; the faults fall at least `TAIL`
    batches before the epoch's end, and each waits until a replica has a stream open, so
    every one of them cuts live streams."""
    from croupier.client import Loader, RetryPolicy

    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    dataset = f"rows=synthetic:{rows}:{row_bytes}"
    replicas = [ServerProcess([dataset], workdir, [*PACED, "--metrics-port", "0"], port=free_port(),
                              name=f"replica{i}").start() for i in range(2)]
    servers = [r.address for r in replicas]
    batches_total = world * -(-rows // (batch_size * world))  # batches of all ranks in the epoch
    points = sorted(rng.sample(range(2, batches_total - TAIL), kills))
    lock = threading.Condition()
    state = {"done": 0, "limit": points[0] + 2}

    def on_batch() -> None:
        with lock:
            state["done"] += 1
            lock.notify_all()

    def gate() -> None:
        with lock:
            lock.wait_for(lambda: state["done"] < state["limit"], timeout=120)

    loaders = [Loader("rows", servers=servers, batch_size=batch_size, rank=r, world_size=world, seed=seed, epoch=1,
                      retry=RetryPolicy(initial_backoff_s=0.05, max_retries=200),
                      channel_options=[("grpc.http2.bdp_probe", 0)])
               for r in range(world)]
    ranks = [_Rank(ld, gate, on_batch) for ld in loaders]
    started = time.perf_counter()
    try:
        for t in ranks:
            t.start()
        for k, point in enumerate(points):
            with lock:
                if not lock.wait_for(lambda: state["done"] >= point or not any(t.is_alive() for t in ranks), 120):
                    raise TimeoutError(f"the ranks stopped at {state['done']} batches, before fault {k + 1} at {point}")
            if not any(t.is_alive() for t in ranks):
                break  # they failed (reported below) or finished early
            # The replica serving more ranks dies (ties drawn), so every fault cuts live streams.
            # No stream open: the ranks whose streams the last fault cut live on their
            # buffered batches (a Loader reconnects when its buffer has room). Let them
            # take one more batch at a time until one has reconnected.
            deadline = time.monotonic() + 30
            while max(load := [_open_streams(r) for r in replicas]) < 1 and time.monotonic() < deadline:
                with lock:
                    state["limit"] = max(state["limit"], state["done"] + 1)
                    lock.notify_all()
                time.sleep(0.02)
            victim = replicas[rng.randrange(2) if load[0] == load[1] else load.index(max(load))]
            how = rng.choice(["SIGKILL", "SIGTERM"])
            if victim.proc is not None and victim.proc.poll() is None:
                victim.proc.send_signal(signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM)
                victim.proc.wait(30)
            # Ranks run on during the restart (onto the other replica), up to the next point.
            with lock:
                state["limit"] = (points[k + 1] if k + 1 < len(points) else batches_total) + 2
                lock.notify_all()
            victim.start()
            log(f"fault {k + 1}/{kills}: {how} {victim.address} at batch {point}/{batches_total}; restarted")
        for t in ranks:
            t.join(300)
    finally:
        for r in replicas:
            r.stop()
    for t in ranks:
        if t.error is not None:
            raise RuntimeError(f"a rank failed: {t.error!r}") from t.error
        if t.is_alive():
            raise TimeoutError("a rank did not finish its epoch")
    delivered = [i for t in ranks for i in t.indices]
    lost, dup = count(range(rows), delivered)
    return FaultResult("replica killed and restarted", kills, rows, len(delivered), lost, dup,
                       sum(ld.stats.reconnects for ld in loaders), time.perf_counter() - started)


class CuttableProxy:
    """A TCP proxy on 127.0.0.1 whose connections can all be cut at once (reset, as a
    network failure does), in its own thread and event loop; with `tls`, it terminates TLS
    (an https endpoint in front of a plain one)."""

    def __init__(self, target_port: int, tls: ssl.SSLContext | None = None):
        self.target_port = target_port
        self.tls = tls
        self.port = free_port()
        self.cuts = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise TimeoutError("the proxy did not start")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._pipe, "127.0.0.1", self.port,
                                                                               ssl=self.tls))
        ready.set()
        self._loop.run_forever()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_w}

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(copy(reader, up_w), copy(up_r, writer))
        self._writers -= {writer, up_w}

    def cut(self) -> int:
        """Reset every open connection; returns how many were cut."""
        async def reset() -> int:
            n = 0
            for w in list(self._writers):
                sock = w.get_extra_info("socket")
                if sock is not None:  # linger 0: close sends RST, as a dropped link looks to TCP
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                w.transport.abort()
                n += 1
            self._writers.clear()
            return n

        n = asyncio.run_coroutine_threadsafe(reset(), self._loop).result(10)
        self.cuts += 1
        return n

    def close(self) -> None:
        async def shut() -> None:
            self._server.close()
            pipes = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in pipes:
                t.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def connection_cuts(workdir: Path, *, cuts: int = 20, seed: int = 0, rows: int = 4000, batch_size: int = 16,
                    log: Callable[[str], None] = lambda s: None) -> FaultResult:
    """One trainer reads through a proxy whose connections are reset at `cuts` random points."""
    from croupier.client import Loader, RetryPolicy

    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    server = ServerProcess([f"rows=synthetic:{rows}:64"], workdir, PACED, name="cut-server").start()
    proxy = CuttableProxy(server.port)
    loader = Loader("rows", servers=[proxy.address], batch_size=batch_size, seed=seed,
                    retry=RetryPolicy(initial_backoff_s=0.05, max_retries=50))
    batches = -(-rows // batch_size)
    points = set(rng.sample(range(1, batches - 1), cuts))
    delivered: list[int] = []
    started = time.perf_counter()
    try:
        for n, b in enumerate(loader.batches(), start=1):
            delivered += b.indices[~b.padding].tolist()
            if n in points:
                log(f"cut {proxy.cuts + 1}/{cuts} at batch {n}/{batches}: {proxy.cut()} sockets reset")
    finally:
        proxy.close()
        server.stop()
    lost, dup = count(range(rows), delivered)
    return FaultResult("connection reset mid-stream", proxy.cuts, rows, len(delivered), lost, dup,
                       loader.stats.reconnects, time.perf_counter() - started)


# --- a trainer killed and resumed -------------------------------------------------------

def _trainer_main(argv: Sequence[str]) -> int:
    """A trainer process: reads its epoch, and after every batch saves the Loader's
    state_dict and the count of delivered batches together, atomically, as a trainer's
    checkpoint does; on start it resumes from that checkpoint."""
    from croupier.client import Loader, RetryPolicy

    address, out, batch_size, seed = argv[0], Path(argv[1]), int(argv[2]), int(argv[3])
    ckpt, delivered = out / "ckpt.json", out / "delivered.jsonl"
    loader = Loader("rows", servers=[address], batch_size=batch_size, seed=seed,
                    retry=RetryPolicy(initial_backoff_s=0.05))
    done = 0
    if ckpt.exists():
        saved = json.loads(ckpt.read_text())
        loader.load_state_dict(saved["loader"])
        done = saved["batches"]
        lines = delivered.read_text().splitlines()[:done] if delivered.exists() else []
        delivered.write_text("".join(line + "\n" for line in lines))  # what the checkpoint covers
    with open(delivered, "a") as log:
        for b in loader.batches():
            log.write(json.dumps(b.indices[~b.padding].tolist()) + "\n")
            log.flush()
            done += 1
            tmp = ckpt.with_suffix(".tmp")
            tmp.write_text(json.dumps({"loader": loader.state_dict(), "batches": done}))
            os.replace(tmp, ckpt)
    return 0


def trainer_kills(workdir: Path, *, kills: int = 5, seed: int = 0, rows: int = 3000, batch_size: int = 16,
                  log: Callable[[str], None] = lambda s: None) -> FaultResult:
    """A trainer process SIGKILLed at `kills` random batches and restarted from its checkpoint."""
    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    server = ServerProcess([f"rows=synthetic:{rows}:64"], workdir, PACED, name="trainer-server").start()
    batches = -(-rows // batch_size)
    points = sorted(rng.sample(range(1, batches - 1), kills))
    delivered_file = workdir / "delivered.jsonl"
    cmd = [sys.executable, "-m", "croupier.bench.faults", server.address, str(workdir), str(batch_size), str(seed)]
    started = time.perf_counter()

    def lines() -> int:
        try:
            return delivered_file.read_text().count("\n")
        except OSError:
            return 0

    trainer_log = workdir / "trainer.log"
    killed = 0
    try:
        for k, point in enumerate([*points, None]):
            with open(trainer_log, "ab") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            deadline = time.monotonic() + 120
            while proc.poll() is None and (point is None or lines() < point):
                if time.monotonic() > deadline:
                    proc.kill()
                    raise TimeoutError(f"the trainer made no progress:\n{tail(trainer_log)}")
                time.sleep(0.002)
            if point is None or proc.poll() is not None:
                if proc.wait(120) != 0:
                    raise RuntimeError(f"the trainer failed:\n{tail(trainer_log)}")
                if point is None:
                    break
            if proc.poll() is None:
                proc.kill()
                killed += 1
            proc.wait(10)
            log(f"trainer kill {killed}/{kills} at batch {lines()}/{batches}")
    finally:
        server.stop()
    delivered = [i for line in delivered_file.read_text().splitlines() for i in json.loads(line)]
    lost, dup = count(range(rows), delivered)
    return FaultResult("trainer killed and resumed from state_dict()", killed, rows, len(delivered), lost, dup,
                       seconds=time.perf_counter() - started)


if __name__ == "__main__":
    sys.exit(_trainer_main(sys.argv[1:]))
