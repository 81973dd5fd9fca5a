"""Several trainers, several servers: ranks spread over replicas and fail over between them.

Two `croupier serve` subprocesses on loopback serve the same data; the ranks of one job
start on different replicas (rank r on servers[r % 2]); one replica is killed mid-epoch.
Whatever happens, the ranks together must receive every index exactly once.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from croupier.client import Loader, RetryPolicy
from croupier.protocol.epoch_plan import EpochPlan

ROWS, ROW_BYTES = 1200, 4096
BATCH, WORLD = 8, 4
SEED, EPOCH = 5, 2
# Reads of 20 ms, 4 in flight per stream: a rank's epoch takes about 1.5 s on a replica,
# so a replica killed once every rank holds a few batches dies mid-epoch for sure.
SERVE_ARGS = [f"rows=synthetic:{ROWS}:{ROW_BYTES}", "--latency-ms", "20", "--latency-distribution", "fixed",
              "--max-reads-per-stream", "4", "--prefetch", "1", "--grace", "0"]


class RankThread(threading.Thread):
    """One trainer rank consuming its epoch, checking every row against its index."""

    def __init__(self, rank: int, servers: list[str]):
        super().__init__(name=f"rank-{rank}", daemon=True)
        self.loader = Loader("rows", servers=servers, batch_size=BATCH, rank=rank, world_size=WORLD, seed=SEED,
                             epoch=EPOCH, retry=RetryPolicy(initial_backoff_s=0.05, max_retries=20))
        self.batches: list[int] = []
        self.indices: list[int] = []
        self.padding = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for b in self.loader.batches():
                idx = torch.as_tensor(b.indices.astype(np.int64))
                # The rows are the plan's rows: the payload encodes its own index.
                assert torch.equal(b.data["index"], idx)
                assert all(p[:8] == int(i).to_bytes(8, "little") for p, i in zip(b.data["payload"], idx.tolist()))
                self.indices += b.indices[~b.padding].tolist()
                self.padding += int(b.padding.sum())
                self.batches.append(b.batch)
        except BaseException as exc:
            self.error = exc


def _run_job(servers: list[str], kill_after: int, kill) -> list[RankThread]:
    """Runs one epoch on WORLD rank threads; calls kill() once every rank holds `kill_after` batches."""
    ranks = [RankThread(r, servers) for r in range(WORLD)]
    for t in ranks:
        t.start()
    deadline = time.monotonic() + 60
    while min(len(t.batches) for t in ranks) < kill_after:
        assert all(t.is_alive() for t in ranks), [t.error for t in ranks]
        assert time.monotonic() < deadline, "the ranks made no progress"
        time.sleep(0.005)
    kill()
    for t in ranks:
        t.join(120)
        assert not t.is_alive(), f"{t.name} did not finish its epoch"
        assert t.error is None, f"{t.name}: {t.error!r}"
    return ranks


def _assert_exactly_once(ranks: list[RankThread]) -> None:
    num_batches = EpochPlan(ROWS, SEED, EPOCH, BATCH, WORLD).num_batches
    seen = [i for t in ranks for i in t.indices]
    assert sorted(seen) == list(range(ROWS)), "an index was lost or repeated"
    assert sum(t.padding for t in ranks) == (-ROWS) % WORLD
    for t in ranks:
        assert t.batches == list(range(num_batches)), f"{t.name} skipped or repeated a batch"


@pytest.mark.parametrize("how", ["kill", "terminate"])
def test_a_replica_dies_mid_epoch_and_no_sample_is_lost_or_repeated(serve_process, how: str) -> None:
    a = serve_process(SERVE_ARGS)
    b = serve_process(SERVE_ARGS)
    servers = [a.address, b.address]
    stop = a.kill if how == "kill" else lambda: a.terminate(30)
    ranks = _run_job(servers, kill_after=5, kill=stop)
    _assert_exactly_once(ranks)
    # Ranks 0 and 2 started on the dead replica and moved; ranks 1 and 3 never noticed.
    assert [t.loader.stats.reconnects >= 1 for t in ranks] == [True, False, True, False]
    assert all(t.loader.stats.reconnects == 0 for t in ranks[1::2])


def test_ranks_of_two_dead_replicas_all_move_to_the_third(serve_process) -> None:
    a = serve_process(SERVE_ARGS)
    b = serve_process(SERVE_ARGS)
    c = serve_process(SERVE_ARGS)

    def kill_two() -> None:
        a.kill()
        b.kill()

    # Rank r starts on servers[r % 3]: ranks 0 and 3 on a, 1 on b, 2 on c; a and b die.
    ranks = _run_job([a.address, b.address, c.address], kill_after=3, kill=kill_two)
    _assert_exactly_once(ranks)
    assert [t.loader.stats.reconnects >= 1 for t in ranks] == [True, True, False, True]


def test_a_replica_restarted_on_its_port_takes_its_ranks_back(serve_process) -> None:
    a = serve_process(SERVE_ARGS)
    port = a.port

    def restart() -> None:
        a.kill()
        time.sleep(0.2)  # the ranks see the refusal and back off
        serve_process(SERVE_ARGS, port=port)

    ranks = _run_job([f"127.0.0.1:{port}"], kill_after=4, kill=restart)
    _assert_exactly_once(ranks)
    assert all(t.loader.stats.reconnects >= 1 for t in ranks)
