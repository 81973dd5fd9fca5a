"""SIGTERM drains: health says NOT_SERVING first and new streams are sent elsewhere, while
the streams already open finish; then the process exits 0. Real `croupier serve`
subprocesses on loopback."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from croupier.client import Loader, RetryPolicy
from croupier.v1 import croupier_pb2 as pb
from croupier.v1 import croupier_pb2_grpc as pb_grpc

ROWS = 2000
ARGS = [f"rows=synthetic:{ROWS}", "--latency-ms", "2", "--latency-distribution", "fixed", "--grace", "30",
        "--drain-notice", "1"]


async def _health(address: str) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def _new_stream_status(address: str) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(address) as channel:
        stream = pb_grpc.CroupierStub(channel).StreamEpoch(pb.StreamEpochRequest(dataset="rows", batch_size=10),
                                                           timeout=5)
        try:
            async for _ in stream:
                return grpc.StatusCode.OK, ""
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_sigterm_says_not_serving_refuses_new_streams_finishes_open_ones_and_exits_0(serve_process) -> None:
    draining, spare = serve_process(ARGS), serve_process(ARGS)
    assert asyncio.run(_health(draining.address)) == "SERVING"
    open_stream = Loader("rows", servers=draining.address, batch_size=50, seed=1, retry=RetryPolicy(max_retries=0),
                         prefetch=1)
    got: list[int] = []
    seen_during_drain = None
    for b in open_stream.batches():
        got += b.indices.tolist()
        if len(got) == 100:
            draining.proc.send_signal(15)
            deadline = time.monotonic() + 10
            while (status := asyncio.run(_health(draining.address))) == "SERVING":
                assert time.monotonic() < deadline, "health never left SERVING"
            seen_during_drain = status, asyncio.run(_new_stream_status(draining.address))
            # A trainer starting now is sent to the other replica and misses nothing.
            late = Loader("rows", servers=[draining.address, spare.address], batch_size=50, seed=2,
                          retry=RetryPolicy(initial_backoff_s=0.05))
            late_seen = sorted(i for lb in late.batches() for i in lb.indices.tolist())
            assert late_seen == list(range(ROWS))
    assert seen_during_drain is not None
    status, (code, details) = seen_during_drain
    assert status == "NOT_SERVING"
    assert code == grpc.StatusCode.UNAVAILABLE and "draining" in details
    assert sorted(got) == list(range(ROWS)), "the open stream lost samples in the drain"
    assert draining.proc.wait(30) == 0
    assert spare.proc.poll() is None


@pytest.mark.parametrize("notice", ["0", "1"])
def test_an_idle_server_stays_reachable_for_the_drain_notice(serve_process, notice: str) -> None:
    srv = serve_process([f"rows=synthetic:{ROWS}", "--grace", "5", "--drain-notice", notice])
    srv.proc.send_signal(15)
    statuses = []
    deadline = time.monotonic() + 10
    while srv.proc.poll() is None and time.monotonic() < deadline:
        try:
            statuses.append(asyncio.run(_health(srv.address)))
        except grpc.aio.AioRpcError as exc:
            statuses.append(exc.code().name)
    assert srv.proc.wait(10) == 0
    if notice == "1":  # a health checker polling during the notice sees the drain, not a refusal
        assert "NOT_SERVING" in statuses
    assert "SERVING" not in statuses[1:], statuses
