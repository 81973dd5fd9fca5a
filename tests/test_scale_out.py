"""Scale-out on loopback: N replicas (1, 2, 4) behind one name serve M ranks, every rank's
epoch exactly once, each replica's share of streams and samples even, counted by the
servers themselves (their /metrics), and one replica killed mid-epoch loses nothing.

The replicas are real `croupier serve` subprocesses on 127.0.0.1..4 sharing one port, as
the pods behind a headless Service do; `dns:///NAME:PORT` is mapped to them by a resolver
the test passes in (client/connection.py Servers sorts the addresses, so rank r starts on
replica r % N whichever order the name's records come in).

The spread rule is rank r -> replica r % N, so replica i serves the ranks i, i+N, ...:
ceil(M/N) or floor(M/N) streams. With N dividing M every replica's share equals the mean
(within 10% trivially); with M=10, N=4 the shares are 3, 3, 2, 2 ranks, 20% off the mean
however the servers behave, so that case asserts the exact counts the rule gives.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from croupier.bench.promscrape import scrape
from croupier.client import Loader, RetryPolicy
from croupier.loadtest import LoadOptions, run_load
from croupier.protocol.epoch_plan import EpochPlan

NAME = "croupier.scale.svc"
SEED, EPOCH = 11, 0
# Rows that the ranks divide (64 x 8 batches of 4: 2,048): no padding, so a replica's samples
# served are exactly its ranks' rows.
BATCH = 4
FAST = ["--grace", "0", "--metrics-port", "0"]
# 20 ms reads, 4 in flight per stream, 300 rows per rank: a rank's epoch lasts about 1.5 s,
# so a replica killed once every rank holds a few batches dies mid-epoch for sure.
SLOW_ROWS, SLOW_WORLD, SLOW_BATCH = 4800, 16, 8
SLOW = [f"rows=synthetic:{SLOW_ROWS}:64", "--latency-ms", "20", "--latency-distribution", "fixed",
        "--max-reads-per-stream", "4", "--prefetch", "1", "--grace", "0", "--metrics-port", "0"]


def _address(replica) -> str:
    return replica.address


def _replicas(serve_process, args: list[str], n: int) -> list:
    """n servers on 127.0.0.1..n, all on the first one's port (one Service port). The port is
    free on 127.0.0.1 when the first server takes it, not necessarily on 127.0.0.2..n (another
    process may hold it there): then all of them start again on another port."""
    for attempt in range(5):
        first = serve_process(args, host="127.0.0.1")
        started = [first]
        try:
            for k in range(2, n + 1):
                started.append(serve_process(args, port=first.port, host=f"127.0.0.{k}"))
            return started
        except RuntimeError:  # "server exited with 1": the port was taken on 127.0.0.k
            for server in started:
                server.kill()
            if attempt == 4:
                raise
    raise AssertionError("unreachable")


class Name:
    """The resolver of dns:///NAME:PORT: the addresses of the replicas still in it (sorted
    by the client anyway; given reversed here so the test shows it does not matter)."""

    def __init__(self, replicas: list):
        self.port = replicas[0].port
        self.addresses = [_address(r) for r in reversed(replicas)]
        self.target = f"dns:///{NAME}:{self.port}"

    def __call__(self, host: str, port: int) -> list[str]:
        assert (host, port) == (NAME, self.port)
        return list(self.addresses)


def _counter(replica, name: str, labels: str) -> float:
    return sum(v for n, lab, v in scrape(replica.metrics_port) if n == name and lab == labels)


def _server_counts(replicas: list, streams: int) -> list[tuple[int, int]]:
    """(OK streams, samples served) per replica, from its /metrics. A stream's outcome is
    counted as its handler exits, just after the client saw the end: wait for the total."""
    deadline = time.monotonic() + 20
    while True:
        counts = [(int(_counter(r, "croupier_streams_total", 'code="OK"')),
                   int(_counter(r, "croupier_samples_served_total", 'dataset="rows"'))) for r in replicas]
        if sum(c[0] for c in counts) >= streams or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


def _loaders(name: Name, world: int, rows_batch: int, **kw) -> list[Loader]:
    return [Loader("rows", servers=name.target, resolve=name, batch_size=rows_batch, rank=r, world_size=world,
                   seed=SEED, epoch=EPOCH, format="numpy", **kw) for r in range(world)]


async def _consume(loader: Loader, progress: list[int], rank: int) -> tuple[list[int], list[int]]:
    """One rank's epoch: (indices delivered in order, padding included; batch numbers)."""
    indices, batches = [], []
    async for b in loader.abatches():
        assert (b.data["index"] == b.indices).all(), "a row is not the plan's row"
        indices += b.indices.tolist()
        batches.append(b.batch)
        progress[rank] += 1
    return indices, batches


async def _run_ranks(loaders: list[Loader], on_progress=None) -> list[tuple[list[int], list[int]]]:
    """Every rank in one event loop (64 Loader threads would only add switching); calls
    on_progress(batches per rank) as batches arrive until it returns True."""
    progress = [0] * len(loaders)
    tasks = [asyncio.create_task(_consume(loader, progress, r)) for r, loader in enumerate(loaders)]
    deadline = time.monotonic() + 60
    while on_progress is not None and not on_progress(progress):
        failed = [t for t in tasks if t.done() and t.exception() is not None]
        if failed:
            raise failed[0].exception()
        assert time.monotonic() < deadline, f"the ranks made no progress: {progress}"
        await asyncio.sleep(0.005)
    return await asyncio.wait_for(asyncio.gather(*tasks), 120)


def _assert_every_rank_got_its_plan_exactly_once(results, plan: EpochPlan) -> None:
    seen = set()
    for rank, (indices, batches) in enumerate(results):
        assert batches == list(range(plan.num_batches)), f"rank {rank} skipped or repeated a batch"
        want = [i for rb in plan.rank_batches(rank) for i in rb.indices.tolist()]
        assert indices == want, f"rank {rank} got other rows than its plan's, or in another order"
        seen.update(indices)
    assert seen == set(range(plan.num_rows)), "an index was lost"


@pytest.mark.parametrize("replicas, ranks, rows", [(1, 64, 2048), (2, 64, 2048), (4, 64, 2048), (4, 10, 640)])
def test_replicas_share_the_ranks_evenly_and_every_epoch_arrives_once(serve_process, replicas: int, ranks: int,
                                                                       rows: int) -> None:
    servers = _replicas(serve_process, [f"rows=synthetic:{rows}:64", *FAST], replicas)
    name = Name(servers)
    loaders = _loaders(name, ranks, BATCH)
    plan = EpochPlan(rows, SEED, EPOCH, BATCH, ranks)
    _assert_every_rank_got_its_plan_exactly_once(asyncio.run(_run_ranks(loaders)), plan)
    ordered = sorted(name.addresses)
    assert [loader.stats.streams for loader in loaders] == [[ordered[r % replicas]] for r in range(ranks)]

    counts = _server_counts(servers, ranks)
    # The rule's exact shares: replica i serves ranks i, i+N, ..., each rank its plan's rows.
    ranks_of = [len(range(i, ranks, replicas)) for i in range(replicas)]
    assert counts == [(n, n * plan.samples_per_rank) for n in ranks_of]
    if ranks % replicas == 0:
        for share in zip(*counts):  # streams, then samples
            mean = sum(share) / replicas
            assert all(abs(x - mean) <= 0.10 * mean for x in share), share


def test_a_replica_killed_mid_epoch_loses_and_repeats_nothing(serve_process) -> None:
    servers = _replicas(serve_process, SLOW, 4)
    name = Name(servers)
    dead = servers[0]  # 127.0.0.1: ranks 0, 4, 8 and 12 start there
    loaders = _loaders(name, SLOW_WORLD, SLOW_BATCH, retry=RetryPolicy(initial_backoff_s=0.05, max_retries=20))
    plan = EpochPlan(SLOW_ROWS, SEED, EPOCH, SLOW_BATCH, SLOW_WORLD)

    def kill_once_every_rank_is_under_way(progress: list[int]) -> bool:
        if min(progress) < 3:
            return False
        assert max(progress) < plan.num_batches, "a rank finished before the kill: not mid-epoch"
        name.addresses.remove(_address(dead))  # its readiness fails: the pod leaves the Service
        dead.kill()  # SIGKILL: no drain, streams cut mid-batch
        return True

    results = asyncio.run(_run_ranks(loaders, kill_once_every_rank_is_under_way))
    _assert_every_rank_got_its_plan_exactly_once(results, plan)
    for r, loader in enumerate(loaders):
        streams = loader.stats.streams
        if r % 4 == 0:  # moved to a live replica and finished there
            assert streams[0] == _address(dead) and len(streams) >= 2 and _address(dead) not in streams[1:]
        else:
            assert streams == [_address(servers[r % 4])]
    # The survivors counted their own 12 ranks' whole epochs plus the moved ranks' rest.
    counts = _server_counts(servers[1:], SLOW_WORLD)
    assert sum(c[0] for c in counts) == SLOW_WORLD
    assert sum(c[1] for c in counts) > 12 * plan.samples_per_rank


def test_loadtest_streams_spread_over_replicas_found_by_name(serve_process) -> None:
    servers = _replicas(serve_process, [f"rows=synthetic:{200 * 8}:64", *FAST], 4)
    name = Name(servers)
    data = '{"dataset": "rows", "batch_size": 4, "world_size": 200, "rank": {{.WorkerID}}, "seed": 11}'
    report = run_load(LoadOptions(target=name.target, data=data, concurrency=200, total=200), resolve=name)
    assert report["status_codes"] == {"OK": 200}
    assert report["samples"] == 200 * 8
    # Worker w calls replica w % 4 (the Loader's rank rule), one call each: 50 streams apiece.
    assert report["per_target"] == {a: {"calls": 50, "ok": 50, "samples": 400, "samples_per_s": pytest.approx(
        report["per_target"][a]["samples_per_s"])} for a in sorted(name.addresses)}
    assert _server_counts(servers, 200) == [(50, 400)] * 4
