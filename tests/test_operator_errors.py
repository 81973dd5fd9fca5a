"""The operator's mistakes get one clear line, not a traceback or a long silence."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pytest

from croupier.client import Loader, LoaderError, RetryPolicy
from croupier.protocol.security import AddressError, check_address

CLI = [sys.executable, "-m", "croupier.cli"]


def _held_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def _serve(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "serve", "rows=synthetic:10", "--host", "127.0.0.1", *args], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_port_in_use_is_named_in_one_line_without_a_traceback(tmp_path, flag) -> None:
    with _held_port() as held:
        port = held.getsockname()[1]
        args = [flag, str(port)] + (["--port", "0"] if flag == "--metrics-port" else [])
        out = _serve(args, tmp_path)
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if line.startswith("croupier serve:")]
    assert lines == [f"croupier serve: cannot listen{' for metrics' if 'metrics' in flag else ''} on "
                     f"127.0.0.1:{port}: port {port} is already in use ({flag})"]
    assert "Traceback" not in out.stderr + out.stdout


def test_a_loader_pointed_where_nothing_listens_says_so_at_each_retry(caplog) -> None:
    with _held_port() as held:
        address = f"127.0.0.1:{held.getsockname()[1]}"
    # Nothing listens there now (the socket closed); the Loader must say so from the first try.
    loader = Loader("rows", servers=address, batch_size=4,
                    retry=RetryPolicy(max_retries=3, initial_backoff_s=0.01, max_backoff_s=0.02))
    try:
        with caplog.at_level(logging.WARNING, logger="croupier.client"):
            with pytest.raises(LoaderError) as info:
                for _ in loader.batches():
                    pass
    finally:
        loader.close()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert f"gave up after 3 retries; last error from {address}: UNAVAILABLE" in str(info.value)
    retries = [r.getMessage() for r in caplog.records if r.name == "croupier.client"]
    assert len(retries) == 3
    for n, message in enumerate(retries, 1):
        assert message.startswith(f"{address}: UNAVAILABLE: ") and f"retry {n} of 3 in " in message


@pytest.mark.parametrize("address, message", [
    ("localhost", "has no port: write HOST:PORT, e.g. localhost:50051"),
    ("10.0.0.5", "has no port"),
    ("::1", "an IPv6 address goes in brackets"),
    ("host:http", "is not a number in 1..65535"),
    (":50051", "has no host"),
    ("", "is empty"),
])
def test_an_address_without_a_usable_port_is_refused(address, message) -> None:
    with pytest.raises(AddressError, match=message.replace("(", r"\(").replace(".", r"\.")):
        check_address(address)
    with pytest.raises(ValueError, match="server address"):
        Loader("rows", servers=["127.0.0.1:50051", address], batch_size=4)


def test_addresses_that_grpc_dials_are_accepted() -> None:
    for address in ("127.0.0.1:50051", "[::1]:50051", "server:50051", "dns:///server:50051", "unix:/tmp/s.sock"):
        assert check_address(address) == address


@pytest.mark.parametrize("argv", [
    ["demo", "--server", "localhost"],
    ["loadtest", "localhost", "-n", "1"],
])
def test_the_cli_refuses_an_address_without_a_port(argv, tmp_path) -> None:
    out = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2
    assert "server address 'localhost' has no port: write HOST:PORT" in out.stderr
    assert "Traceback" not in out.stderr


def test_demo_trains_on_the_numeric_columns_of_a_table_with_list_columns(serve_process, tmp_path) -> None:
    rng = np.random.default_rng(0)
    n = 64
    table = pa.table({
        "f0": rng.normal(size=n),
        "f1": rng.integers(0, 10, size=n),
        "tokens": pa.array([list(range(int(k))) for k in rng.integers(0, 7, size=n)], type=pa.list_(pa.int64())),
        "text": [f"row {i}" for i in range(n)],
        "label": rng.integers(0, 2, size=n),
    })
    path = tmp_path / "t.arrow"
    with pa.ipc.new_file(path, table.schema) as w:
        w.write_table(table)
    srv = serve_process([f"data={path}"])
    summary = tmp_path / "summary.json"
    for features in ([], ["--features", "f0,f1"]):
        out = subprocess.run(
            [*CLI, "demo", "--server", srv.address, "--train-name", "data", "--test-name", "", "--num-classes", "2",
             "--world-size", "1", "--epochs", "1", "--batch-size", "16", "--summary-json", str(summary), *features],
            capture_output=True, text=True, timeout=240, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert out.returncode == 0, out.stdout + out.stderr
        import json

        assert json.loads(summary.read_text())["train_samples"] == n
