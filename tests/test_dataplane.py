"""End to end over real gRPC on loopback: the contract of docs/DESIGN.md section 4 ("Guarantees")."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from croupier.client import Loader, RetryPolicy
from croupier.protocol.epoch_plan import EpochPlan


def _epoch_indices(address: str, dataset: str, **kw) -> list[list[int]]:
    loader = Loader(dataset, servers=address, **kw)
    return [b.indices.tolist() for b in loader.batches()]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_exactly_once_over_an_epoch_for_every_world_size(serve_inprocess, world_size: int) -> None:
    n = 1001  # divides by no global batch size below
    srv = serve_inprocess(datasets=[f"rows=synthetic:{n}:16"])
    seen: list[int] = []
    padding = 0
    for rank in range(world_size):
        loader = Loader("rows", servers=srv.address, batch_size=32, rank=rank, world_size=world_size, seed=11)
        for b in loader.batches():
            assert torch.equal(b.data["index"], torch.as_tensor(b.indices.astype(np.int64)))
            seen += b.indices[~b.padding].tolist()
            padding += int(b.padding.sum())
    assert sorted(seen) == list(range(n))
    assert padding == (-n) % world_size


def test_batches_match_the_plan_and_carry_the_rows(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=["rows=synthetic:500:24"])
    loader = Loader("rows", servers=srv.address, batch_size=16, rank=1, world_size=2, seed=3, epoch=4)
    plan = EpochPlan(500, 3, 4, 16, 2)
    batches = list(loader.batches())
    assert len(batches) == plan.num_batches == len(loader)
    for b in batches:
        assert b.indices.tolist() == plan.rank_batch(1, b.batch).indices.tolist()
        idx = b.data["index"]
        assert torch.equal(b.data["value"], idx.double() * 0.5)
        assert b.data["payload"][0] == int(idx[0]).to_bytes(8, "little") * 3


def test_different_epochs_stream_different_permutations(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=["rows=synthetic:400"])
    loader = Loader("rows", servers=srv.address, batch_size=20, seed=1)
    epochs = []
    for e in range(3):
        loader.set_epoch(e)
        epochs.append([i for b in loader.batches() for i in b.indices.tolist()])
    assert all(sorted(x) == list(range(400)) for x in epochs)
    assert epochs[0] != epochs[1] != epochs[2]


def test_same_plan_from_two_server_processes_and_after_restart(serve_process) -> None:
    a = serve_process(["rows=synthetic:777"])
    b = serve_process(["rows=synthetic:777"])
    kw = dict(batch_size=25, rank=1, world_size=3, seed=99, epoch=5)
    first = _epoch_indices(a.address, "rows", **kw)
    assert first == _epoch_indices(b.address, "rows", **kw)
    a.kill()
    again = serve_process(["rows=synthetic:777"])
    assert first == _epoch_indices(again.address, "rows", **kw)


def test_a_slow_read_arrives_last_yet_the_batch_equals_ordered_mode(serve_inprocess) -> None:
    from croupier.server.config import LatencySpec

    n, bs = 256, 32
    plan = EpochPlan(n, seed=8, epoch=0, batch_size=bs)
    slow = int(plan.rank_batch(0, 2).indices[5])
    latency = LatencySpec(median_ms=2, distribution="uniform", seed=3, overrides={slow: 0.5})
    srv = serve_inprocess(datasets=[f"rows=synthetic:{n}"], latency=latency)
    unordered = Loader("rows", servers=srv.address, batch_size=bs, seed=8, prefetch=2)
    got = list(unordered.batches())

    # Every other sample of batch 2 reached the client before the slow one.
    assert unordered.stats.out_of_order > 0
    ordered = Loader("rows", servers=srv.address, batch_size=bs, seed=8, ordered=True)
    want = list(ordered.batches())
    assert ordered.stats.out_of_order == 0
    assert [b.batch for b in got] == list(range(plan.num_batches))
    for g, w in zip(got, want):
        for key in ("index", "value"):
            assert torch.equal(g.data[key], w.data[key])
        assert g.data["payload"] == w.data["payload"]


def test_slow_sample_arrives_after_the_rest_of_its_batch_on_the_wire(serve_inprocess) -> None:
    """Read the raw stream with the generated stubs: arrival order is completion order."""
    import grpc

    from croupier.protocol.options import StreamOptions
    from croupier.v1 import croupier_pb2_grpc

    from croupier.server.config import LatencySpec

    n, bs = 64, 16
    plan = EpochPlan(n, seed=1, epoch=0, batch_size=bs)
    slow = int(plan.rank_batch(0, 0).indices[0])
    srv = serve_inprocess(
        datasets=[f"rows=synthetic:{n}"],
        latency=LatencySpec(median_ms=1, distribution="fixed", overrides={slow: 0.4}),
    )
    with grpc.insecure_channel(srv.address) as ch:
        stub = croupier_pb2_grpc.CroupierStub(ch)
        arrivals = []
        for msg in stub.StreamEpoch(StreamOptions("rows", batch_size=bs, seed=1, prefetch=3).to_proto()):
            if msg.HasField("chunk"):
                arrivals += list(zip(msg.chunk.batches, msg.chunk.positions, msg.chunk.indices))
    assert arrivals[-1] == (0, 0, slow)
    assert sorted(arrivals) == sorted(
        (b, p, int(i)) for b in range(plan.num_batches) for p, i in enumerate(plan.rank_batch(0, b).indices)
    )


def _stub_chunks(address: str, **opts) -> list:
    """The chunks of one stream, read with the generated stubs and grpc's default limits."""
    import grpc

    from croupier.protocol.options import StreamOptions
    from croupier.v1 import croupier_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        stub = croupier_pb2_grpc.CroupierStub(ch)
        return [m.chunk for m in stub.StreamEpoch(StreamOptions(**opts).to_proto(), timeout=60) if m.HasField("chunk")]


def test_chunks_of_table_rows_flush_by_bytes(serve_process, tmp_path) -> None:
    import pyarrow as pa

    table = pa.table({"id": np.arange(100), "text": ["x" * 20_000] * 100})
    with pa.ipc.new_file(tmp_path / "big.arrow", table.schema) as w:
        w.write_table(table)
    srv = serve_process([f"big={tmp_path / 'big.arrow'}", "--chunk-kb", "64", "--chunk-samples", "64"])
    chunks = _stub_chunks(srv.address, dataset="big", batch_size=50)
    # Rows of ~20 KB reach 64 KiB at the 4th: far below the 64-sample count limit.
    assert max(len(c.indices) for c in chunks) == 4
    assert max(len(c.arrow_ipc) for c in chunks) < 100 << 10
    assert sorted(i for c in chunks for i in c.indices) == list(range(100))


def test_default_chunks_fit_grpc_default_receive_limit(serve_inprocess) -> None:
    # 48 rows of 300 KB: one 64-sample chunk would be 14 MB, over grpc's default 4 MiB.
    srv = serve_inprocess(datasets=["rows=synthetic:48:300000"])
    chunks = _stub_chunks(srv.address, dataset="rows", batch_size=48)
    assert sorted(i for c in chunks for i in c.indices) == list(range(48))


def test_async_iteration_gives_the_same_batches(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=["rows=synthetic:300"])

    async def collect() -> list[list[int]]:
        loader = Loader("rows", servers=srv.address, batch_size=32, seed=2)
        return [b["index"].tolist() async for b in loader]

    sync = [b["index"].tolist() for b in Loader("rows", servers=srv.address, batch_size=32, seed=2)]
    assert asyncio.run(collect()) == sync


def test_state_dict_resumes_mid_epoch_with_nothing_lost_or_repeated(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=["rows=synthetic:640"])
    kw = dict(servers=srv.address, batch_size=20, rank=0, world_size=2, seed=4, epoch=1)
    full = [b.indices.tolist() for b in Loader("rows", **kw).batches()]
    first = Loader("rows", **kw)
    head = []
    for b in first.batches():
        head.append(b.indices.tolist())
        if len(head) == 7:
            break
    state = first.state_dict()
    assert state["next_batch"] == 7 and state["epoch"] == 1
    resumed = Loader("rows", **kw)
    resumed.load_state_dict(state)
    tail = [b.indices.tolist() for b in resumed.batches()]
    assert head + tail == full


def test_resume_after_the_server_is_killed_mid_epoch(serve_process) -> None:
    args = ["rows=synthetic:3000", "--latency-ms", "3", "--latency-distribution", "fixed"]
    srv = serve_process(args)
    port = srv.port
    kw = dict(batch_size=30, seed=6, rank=1, world_size=2)
    want = _epoch_indices(srv.address, "rows", **kw)
    loader = Loader("rows", servers=srv.address, retry=RetryPolicy(initial_backoff_s=0.2, max_retries=50), **kw)
    got: list[list[int]] = []
    restarted: list = []

    def restart() -> None:
        restarted.append(serve_process(args, port=port))

    for b in loader.batches():
        got.append(b.indices.tolist())
        if len(got) == 10:
            srv.kill()  # SIGKILL mid-epoch: open streams just vanish
            threading.Timer(1.0, restart).start()
    assert restarted, "the server was never restarted"
    assert loader.stats.reconnects >= 1
    assert got == want


def test_sigterm_lets_open_streams_finish(serve_process) -> None:
    srv = serve_process(["rows=synthetic:2000", "--latency-ms", "2", "--latency-distribution", "fixed",
                         "--grace", "30"])
    loader = Loader("rows", servers=srv.address, batch_size=50, seed=1, retry=RetryPolicy(max_retries=0), prefetch=1)
    got = []
    for b in loader.batches():
        got += b.indices.tolist()
        if len(got) == 100:
            srv.proc.send_signal(15)
    assert sorted(got) == list(range(2000))
    assert srv.proc.wait(30) == 0
    assert "draining 1 open stream" in srv.output()


def test_client_disconnecting_mid_stream_leaves_other_streams_alone(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=["rows=synthetic:5000"])
    quitter = Loader("rows", servers=srv.address, batch_size=10, seed=1)
    for i, _ in enumerate(quitter.batches()):
        if i == 2:
            break  # closes the stream mid-epoch
    full = [i for b in Loader("rows", servers=srv.address, batch_size=100, seed=1).batches() for i in b.indices]
    assert sorted(full) == list(range(5000))
    metrics = srv.running.service.metrics
    deadline = time.monotonic() + 10
    while metrics.active_streams._value.get() != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metrics.active_streams._value.get() == 0
    cancelled = metrics.streams_total.labels("CANCELLED")._value.get()
    assert cancelled == 1


def test_len_during_iteration_and_an_early_break_do_not_block(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=["rows=synthetic:2000"])
    # rank 0 starts on the dead address: len() and the stream both fail over to the live one
    loader = Loader("rows", servers=["127.0.0.1:1", srv.address], rank=0, world_size=2, batch_size=10,
                    buffer_batches=1)
    for i, _ in enumerate(loader):
        assert len(loader) == 100  # the hand-off buffer is full here: the loop must still answer
        if i == 3:
            break
    state = loader.state_dict()
    assert state["next_batch"] == 4
    assert [b.batch for b in loader.batches()][:1] == [4]


def _network_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "croupier-loader" and t.is_alive()]


def test_close_and_interpreter_exit_stop_the_network_thread(serve_inprocess) -> None:
    # A network thread still streaming when the interpreter exits dies inside native code
    # (a pyarrow reader's dealloc, say) and aborts the process (exit -6): every Loader
    # still open is closed at exit, its streams cancelled and its thread joined.
    from croupier.client import loader as loader_module

    srv = serve_inprocess(datasets=["rows=synthetic:20000:256"])
    before = set(_network_threads())
    loaders = [Loader("rows", servers=srv.address, batch_size=64, seed=s) for s in range(2)]
    for ld in loaders:
        for i, _ in enumerate(ld.batches()):
            if i == 3:
                break  # mid-epoch, as a trainer that stops early
    assert len(set(_network_threads()) - before) == 2
    loaders[0].close()
    assert len(set(_network_threads()) - before) == 1
    loader_module._close_live_loaders()  # what atexit runs
    assert set(_network_threads()) - before == set()
    # A closed Loader starts a new thread when used again, and goes on where it stopped.
    assert len(list(loaders[1].batches())) == len(loaders[1]) - 4
