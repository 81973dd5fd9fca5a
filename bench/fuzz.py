"""A seeded fuzzer for a running croupier server: malformed, extreme and random requests
to every RPC, each under a deadline, with what came back counted.

Used by the test suite (a few thousand requests, about a minute) and by
`croupier bench --suite reliability` (a longer run). The verdict is in `FuzzReport`:
no crash (the server still answers), no call past its deadline, and no status UNKNOWN
or INTERNAL where a specific one fits.

Request kinds, drawn with fixed weights from `random.Random(seed)`:
- `garbage`: random bytes (empty to 64 KiB), which mostly do not parse;
- `mutated`: a valid request with bytes flipped, cut short or repeated;
- `extreme`: a request that parses, with extreme or hostile values (huge and zero
  sizes, ranks outside the world, end before start, names of 64 KiB, NULs, path
  traversal, absolute paths, thousands of columns);
- `valid`: a small well-formed request, so the fuzz also runs beside real streams.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2

from croupier.v1 import croupier_pb2 as pb

SERVICE = "/croupier.v1.Croupier/"
HEALTH = "/grpc.health.v1.Health/"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"

#: Statuses that say the server did not know what to answer.
VAGUE = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})

U64 = (1 << 64) - 1
U32 = (1 << 32) - 1


@dataclass
class FuzzCall:
    method: str
    kind: str
    body: bytes
    #: Server-streaming: read at most this many responses, then cancel.
    streaming: bool = False


@dataclass
class FuzzReport:
    requests: int = 0
    seconds: float = 0.0
    #: (method, status name) -> count
    statuses: Counter = field(default_factory=Counter)
    #: Calls that ran past their deadline (DEADLINE_EXCEEDED): hangs.
    hangs: list[str] = field(default_factory=list)
    #: Calls answered UNKNOWN or INTERNAL: the request, shortened, and the details.
    vague: list[str] = field(default_factory=list)
    #: Whether the server still answered a health check after the fuzz.
    alive_after: bool = False

    @property
    def ok(self) -> bool:
        return self.alive_after and not self.hangs and not self.vague

    def summary(self) -> str:
        by_code = Counter()
        for (_, code), n in self.statuses.items():
            by_code[code] += n
        codes = ", ".join(f"{code} {n:,}" for code, n in by_code.most_common())
        return (f"{self.requests:,} fuzzed requests in {self.seconds:.0f}s: {len(self.hangs)} hangs, "
                f"{len(self.vague)} UNKNOWN/INTERNAL, server {'alive' if self.alive_after else 'DEAD'} after; "
                f"statuses: {codes}")


def _valid_stream(datasets: list[str], rng: random.Random) -> pb.StreamEpochRequest:
    return pb.StreamEpochRequest(dataset=rng.choice(datasets), seed=rng.randrange(1 << 16), epoch=rng.randrange(4),
                                 world_size=2, rank=rng.randrange(2), batch_size=rng.choice([1, 7, 32]),
                                 end_batch=rng.randrange(1, 3))


def _hostile_name(rng: random.Random, datasets: list[str]) -> str:
    return rng.choice([
        "", "/", ".", "..", "../../etc/passwd", "/etc/passwd", "/proc/self/environ", "\x00", "a\x00b",
        "x" * rng.choice([256, 4096, 16 << 10, 64 << 10]), "ü" * 1000, "\ud7ff\ue000" * 10, "%s%n%x" * 10,
        rng.choice(datasets) + "/../" + rng.choice(datasets), rng.choice(datasets) + "\x00", "s3://bucket/key",
        "file:///etc/passwd", "~root", " " + rng.choice(datasets), rng.choice(datasets).upper(),
    ])


def _extreme_stream(datasets: list[str], rng: random.Random) -> pb.StreamEpochRequest:
    msg = _valid_stream(datasets, rng)
    field_name = rng.choice(["dataset", "seed", "epoch", "rank", "world_size", "batch_size", "start_batch",
                             "end_batch", "prefetch", "columns", "order", "several"])
    big = [0, 1, U32, U32 - 1, 1 << 31, (1 << 31) - 1, 10**9, 20_000_000]
    if field_name == "dataset":
        msg.dataset = _hostile_name(rng, datasets)
    elif field_name in ("seed", "epoch", "start_batch", "end_batch"):
        setattr(msg, field_name, rng.choice([0, 1, U64, U64 - 1, 1 << 63, (1 << 63) - 1, 10**12]))
    elif field_name in ("rank", "world_size", "batch_size", "prefetch"):
        setattr(msg, field_name, rng.choice(big))
    elif field_name == "columns":
        msg.columns.extend(rng.choice([["", "\x00"], ["x" * 10_000], [f"c{i}" for i in range(5000)], ["index"] * 100]))
    elif field_name == "order":
        msg.order = rng.choice([2, 7, 1 << 20])  # enum values the server does not know
    else:
        msg.batch_size, msg.world_size, msg.rank = rng.choice(big), rng.choice(big), rng.choice(big)
        msg.start_batch, msg.end_batch = rng.choice([5, U64]), rng.choice([1, 2])
    return msg


def _mutate(body: bytes, rng: random.Random) -> bytes:
    data = bytearray(body or b"\x00")
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        if op == 0:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif op == 1:
            del data[rng.randrange(len(data)):]
            data = data or bytearray(b"\xff")
        elif op == 2:
            data += data[: rng.randrange(len(data) + 1)]
        else:
            data.insert(rng.randrange(len(data) + 1), rng.choice([0x08, 0x0A, 0x12, 0xFF, 0x80]))
    return bytes(data)


def _garbage(rng: random.Random) -> bytes:
    n = rng.choice([0, 1, 2, 5, 16, 100, 1000, 64 << 10])
    return rng.randbytes(n)


def make_calls(datasets: list[str], seed: int, count: int) -> list[FuzzCall]:
    """`count` calls, the same for the same (datasets, seed)."""
    rng = random.Random(seed)
    calls: list[FuzzCall] = []
    valid_bodies: dict[str, Callable[[], bytes]] = {
        "StreamEpoch": lambda: _valid_stream(datasets, rng).SerializeToString(),
        "DescribeDataset": lambda: pb.DescribeDatasetRequest(name=rng.choice(datasets)).SerializeToString(),
        "ListDatasets": lambda: b"",
        "Check": lambda: health_pb2.HealthCheckRequest(service=rng.choice(["", "croupier.v1.Croupier"])).SerializeToString(),
    }
    for _ in range(count):
        method = rng.choices(["StreamEpoch", "DescribeDataset", "ListDatasets", "Check", "Unknown"],
                             weights=[50, 25, 8, 10, 7])[0]
        kind = rng.choices(["garbage", "mutated", "extreme", "valid"], weights=[30, 30, 30, 10])[0]
        if method == "Unknown":
            path = SERVICE + rng.choice(["Nope", "streamEpoch", "StreamEpoch/x", ""]) if rng.random() < 0.7 else "/x.Y/Z"
            calls.append(FuzzCall(path, kind, _garbage(rng)))
            continue
        path = (HEALTH if method == "Check" else SERVICE) + method
        if kind == "garbage":
            body = _garbage(rng)
        elif kind == "mutated":
            body = _mutate(valid_bodies[method](), rng)
        elif kind == "extreme":
            if method == "StreamEpoch":
                body = _extreme_stream(datasets, rng).SerializeToString()
            elif method == "DescribeDataset":
                body = pb.DescribeDatasetRequest(name=_hostile_name(rng, datasets)).SerializeToString()
            elif method == "Check":
                body = health_pb2.HealthCheckRequest(service=_hostile_name(rng, datasets)).SerializeToString()
            else:  # ListDatasets takes no fields: unknown ones must be ignored
                body = pb.DescribeDatasetRequest(name=_hostile_name(rng, datasets)).SerializeToString()
        else:
            body = valid_bodies[method]()
        calls.append(FuzzCall(path, kind, body, streaming=method == "StreamEpoch"))
    return calls


async def _one(channel: grpc.aio.Channel, call: FuzzCall, deadline_s: float, max_messages: int) -> grpc.StatusCode:
    try:
        if call.streaming:
            stream = channel.unary_stream(call.method)(call.body, timeout=deadline_s)
            n = 0
            async for _ in stream:
                n += 1
                if n >= max_messages:
                    stream.cancel()
                    return grpc.StatusCode.OK
            return grpc.StatusCode.OK
        await channel.unary_unary(call.method)(call.body, timeout=deadline_s)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    except asyncio.CancelledError:
        return grpc.StatusCode.CANCELLED


def _short(call: FuzzCall) -> str:
    return f"{call.method} {call.kind} {call.body[:48]!r}{'...' if len(call.body) > 48 else ''}"


async def fuzz(address: str, datasets: list[str], *, seed: int = 0, count: int = 2000, concurrency: int = 32,
               deadline_s: float = 10.0, max_messages: int = 4,
               progress: Callable[[int, int], None] | None = None) -> FuzzReport:
    """Send `count` fuzzed calls to the server at `address` and count what came back."""
    report = FuzzReport(requests=count)
    calls = make_calls(datasets, seed, count)
    # Bodies of up to 64 KiB and names that long: the default client limits would refuse
    # some answers before the server sees the question.
    options = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 16 << 20),
               ("grpc.enable_retries", 0)]
    started = time.perf_counter()
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        gate = asyncio.Semaphore(concurrency)
        done = 0

        async def run(call: FuzzCall) -> None:
            nonlocal done
            async with gate:
                code = await _one(channel, call, deadline_s, max_messages)
            report.statuses[(call.method.rsplit("/", 1)[-1] or call.method, code.name)] += 1
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                report.hangs.append(_short(call))
            elif code in VAGUE:
                report.vague.append(f"{code.name}: {_short(call)}")
            done += 1
            if progress is not None and done % 500 == 0:
                progress(done, count)

        await asyncio.gather(*(run(c) for c in calls))
        try:
            await channel.unary_unary(HEALTH + "Check")(health_pb2.HealthCheckRequest().SerializeToString(),
                                                        timeout=10)
            report.alive_after = True
        except grpc.aio.AioRpcError:
            report.alive_after = False
    report.seconds = time.perf_counter() - started
    return report
