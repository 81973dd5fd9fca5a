"""The client's only gRPC code: channels, calls, and which failures are worth a retry."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from croupier.options import StreamOptions
from croupier.v1 import croupier_pb2 as pb
from croupier.v1 import croupier_pb2_grpc as pb_grpc

#: Failures of the connection or of the server process, not of the request.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.max_send_message_length", 16 << 20),
    ("grpc.keepalive_time_ms", 30_000),
    # Fail fast and let the Loader's own backoff decide when to try again.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.enable_retries", 0),
]


def open_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


class Connection:
    """One channel to one server."""

    def __init__(self, address: str):
        self.address = address
        self.channel = open_channel(address)
        self.stub = pb_grpc.CroupierStub(self.channel)

    async def describe(self, dataset: str, timeout: float | None = 30.0) -> pb.DatasetInfo:
        return await self.stub.DescribeDataset(pb.DescribeDatasetRequest(name=dataset), timeout=timeout)

    async def list_datasets(self, timeout: float | None = 30.0) -> list[pb.DatasetInfo]:
        return list((await self.stub.ListDatasets(pb.ListDatasetsRequest(), timeout=timeout)).datasets)

    def stream(self, options: StreamOptions) -> AsyncIterator[pb.StreamEpochResponse]:
        """The StreamEpoch call: a header message, then chunks."""
        return self.stub.StreamEpoch(options.to_proto(), wait_for_ready=False)

    async def close(self) -> None:
        await self.channel.close()
