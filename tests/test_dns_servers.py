"""Replicas found by name: `Loader(servers="dns:///NAME:PORT")` streams from every address
the name resolves to, spreads the ranks over them, and resolves again as replicas leave
and join (client/connection.py Servers).

Real `croupier serve` subprocesses listen on 127.0.0.1, 127.0.0.2 and 127.0.0.3 (all
loopback on Linux) on one port, as the pods behind a headless Service do; the name is
mapped by a resolver the test injects (tests must not edit /etc/hosts), except in the
one test that asks getaddrinfo for `localhost`.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from croupier.client import Loader, RetryPolicy
from croupier.client.connection import Servers, resolve_host
from croupier.client.loader import LoaderError
from croupier.protocol.epoch_plan import EpochPlan
from croupier.protocol.security import AddressError, ClientSecurity

from certs import make_certs, needs_openssl

ROWS, BATCH, SEED = 600, 8, 3
NAME = "croupier.test.svc"
# 20 ms reads, 4 in flight per stream: an epoch lasts long enough to kill a replica in it.
SLOW = ["rows=synthetic:%d:64" % ROWS, "--latency-ms", "20", "--latency-distribution", "fixed",
        "--max-reads-per-stream", "4", "--prefetch", "1", "--grace", "0"]
FAST = ["rows=synthetic:%d:64" % ROWS, "--grace", "0"]


class NameTable:
    """A resolver for the Loader: NAME -> the addresses the test puts there, counting lookups."""

    def __init__(self, addresses: list[str]):
        self.addresses = list(addresses)
        self.lookups = 0

    def __call__(self, host: str, port: int) -> list[str]:
        assert (host, port) == (NAME, self.port)
        self.lookups += 1
        if not self.addresses:
            raise OSError(f"{host}: no such name")
        return list(self.addresses)

    @property
    def port(self) -> int:
        return int(self.addresses[0].rsplit(":", 1)[1]) if self.addresses else self._port

    _port = 0


def _replicas(serve_process, args: list[str], hosts: list[str]) -> list:
    """One server per loopback host, all on the first one's port."""
    first = serve_process(args, host=hosts[0])
    return [first] + [serve_process(args, port=first.port, host=h) for h in hosts[1:]]


def _epoch(loader: Loader) -> list[int]:
    """One pass of the loader: the indices it delivered (padding left out)."""
    out: list[int] = []
    for b in loader.batches():
        assert np.array_equal(b.data["index"], b.indices)
        out += b.indices[~b.padding].tolist()
    return out


def _loaders(world: int, table: NameTable, **kw) -> list[Loader]:
    return [Loader("rows", servers=f"dns:///{NAME}:{table.port}", batch_size=BATCH, rank=r, world_size=world,
                   seed=SEED, format="numpy", resolve=table, **kw) for r in range(world)]


def test_a_name_spreads_the_ranks_evenly_over_every_address_it_resolves_to(serve_process) -> None:
    a, b, c = _replicas(serve_process, FAST, ["127.0.0.1", "127.0.0.2", "127.0.0.3"])
    port = a.port
    # The resolver's order is not the order ranks are spread in: every process must agree.
    table = NameTable([f"127.0.0.3:{port}", f"127.0.0.1:{port}", f"127.0.0.2:{port}"])
    loaders = _loaders(6, table)
    seen = [i for loader in loaders for i in _epoch(loader)]
    assert sorted(seen) == list(range(ROWS)), "an index was lost or repeated"
    ordered = [f"127.0.0.{k}:{port}" for k in (1, 2, 3)]
    assert [loader.stats.streams for loader in loaders] == [[ordered[r % 3]] for r in range(6)]


def test_resolve_host_sorts_ipv4_first_in_numeric_order(monkeypatch) -> None:
    import socket

    infos = [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 9, 0, 0)),
             (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.10", 9)),
             (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.9", 9)),
             (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.9", 9))]
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port, type: infos)
    assert resolve_host("croupier", 9) == ["10.0.0.9:9", "10.0.0.10:9", "[::1]:9"]


def test_dns_localhost_is_resolved_by_getaddrinfo(serve_process) -> None:
    server = serve_process(FAST)
    assert f"127.0.0.1:{server.port}" in resolve_host("localhost", server.port)
    loader = Loader("rows", servers=f"dns:///localhost:{server.port}", batch_size=BATCH, seed=SEED, format="numpy")
    assert sorted(_epoch(loader)) == list(range(ROWS))
    assert loader.stats.streams[-1] == f"127.0.0.1:{server.port}"


class RankThread(threading.Thread):
    def __init__(self, loader: Loader):
        super().__init__(daemon=True)
        self.loader, self.indices, self.batches, self.error = loader, [], 0, None

    def run(self) -> None:
        try:
            for b in self.loader.batches():
                self.indices += b.indices[~b.padding].tolist()
                self.batches += 1
        except BaseException as exc:  # reported by the test
            self.error = exc


def test_a_replica_that_dies_and_leaves_the_name_loses_no_sample(serve_process) -> None:
    a, b, c = _replicas(serve_process, SLOW, ["127.0.0.1", "127.0.0.2", "127.0.0.3"])
    port = a.port
    table = NameTable([f"127.0.0.{k}:{port}" for k in (1, 2, 3)])
    ranks = [RankThread(loader) for loader in _loaders(6, table, retry=RetryPolicy(initial_backoff_s=0.05))]
    for t in ranks:
        t.start()
    deadline = time.monotonic() + 60
    while min(t.batches for t in ranks) < 2:
        assert all(t.is_alive() for t in ranks), [t.error for t in ranks]
        assert time.monotonic() < deadline, "the ranks made no progress"
        time.sleep(0.005)
    lookups = table.lookups
    table.addresses.remove(f"127.0.0.1:{port}")  # the dead pod's readiness fails: it leaves the Service
    a.kill()
    for t in ranks:
        t.join(120)
        assert not t.is_alive() and t.error is None, t.error
    assert sorted(i for t in ranks for i in t.indices) == list(range(ROWS)), "an index was lost or repeated"
    # Ranks 0 and 3 started on the dead replica, resolved the name again and moved to a
    # live one; the others never reconnected.
    for r, t in enumerate(ranks):
        streams = t.loader.stats.streams
        assert streams[0] == f"127.0.0.{r % 3 + 1}:{port}"
        if r % 3 == 0:
            assert len(streams) >= 2 and f"127.0.0.1:{port}" not in streams[1:]
        else:
            assert len(streams) == 1
    assert table.lookups >= lookups + 2  # one lookup per reconnect at least


def test_a_replica_added_to_the_name_takes_ranks_from_the_next_epoch(serve_process) -> None:
    a, b = _replicas(serve_process, FAST, ["127.0.0.1", "127.0.0.2"])
    port = a.port
    table = NameTable([f"127.0.0.1:{port}"])
    loaders = _loaders(2, table)
    for loader in loaders:
        assert len(loader.stats.streams) == 0
        assert len(_epoch(loader)) > 0
    assert [l.stats.streams for l in loaders] == [[f"127.0.0.1:{port}"]] * 2
    table.addresses.append(f"127.0.0.2:{port}")  # scaled out between epochs
    second = [i for loader in loaders for i in _epoch(loader)]  # re-iterating starts epoch 1
    assert sorted(second) == list(range(ROWS))
    assert [l.stats.streams[-1] for l in loaders] == [f"127.0.0.1:{port}", f"127.0.0.2:{port}"]


def test_a_name_that_never_resolves_fails_naming_it_after_the_retries() -> None:
    table = NameTable([])
    table._port = 50051
    loader = Loader("rows", servers=f"dns:///{NAME}:50051", batch_size=BATCH, format="numpy", resolve=table,
                    retry=RetryPolicy(max_retries=2, initial_backoff_s=0.01), rank=0, world_size=1)
    loader._num_rows = ROWS  # asking for the size would fail the same way; the stream is under test
    with pytest.raises(LoaderError, match=f"gave up after 2 retries; last error from dns:///{NAME}:50051: "
                                          f"{NAME}: no such name"):
        _epoch(loader)
    assert table.lookups == 3


def test_a_name_that_stops_resolving_keeps_its_last_addresses() -> None:
    table = NameTable(["10.0.0.2:50051", "10.0.0.1:50051"])
    servers = Servers(f"dns:///{NAME}:50051", table)
    assert servers.refresh() == ["10.0.0.1:50051", "10.0.0.2:50051"]
    table.addresses.clear()
    table._port = 50051
    assert servers.refresh() == ["10.0.0.1:50051", "10.0.0.2:50051"]  # a DNS blip does not stop training


@pytest.mark.parametrize("target, message", [
    ("dns://8.8.8.8/croupier:50051", "a DNS server in the authority"),
    ("dns:///croupier", "has no port"),
])
def test_a_malformed_dns_target_is_refused_when_the_loader_is_made(target: str, message: str) -> None:
    with pytest.raises(AddressError, match=message):
        Loader("rows", servers=target, batch_size=1, rank=0, world_size=1)


@needs_openssl
def test_over_tls_the_certificate_is_checked_against_the_name_not_the_pod_address(serve_process, tmp_path) -> None:
    certs = make_certs(tmp_path / "certs")
    # The certificate names localhost and 127.0.0.1, not 127.0.0.2: only the name can pass.
    server = serve_process(FAST + ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)],
                           host="127.0.0.2")

    def resolve(host: str, port: int) -> list[str]:
        assert host == "localhost"
        return [f"127.0.0.2:{port}"]

    loader = Loader("rows", servers=f"dns:///localhost:{server.port}", batch_size=BATCH, seed=SEED, rank=0,
                    world_size=1, format="numpy", resolve=resolve, security=ClientSecurity.resolve(tls_ca=str(certs.ca)))
    assert sorted(_epoch(loader)) == list(range(ROWS))
    assert loader.stats.streams == [f"127.0.0.2:{server.port}"]
