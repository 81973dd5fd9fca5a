"""Shared fixtures: real croupier servers on loopback, as subprocesses or in-process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from croupier.server.config import ServerConfig

REPO = Path(__file__).resolve().parent.parent


class ServerProcess:
    """`croupier serve` in a subprocess on a loopback port."""

    def __init__(self, args: list[str], tmp: Path, port: int = 0, env: dict | None = None, host: str = "127.0.0.1"):
        self.args = args
        self.host = host
        self.tmp = tmp
        self.port = port
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.metrics_port: int | None = None
        self.log = tmp / f"server-{time.monotonic_ns()}.log"

    @property
    def address(self) -> str:
        # A server on 127.0.0.k answers there; "localhost" listens on 127.0.0.1 (and ::1).
        host = self.host if self.host.startswith("127.") else "127.0.0.1"
        return f"{host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServerProcess":
        ready = self.tmp / f"ready-{time.monotonic_ns()}.json"
        cmd = [sys.executable, "-m", "croupier.cli", "serve", *self.args, "--host", self.host,
               "--port", str(self.port), "--ready-file", str(ready)]
        self._logf = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._logf, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(self.env or {})})
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"server not ready in {timeout}s:\n{self.log.read_text()}")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        self.port, self.metrics_port = info["port"], info["metrics_port"]
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def output(self) -> str:
        return self.log.read_text()


@pytest.fixture
def serve_process(tmp_path: Path) -> Iterator:
    """Factory: serve_process(args) starts `croupier serve args` and stops it after the test."""
    started: list[ServerProcess] = []

    def start(args: list[str], port: int = 0, env: dict | None = None, host: str = "127.0.0.1") -> ServerProcess:
        """`host="localhost"` listens on 127.0.0.1 and ::1: two client identities on one machine."""
        sp = ServerProcess(args, tmp_path, port, env, host).start()
        started.append(sp)
        return sp

    yield start
    for sp in started:
        sp.kill()


class ServerThread:
    """An in-process server on its own event loop in a thread (fast to start)."""

    def __init__(self, config: ServerConfig):
        from croupier.server.app import start

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running = asyncio.run_coroutine_threadsafe(start(config), self.loop).result(60)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.running.port}"

    def call(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace: float = 0.0) -> None:
        self.call(self.running.stop(grace))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def serve_inprocess() -> Iterator:
    """Factory: serve_inprocess(datasets=[...], **config) -> ServerThread on 127.0.0.1:free."""
    started: list[ServerThread] = []

    def start(**kwargs) -> ServerThread:
        kwargs.setdefault("port", 0)
        kwargs.setdefault("host", "127.0.0.1")
        if "datasets" in kwargs:
            kwargs["datasets"] = tuple(kwargs["datasets"])
        st = ServerThread(ServerConfig(**kwargs))
        started.append(st)
        return st

    yield start
    for st in started:
        st.stop()
