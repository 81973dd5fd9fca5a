"""Elastic resume: a state saved at world size W, batch size B resumes at W', B'.

The new ranks together deliver exactly the samples of the epoch that the old ranks had
not delivered (padding aside), with in_order=False too, and the next epoch is a whole
one at the new shape. Real server on loopback; real gloo processes where the ranks
take rank and world size from torch.distributed.
"""

from __future__ import annotations

import os
import socket
from collections import Counter

import grpc
import pytest

from croupier.client import Loader, LoaderError, ResumeError
from croupier.client.resume import Shape, resume_cursor
from croupier.protocol.epoch_plan import EpochPlan, PlanStart
from croupier.protocol.options import StreamOptions
from croupier.v1 import croupier_pb2_grpc as pb_grpc

N, SEED = 103, 7


def _real(batches) -> list[int]:
    return [i for b in batches for i, pad in zip(b.indices.tolist(), b.padding.tolist()) if not pad]


def _take(loader: Loader, steps: int | None = None) -> list:
    got = []
    for b in loader.batches():
        got.append(b)
        if steps is not None and len(got) == steps:
            break
    return got


def _assert_exactly_once(before: list[int], after: list[int]) -> None:
    counts = Counter(before + after)
    assert sorted(counts) == list(range(N)), "a sample was lost"
    assert max(counts.values()) == 1, f"repeated: {[i for i, c in counts.items() if c > 1]}"


def _slow_sample_server(serve_inprocess, batch_size: int, world: int, rank: int, batch: int):
    """A server on which one sample of `rank`'s `batch` (epoch 0) takes 2 s: with
    in_order=False the rank hands out the next batches ahead of it."""
    from croupier.server.config import LatencySpec

    slow = int(EpochPlan(N, SEED, 0, batch_size, world).rank_batch(rank, batch).indices[0])
    latency = LatencySpec(median_ms=1, distribution="fixed", overrides={slow: 2.0})
    return serve_inprocess(datasets=[f"rows=synthetic:{N}"], latency=latency)


# ---- the ranks, as separate processes under torch.distributed (gloo) ----------------
def _rank_main(rank: int, world: int, port: int, address: str, job: dict, out) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        loader = Loader("rows", servers=address, batch_size=job["batch_size"], seed=SEED,
                        in_order=job["in_order"], prefetch=8)
        if "states" in job:
            loader.load_state_dict(job["states"])
        rest = _take(loader, job.get("steps"))
        epochs = {b.epoch for b in rest}
        next_epoch = [b.indices.tolist() for b in loader.batches()] if "states" in job else []
        out.put((rank, _real(rest), epochs, loader.state_dict(), next_epoch))
    finally:
        dist.destroy_process_group()


def _run_ranks(world: int, address: str, job: dict) -> list[tuple]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, address, job, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted((out.get(timeout=180) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return results


def test_three_ranks_resume_at_two_ranks_from_rank_zeros_state(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=[f"rows=synthetic:{N}"])
    old = _run_ranks(3, srv.address, dict(batch_size=4, in_order=True, steps=3))
    delivered = [i for r in old for i in r[1]]
    assert len(delivered) == 3 * 3 * 4
    state = old[0][3]  # as a trainer that checkpoints rank 0 only: every new rank loads it
    assert (state["epoch"], state["step"], state["position"]) == (0, 3, 36)
    new = _run_ranks(2, srv.address, dict(batch_size=5, in_order=True, states=state))
    _assert_exactly_once(delivered, [i for r in new for i in r[1]])
    assert all(r[2] == {0} for r in new)
    for rank, *_, next_epoch in new:  # the next epoch: whole, at the new shape
        plan = EpochPlan(N, SEED, 1, 5, 2)
        assert next_epoch == [rb.indices.tolist() for rb in plan.rank_batches(rank)]


def test_two_ranks_out_of_order_resume_at_four_ranks_from_every_rank_state(serve_inprocess) -> None:
    srv = _slow_sample_server(serve_inprocess, batch_size=4, world=2, rank=1, batch=2)
    old = _run_ranks(2, srv.address, dict(batch_size=4, in_order=False, steps=5))
    states = [r[3] for r in old]
    assert states[1]["next_batch"] == 2 and states[1]["batches_ahead"] == [3, 4, 5]  # the slow batch is not out
    with pytest.raises(ResumeError, match="rank 1 handed out batches 3, 4, 5 ahead of batch 2.*rank 0"):
        Loader("rows", servers=srv.address, batch_size=3, rank=0, world_size=4).load_state_dict(states[1])
    new = _run_ranks(4, srv.address, dict(batch_size=3, in_order=False, states=states))
    _assert_exactly_once([i for r in old for i in r[1]], [i for r in new for i in r[1]])
    for rank, *_, next_epoch in new:
        plan = EpochPlan(N, SEED, 1, 3, 4)
        assert sorted(next_epoch) == sorted(rb.indices.tolist() for rb in plan.rank_batches(rank))


# ---- the same ranks in one process (explicit rank and world size) -------------------
def _old_ranks(address: str, world: int, batch_size: int, steps: list[int], **kw) -> tuple[list[int], list[dict]]:
    delivered, states = [], []
    for rank, n in enumerate(steps):
        loader = Loader("rows", servers=address, batch_size=batch_size, seed=SEED, rank=rank, world_size=world,
                        prefetch=8, **kw)
        delivered += _real(_take(loader, n))
        states.append(loader.state_dict())
    return delivered, states


def _new_ranks(address: str, world: int, batch_size: int, states, steps: int | None = None,
               **kw) -> tuple[list[int], list[dict]]:
    got, after = [], []
    for rank in range(world):
        loader = Loader("rows", servers=address, batch_size=batch_size, rank=rank, world_size=world, **kw)
        loader.load_state_dict(states)
        got += _real(_take(loader, steps))
        after.append(loader.state_dict())
    return got, after


def test_out_of_order_three_ranks_resume_at_two_and_then_at_four(serve_inprocess) -> None:
    srv = _slow_sample_server(serve_inprocess, batch_size=4, world=3, rank=1, batch=2)
    delivered, states = _old_ranks(srv.address, 3, 4, [4, 4, 4], in_order=False)
    assert states[1]["batches_ahead"] == [3, 4]
    second, states2 = _new_ranks(srv.address, 2, 5, states, steps=2, in_order=False)
    assert states2[0]["plan_delivered"]  # the first resume's plan skipped rank 1's batches 3 and 4
    third, _ = _new_ranks(srv.address, 4, 2, states2)  # a resume of a resume
    _assert_exactly_once(delivered, second + third)


def test_in_order_two_ranks_resume_at_four(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=[f"rows=synthetic:{N}"])
    delivered, states = _old_ranks(srv.address, 2, 4, [5, 5])
    rest, after = _new_ranks(srv.address, 4, 3, states[1])
    _assert_exactly_once(delivered, rest)
    assert [(s["epoch"], s["position"]) for s in after] == [(0, N)] * 4  # the epoch is over


def test_ranks_that_stopped_at_different_steps_are_refused_by_name(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=[f"rows=synthetic:{N}"])
    _, states = _old_ranks(srv.address, 3, 4, [3, 4, 3])
    loader = Loader("rows", servers=srv.address, batch_size=5, rank=0, world_size=2)
    with pytest.raises(ResumeError, match="rank 0 at epoch 0 step 3, rank 1 at epoch 0 step 4, rank 2 at epoch 0 "
                                          "step 3"):
        loader.load_state_dict(states)


def test_same_shape_resumes_from_another_ranks_state_at_its_step(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=[f"rows=synthetic:{N}"])
    _, states = _old_ranks(srv.address, 2, 4, [6, 6])
    loader = Loader("rows", servers=srv.address, batch_size=4, rank=1, world_size=2)
    loader.load_state_dict(states[0])
    assert [b.batch for b in loader.batches()] == list(range(6, 13))


def test_a_server_that_ignores_the_plan_start_is_refused(serve_inprocess, monkeypatch) -> None:
    from croupier.server.service import servicer

    srv = serve_inprocess(datasets=[f"rows=synthetic:{N}"])
    _, states = _old_ranks(srv.address, 2, 4, [2, 2])
    real = servicer.header_to_proto

    def old_server_header(info, plan, span):  # a server from before elastic resume: no plan start
        msg = real(info, plan, span)
        msg.header.ClearField("plan_position")
        return msg

    monkeypatch.setattr(servicer, "header_to_proto", old_server_header)
    loader = Loader("rows", servers=srv.address, batch_size=3, rank=0, world_size=1)
    loader.load_state_dict(states)
    with pytest.raises(LoaderError, match="predates elastic resume"):
        _take(loader)


def test_the_server_refuses_a_plan_start_it_cannot_begin_at(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=[f"rows=synthetic:{N}"])
    bad = StreamOptions("rows", batch_size=4, plan_start=PlanStart(10, (5, 8)))

    async def call() -> None:
        async with grpc.aio.insecure_channel(srv.address) as channel:
            async for _ in pb_grpc.CroupierStub(channel).StreamEpoch(bad.to_proto()):
                pass

    with pytest.raises(grpc.aio.AioRpcError) as info:
        srv.call(call())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "plan_delivered range [5, 8)" in info.value.details()


def test_resume_cursor_by_hand() -> None:
    base = dict(dataset="rows", seed=1, epoch=0, world_size=2, batch_size=4, drop_last=False, num_rows=20,
                plan_position=0, plan_delivered=[])
    r0 = dict(base, rank=0, next_batch=1, batches_ahead=[2])
    r1 = dict(base, rank=1, next_batch=2, batches_ahead=[])
    c = resume_cursor([r0, r1], "rows", Shape(0, 3, 2, False))
    # global batch 0 = P[0:8], rank 1's batch 1 = P[12:16], rank 0's (short, last) batch 2 = P[16:18]
    assert (c.start.position, c.start.delivered, c.next_batch) == (8, (12, 18), 0)
    with pytest.raises(ResumeError, match="dataset 'rows'"):
        resume_cursor([r0], "other", Shape(0, 3, 2, False))
    with pytest.raises(ResumeError, match="hold rank 0 twice"):
        resume_cursor([r0, r0], "rows", Shape(0, 3, 2, False))
    # states of an older croupier at the end of a 16-row epoch: the next epoch starts
    done = [dict(base, num_rows=16, rank=r, next_batch=2, batches_ahead=[]) for r in (0, 1)]
    nothing_left = resume_cursor(done, "rows", Shape(0, 3, 2, False))
    assert (nothing_left.epoch, nothing_left.start, nothing_left.next_batch) == (1, PlanStart(), 0)


def test_a_stream_with_nothing_left_is_a_header_and_no_chunk(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=[f"rows=synthetic:{N}"])
    done = StreamOptions("rows", batch_size=4, plan_start=PlanStart(N))

    async def call() -> list:
        async with grpc.aio.insecure_channel(srv.address) as channel:
            return [m async for m in pb_grpc.CroupierStub(channel).StreamEpoch(done.to_proto())]

    (only,) = srv.call(call())
    assert (only.header.num_batches, only.header.last_batch_size, only.header.plan_position) == (0, 0, N)


@pytest.mark.parametrize("n", [1, 7, 50, 103])
def test_the_plan_after_a_resume_deals_exactly_the_rest(n: int) -> None:
    import random

    rng = random.Random(n)
    for _ in range(40):
        w, b = rng.randint(1, 4), rng.randint(1, 6)
        w2, b2 = rng.randint(1, 5), rng.randint(1, 6)
        if b > n or b2 > n:
            continue
        old = EpochPlan(n, SEED, 3, b, w)
        k = rng.randint(0, old.num_batches - 1)
        before = [i for r in range(w) for rb in old.rank_batches(r, 0, k) for i in rb.indices[~rb.padding].tolist()]
        start = PlanStart().after([(0, k * old.global_batch_size)], old.remaining)
        new = EpochPlan(n, SEED, 3, b2, w2, start=start)
        after = [i for r in range(w2) for rb in new.rank_batches(r) for i in rb.indices[~rb.padding].tolist()]
        counts = Counter(before + after)
        assert sorted(counts) == list(range(n)) and max(counts.values()) == 1
        assert new.total_size - new.remaining == (-new.remaining) % w2  # padding as DistributedSampler's
