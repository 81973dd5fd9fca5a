"""Epochs advance by themselves; set_epoch pins one; state_dict says where the Loader stands.

Real server on loopback. The rule (README "The Loader in detail"): a Loader is a cursor
over epoch 0, 1, 2, ...; a pass yields the rest of the cursor's epoch, and a pass that
starts after an epoch's last batch starts the next epoch.
"""

from __future__ import annotations

import asyncio

import pytest

from croupier.client import Loader
from croupier.protocol.epoch_plan import EpochPlan

N, BS, SEED = 200, 32, 5


def _plan_batches(epoch: int, rank: int = 0, world: int = 1) -> list[list[int]]:
    plan = EpochPlan(N, SEED, epoch, BS, world)
    return [rb.indices.tolist() for rb in plan.rank_batches(rank)]


def _pass(loader: Loader, stop: int | None = None) -> list[tuple[int, int, list[int]]]:
    got = []
    for b in loader.batches():
        got.append((b.epoch, b.batch, b.indices.tolist()))
        if stop is not None and len(got) == stop:
            break
    return got


@pytest.fixture
def rows(serve_inprocess) -> str:
    return serve_inprocess(datasets=[f"rows=synthetic:{N}"]).address


def test_iterating_again_starts_the_next_epoch_exactly_once(rows: str) -> None:
    loader = Loader("rows", servers=rows, batch_size=BS, seed=SEED)
    passes = [[b["index"].tolist() for b in loader] for _ in range(3)]  # no set_epoch, as Lightning does
    assert passes == [_plan_batches(0), _plan_batches(1), _plan_batches(2)]
    assert all(sorted(i for b in p for i in b) == list(range(N)) for p in passes)
    assert passes[0] != passes[1] != passes[2]
    assert loader.epoch == 2  # the epoch last dealt; the next pass starts epoch 3


def test_async_passes_advance_the_epoch_the_same_way(rows: str) -> None:
    async def three_passes() -> list[list[int]]:
        loader = Loader("rows", servers=rows, batch_size=BS, seed=SEED)
        return [[b.epoch async for b in loader.abatches()] for _ in range(3)]

    assert asyncio.run(three_passes()) == [[0] * 7, [1] * 7, [2] * 7]


def test_set_epoch_pins_the_epoch_of_each_pass(rows: str) -> None:
    loader = Loader("rows", servers=rows, batch_size=BS, seed=SEED)
    loader.set_epoch(0)
    _pass(loader)
    loader.set_epoch(loader.epoch + 1)  # the other common loop: epoch 1, not 2
    assert {e for e, _, _ in _pass(loader)} == {1}
    got = {}
    for e in (0, 1, 2):
        loader.set_epoch(e)  # the DataLoader idiom: epoch e each time, never e + 1
        got[e] = [b for _, _, b in _pass(loader)]
    assert got == {e: _plan_batches(e) for e in (0, 1, 2)}
    loader.set_epoch(1)  # a finished epoch named again is dealt again, whole
    assert [b for _, _, b in _pass(loader)] == _plan_batches(1)
    loader.set_epoch(7)
    assert {e for e, _, _ in _pass(loader)} == {7}


def test_an_abandoned_pass_continues_where_it_stopped(rows: str) -> None:
    loader = Loader("rows", servers=rows, batch_size=BS, seed=SEED)
    head = _pass(loader, stop=3)
    rest = _pass(loader)  # the rest of epoch 0: nothing lost, nothing repeated
    assert [b for _, b, _ in head + rest] == list(range(7))
    assert [x for _, _, x in head + rest] == _plan_batches(0)
    assert {e for e, _, _ in _pass(loader)} == {1}


def test_breaking_after_the_last_batch_still_moves_to_the_next_epoch(rows: str) -> None:
    loader = Loader("rows", servers=rows, batch_size=BS, seed=SEED)
    assert len(_pass(loader, stop=7)) == 7  # the loop breaks on the last batch, before the stream ends
    assert loader.epoch == 0
    assert [e for e, _, _ in _pass(loader)] == [1] * 7


def test_state_dict_mid_epoch_and_after_a_pass(rows: str) -> None:
    loader = Loader("rows", servers=rows, batch_size=BS, seed=SEED, rank=1, world_size=2)
    _pass(loader)
    _pass(loader, stop=2)
    state = loader.state_dict()
    assert {k: state[k] for k in ("seed", "epoch", "next_batch", "step", "position", "num_rows")} == {
        "seed": SEED, "epoch": 1, "next_batch": 2, "step": 2, "position": 2 * BS * 2, "num_rows": N}
    _pass(loader)
    state = loader.state_dict()  # after the epoch's last batch: the epoch, finished
    assert (state["epoch"], state["next_batch"], state["step"], state["position"]) == (1, 4, 4, N)
    resumed = Loader("rows", servers=rows, batch_size=BS, seed=0, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert [b for _, _, b in _pass(resumed)] == _plan_batches(2, rank=1, world=2)


def test_set_epoch_after_load_state_dict_keeps_the_resumed_place(rows: str) -> None:
    first = Loader("rows", servers=rows, batch_size=BS, seed=SEED, epoch=2)
    head = _pass(first, stop=4)
    resumed = Loader("rows", servers=rows, batch_size=BS, seed=SEED)
    resumed.load_state_dict(first.state_dict())
    resumed.set_epoch(2)  # a loop that calls set_epoch(epoch) after resuming
    tail = _pass(resumed)
    assert [b for _, b, _ in tail] == [4, 5, 6]
    assert [x for _, _, x in head + tail] == _plan_batches(2)


def test_an_end_of_epoch_state_of_an_older_croupier_starts_the_next_epoch(rows: str) -> None:
    old = {"dataset": "rows", "seed": SEED, "epoch": 3, "next_batch": 7, "batches_ahead": [], "rank": 0,
           "world_size": 1, "batch_size": BS, "drop_last": False}
    loader = Loader("rows", servers=rows, batch_size=BS)
    loader.load_state_dict(old)
    assert [b for _, _, b in _pass(loader)] == _plan_batches(4)


def test_out_of_order_passes_advance_once_per_epoch(rows: str) -> None:
    loader = Loader("rows", servers=rows, batch_size=BS, seed=SEED, in_order=False)
    for e in range(2):
        got = _pass(loader)
        assert {x for x, _, _ in got} == {e}
        assert sorted(b for _, b, _ in got) == list(range(7))
        assert sorted(i for _, _, x in got for i in x) == list(range(N))
    assert (loader.state_dict()["epoch"], loader.state_dict()["next_batch"]) == (1, 7)


def test_len_is_the_epoch_of_the_next_batch(rows: str) -> None:
    loader = Loader("rows", servers=rows, batch_size=BS, seed=SEED, drop_last=True)
    assert len(loader) == N // BS == len(_pass(loader))
    assert len(loader) == N // BS  # the next pass's: epoch 1
    loader.set_epoch(0)
    assert [e for e, _, _ in _pass(loader)] == [0] * (N // BS)
