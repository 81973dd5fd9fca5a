"""The epoch plan's guarantees (docs/DESIGN.md section 4, "Guarantees"), one test each."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from croupier.protocol.epoch_plan import EpochPlan, Permutation, PlanError


def _all_rank_indices(plan: EpochPlan) -> tuple[np.ndarray, np.ndarray]:
    idx, pad = [], []
    for rank in range(plan.world_size):
        for rb in plan.rank_batches(rank):
            idx.append(rb.indices)
            pad.append(rb.padding)
    return np.concatenate(idx), np.concatenate(pad)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_exactly_once_over_an_epoch(world_size: int, drop_last: bool) -> None:
    n = 1003  # divides by none of the global batch sizes
    plan = EpochPlan(n, seed=7, epoch=2, batch_size=10, world_size=world_size, drop_last=drop_last)
    idx, pad = _all_rank_indices(plan)
    real = idx[~pad]
    assert len(np.unique(real)) == len(real), "an index was dealt twice"
    if drop_last:
        assert len(real) == (n // (10 * world_size)) * 10 * world_size
        assert not pad.any()
    else:
        assert sorted(real.tolist()) == list(range(n))
        assert len(idx) == plan.total_size == -(-n // world_size) * world_size
        assert set(idx[pad].tolist()) <= set(real.tolist())


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5000),
    seed=st.integers(0, 2**63),
    epoch=st.integers(0, 10**6),
)
def test_permutation_is_a_bijection(n: int, seed: int, epoch: int) -> None:
    p = Permutation(n, seed, epoch)(np.arange(n, dtype=np.uint64))
    assert sorted(p.tolist()) == list(range(n))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 3000),
    batch_size=st.integers(1, 64),
    world_size=st.integers(1, 5),
    drop_last=st.booleans(),
)
def test_every_rank_gets_equal_batches_and_global_batches_are_contiguous(
    n: int, batch_size: int, world_size: int, drop_last: bool
) -> None:
    try:
        plan = EpochPlan(n, 1, 0, batch_size, world_size, drop_last)
    except PlanError:
        assert batch_size > n or (drop_last and n < batch_size * world_size)
        return
    perm = plan.permutation(np.arange(n, dtype=np.uint64))
    padded = np.concatenate([perm, perm[np.arange(plan.total_size - n) % n]]) if plan.total_size > n else perm
    for b in range(plan.num_batches):
        parts = [plan.rank_batch(r, b).indices for r in range(world_size)]
        assert len({len(p) for p in parts}) == 1, "ranks got batches of different sizes"
        g = plan.global_batch_size
        assert np.array_equal(np.concatenate(parts), padded[b * g : b * g + sum(map(len, parts))])


def test_same_plan_in_another_process() -> None:
    code = (
        "from croupier.protocol.epoch_plan import EpochPlan;"
        "p=EpochPlan(100003, 42, 3, 32, 3);"
        "print(p.rank_batch(2, 17).indices.tolist())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    here = EpochPlan(100003, 42, 3, 32, 3).rank_batch(2, 17).indices.tolist()
    assert eval(out) == here


def test_known_plan_is_stable_across_releases() -> None:
    # Pinned values: a change here reshuffles every user's resumed run.
    assert Permutation(10, 0, 0)(np.arange(10, dtype=np.uint64)).tolist() == [1, 3, 7, 2, 4, 0, 6, 8, 5, 9]


def test_different_epochs_give_different_permutations() -> None:
    n = 10_000
    perms = [Permutation(n, 5, e)(np.arange(n, dtype=np.uint64)) for e in range(4)]
    for a in range(4):
        for b in range(a + 1, 4):
            # Two independent uniform permutations share ~1 fixed point on average.
            assert (perms[a] == perms[b]).sum() < 20
    assert not np.array_equal(Permutation(n, 5, 0)(np.arange(n)), Permutation(n, 6, 0)(np.arange(n)))


def test_start_at_any_batch_matches_the_full_stream() -> None:
    plan = EpochPlan(997, 3, 1, 16, 2)
    full = [rb.indices.tolist() for rb in plan.rank_batches(1)]
    assert [rb.indices.tolist() for rb in plan.rank_batches(1, start=23)] == full[23:]


def _planning_peak_bytes(n: int) -> tuple[int, list]:
    tracemalloc.start()
    plan = EpochPlan(n, seed=1, epoch=0, batch_size=256, world_size=8)
    batches = [plan.rank_batch(r, b) for r, b in [(0, 0), (7, plan.num_batches - 1), (3, plan.num_batches // 2)]]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak, batches


def test_billion_row_plan_in_constant_memory() -> None:
    _planning_peak_bytes(10**4)  # warm up lazy imports and caches
    small, _ = _planning_peak_bytes(10**4)
    huge, batches = _planning_peak_bytes(10**9)
    assert huge < 64 << 10, f"planning 1e9 rows peaked at {huge} bytes"
    assert huge < 2 * small + 4096, f"memory grew with N: {small} bytes at 1e4 rows, {huge} at 1e9"
    for rb in batches:
        assert len(rb.indices) in (256, 10**9 % 2048 // 8) and int(rb.indices.max()) < 10**9
        assert len(np.unique(rb.indices)) == len(rb.indices)


def test_padding_when_drop_last_is_false_mirrors_distributed_sampler() -> None:
    plan = EpochPlan(10, 0, 0, batch_size=4, world_size=3)
    assert plan.total_size == 12  # padded to a multiple of world_size
    assert plan.num_batches == 1 and plan.last_batch_size == 4
    idx, pad = _all_rank_indices(plan)
    assert pad.sum() == 2
    perm = plan.permutation(np.arange(10, dtype=np.uint64))
    assert idx[pad].tolist() == perm[:2].tolist()  # wraps around to the start


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(batch_size=0), "batch_size must be at least 1"),
        (dict(batch_size=101), "larger than the dataset"),
        (dict(world_size=0), "world_size"),
        (dict(batch_size=60, world_size=2, drop_last=True), "no full batch"),
    ],
)
def test_impossible_options_are_named(kwargs: dict, message: str) -> None:
    base = dict(num_rows=100, seed=0, epoch=0, batch_size=10)
    with pytest.raises(PlanError, match=message):
        EpochPlan(**{**base, **kwargs})


def test_rank_outside_world_is_named() -> None:
    with pytest.raises(PlanError, match="rank 4 is outside the world of size 4"):
        EpochPlan(100, 0, 0, 10, 4).rank_batch(4, 0)


def test_a_billion_row_virtual_dataset_streams_from_any_batch_in_constant_server_memory(serve_process) -> None:
    import grpc

    from croupier.bench.procstat import rss_mb
    from croupier.v1 import croupier_pb2 as pb
    from croupier.v1 import croupier_pb2_grpc

    n, batch, world = 10**9, 64, 4
    srv = serve_process(["rows=synthetic:1000000000:16"])

    def stream(start: int, end: int) -> list[int]:
        with grpc.insecure_channel(srv.address) as ch:
            request = pb.StreamEpochRequest(dataset="rows", batch_size=batch, world_size=world, rank=3, seed=9,
                                            epoch=2, start_batch=start, end_batch=end)
            got = []
            for msg in croupier_pb2_grpc.CroupierStub(ch).StreamEpoch(request, timeout=60):
                if msg.HasField("chunk"):
                    got += list(msg.chunk.indices)
            return got

    plan = EpochPlan(n, 9, 2, batch_size=batch, world_size=world)
    first = stream(0, 20)
    before = rss_mb(srv.proc.pid)
    last = stream(plan.num_batches - 20, plan.num_batches)
    after = rss_mb(srv.proc.pid)
    # The same rows the pure plan gives, from the start and from 3.9 million batches in.
    want_first = np.concatenate([rb.indices for rb in plan.rank_batches(3, 0, 20)])
    want_last = np.concatenate([rb.indices for rb in plan.rank_batches(3, plan.num_batches - 20, plan.num_batches)])
    assert sorted(first) == sorted(want_first.tolist()) and sorted(last) == sorted(want_last.tolist())
    assert len(last) == 20 * batch and max(last) < n
    # An array of 1e9 indices would be 8 GB; jumping to the end of the epoch costs nothing.
    assert after - before < 16, f"server RSS grew from {before:.0f} to {after:.0f} MB"
    assert after < 400, f"server RSS {after:.0f} MB"


@pytest.mark.parametrize("n", [2, 3, 10, 17, 1000, 100_003, 2**31 + 7, 2**40 + 123, 2**62])
def test_the_walks_tail_in_python_ints_gives_numpys_values(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last values of a cycle-walk finish in Python ints (epoch_plan._SCALAR_TAIL): the
    same bits as NumPy's uint64 rounds, for every n up to the supported 2**62, and a scalar
    position gives what an array does."""
    from croupier.protocol import epoch_plan

    rng = np.random.default_rng(n % 1000)
    x = np.unique(rng.integers(0, n, size=min(n, 4000), dtype=np.uint64))
    got = {}
    for tail in (0, 16, 1 << 30):  # NumPy only, the default, Python ints only
        monkeypatch.setattr(epoch_plan, "_SCALAR_TAIL", tail)
        got[tail] = Permutation(n, 7, 2)(x)
    assert np.array_equal(got[0], got[16]) and np.array_equal(got[0], got[1 << 30])
    assert int(Permutation(n, 7, 2)(int(x[-1]))) == int(got[0][-1])
