"""Bad input, fuzzed: thousands of malformed, extreme and random requests to every RPC of a
real `croupier serve` on loopback (seeded, so a failure replays), then a normal epoch.

The verdict counts, never times: no crash, no call past its deadline, no UNKNOWN or
INTERNAL (INVALID_ARGUMENT for a body that does not parse), no traceback in the log.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from croupier.bench.fuzz import SERVICE, fuzz
from croupier.client import Loader
from croupier.demo.data import prepare

ROWS = 1000


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    return prepare(tmp_path_factory.mktemp("digits")).root


def _serve(serve_process, digits: Path):
    return serve_process([f"rows=synthetic:{ROWS}:64", f"table={digits}/arrow/train.arrow",
                          f"images={digits}/imagefolder/train", "--grace", "0"])


def test_thousands_of_fuzzed_requests_then_a_normal_epoch(serve_process, digits: Path) -> None:
    server = _serve(serve_process, digits)
    report = asyncio.run(fuzz(server.address, ["rows", "table", "images"], seed=7, count=6000))
    assert report.alive_after, report.summary()
    assert report.hangs == [], report.summary()
    assert report.vague == [], report.summary()
    codes = {code for (_, code) in report.statuses}
    # The fuzz reached every kind of answer: parsed and served, refused as unparsable, unknown.
    assert {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "UNIMPLEMENTED", "OUT_OF_RANGE"} <= codes, report.statuses
    assert "Traceback" not in server.output()
    seen = sorted(i for b in Loader("rows", servers=[server.address], batch_size=32, seed=3).batches()
                  for i in b.indices[~b.padding].tolist())
    assert seen == list(range(ROWS))
    assert server.proc.poll() is None


def test_a_body_that_does_not_parse_is_invalid_argument_naming_the_method(serve_process, digits: Path) -> None:
    server = _serve(serve_process, digits)

    async def call() -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_unary(SERVICE + "DescribeDataset")(b"\xff\xff\xff", timeout=10)
            return err.value

    err = asyncio.run(call())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "/croupier.v1.Croupier/DescribeDataset" in err.details() and "3 bytes" in err.details()


def test_a_huge_dataset_name_is_refused_by_name_length_and_the_answer_stays_small(serve_process, digits) -> None:
    server = _serve(serve_process, digits)

    async def call(name: str) -> grpc.aio.AioRpcError:
        from croupier.v1 import croupier_pb2 as pb
        from croupier.v1 import croupier_pb2_grpc as pb_grpc

        async with grpc.aio.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.CroupierStub(channel).DescribeDataset(pb.DescribeDatasetRequest(name=name), timeout=10)
            return err.value

    err = asyncio.run(call("x" * 20_000))  # once RESOURCE_EXHAUSTED: the echoed name broke the metadata limit
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "20,000 characters is too long" in err.details()
    err = asyncio.run(call("\x00" * 4000))  # allowed length, escaped four-fold in the message
    assert err.code() == grpc.StatusCode.NOT_FOUND and len(err.details()) < 1200
    assert max(len(line) for line in server.output().splitlines()) < 2000
