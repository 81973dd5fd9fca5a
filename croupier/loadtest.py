"""`croupier loadtest`: a gRPC load test of a croupier server, in the manner of ghz.

    croupier loadtest 127.0.0.1:50051 -c 16 --connections 4 -n 200 \\
        -d '{"dataset": "rows", "batch_size": 64, "world_size": 16, "rank": {{.WorkerID}}, "end_batch": 20}'

The target is one HOST:PORT, several (comma-separated: replicas), or dns:///NAME:PORT for
every address the name resolves to, as the Loader takes them: worker w calls replica
w % n of the sorted addresses, as the Loader starts rank r on replica r % n, and the
report counts each replica's calls and samples apart. Each call is one StreamEpoch stream
read to its end. `--data` is the request as JSON
(protobuf JSON names of StreamEpochRequest); like ghz, `{{.RequestNumber}}` and
`{{.WorkerID}}` in it are replaced per call before parsing. `--concurrency` workers
share `--connections` channels; the run stops after `--total` calls or `--duration`
seconds, after an optional `--warmup` whose calls are reported apart. Every call has a
deadline (`--timeout`), so the run is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from croupier.protocol.security import ClientSecurity, add_client_arguments, check_address, security_from_args

if TYPE_CHECKING:  # the client (grpc) is imported when a run starts, not when the command line is built
    from croupier.client.connection import Resolver

CALL = "croupier.v1.Croupier.StreamEpoch"
PERCENTILES = (50, 90, 99, 99.9)


@dataclass(frozen=True)
class LoadOptions:
    #: HOST:PORT, several comma-separated, or dns:///NAME:PORT (client/connection.py Servers).
    target: str = "127.0.0.1:50051"
    data: str = '{"dataset": "rows", "batch_size": 64}'
    concurrency: int = 10
    connections: int = 1
    #: Calls to make (after the warm-up); None with a duration means "until the duration".
    total: int | None = 200
    duration_s: float | None = None
    warmup_s: float = 0.0
    #: Deadline of every call.
    timeout_s: float = 20.0
    #: With a duration: "wait" lets calls in flight at the end finish, "cancel" cancels them.
    duration_stop: str = "wait"

    @property
    def targets(self) -> list[str]:
        return [t.strip() for t in self.target.split(",") if t.strip()]

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.connections < 1:
            raise ValueError("concurrency and connections must be at least 1")
        if self.total is None and self.duration_s is None:
            raise ValueError("give a --total or a --duration: the load test must be bounded")
        if self.total is not None and self.total < 1:
            raise ValueError(f"total must be at least 1, got {self.total}")
        if self.duration_stop not in ("wait", "cancel"):
            raise ValueError(f"duration_stop must be 'wait' or 'cancel', got {self.duration_stop!r}")


def render_request(template: str, request_number: int, worker_id: int) -> Any:
    """The StreamEpochRequest of one call, from the JSON template (ghz's two variables)."""
    from google.protobuf import json_format

    from croupier.v1 import croupier_pb2 as pb

    text = template.replace("{{.RequestNumber}}", str(request_number)).replace("{{.WorkerID}}", str(worker_id))
    try:
        return json_format.Parse(text, pb.StreamEpochRequest())
    except json_format.ParseError as exc:
        raise ValueError(f"--data is not a StreamEpochRequest as JSON: {exc}\n  {text}") from None


@dataclass
class CallResult:
    code: str
    duration_s: float
    target: str = ""
    samples: int = 0
    bytes: int = 0
    batches: int = 0
    first_sample_s: float | None = None
    batch_latencies_s: list[float] = field(default_factory=list)
    detail: str = ""


async def one_call(stub: Any, request: Any, timeout_s: float, metadata: tuple = (), target: str = "") -> CallResult:
    import grpc

    t0 = time.perf_counter()
    r = CallResult(code="OK", duration_s=0.0, target=target)
    last = t0
    call = stub.StreamEpoch(request, timeout=timeout_s, metadata=metadata or None)
    try:
        async for msg in call:
            if not msg.HasField("chunk"):
                continue
            chunk = msg.chunk
            now = time.perf_counter()
            if r.first_sample_s is None and len(chunk.indices):
                r.first_sample_s = now - t0
            r.samples += len(chunk.indices)
            r.bytes += len(chunk.arrow_ipc) + sum(len(im.data) for im in chunk.images)
            for _ in chunk.completed_batches:
                r.batch_latencies_s.append(now - last)
                last = now
                r.batches += 1
    except grpc.aio.AioRpcError as exc:
        r.code, r.detail = exc.code().name, exc.details() or ""
    except asyncio.CancelledError:
        call.cancel()
        r.code = "CANCELLED"
    r.duration_s = time.perf_counter() - t0
    return r


@dataclass
class Replica:
    """One replica's channels (`--connections` of them) and the metadata its calls carry."""

    address: str
    channels: list[Any]
    stubs: list[Any]
    metadata: tuple


async def _phase(replicas: list[Replica], opts: LoadOptions, total: int | None, seconds: float | None,
                 numbers: itertools.count) -> tuple[list[CallResult], float]:
    """Run workers until `total` calls were issued or `seconds` passed; returns results and wall time.
    Worker w calls replica w % n on its channel (w // n) % connections."""
    results: list[CallResult] = []
    issued = itertools.count()
    t0 = time.perf_counter()
    deadline = t0 + seconds if seconds is not None else math.inf

    async def worker(wid: int) -> None:
        replica = replicas[wid % len(replicas)]
        stub = replica.stubs[(wid // len(replicas)) % len(replica.stubs)]
        while time.perf_counter() < deadline:
            if total is not None and next(issued) >= total:
                return
            request = render_request(opts.data, next(numbers), wid)
            results.append(await one_call(stub, request, opts.timeout_s, replica.metadata, replica.address))

    tasks = [asyncio.create_task(worker(w)) for w in range(opts.concurrency)]
    if seconds is None:
        await asyncio.gather(*tasks)
    else:
        done, pending = await asyncio.wait(tasks, timeout=seconds)
        if pending and opts.duration_stop == "cancel":
            for t in pending:
                t.cancel()
        # "wait": calls in flight finish (each bounded by its deadline); workers issue no more.
        await asyncio.gather(*pending, return_exceptions=True)
    return results, time.perf_counter() - t0


def summarize_latency(values: list[float], buckets: int = 10) -> dict[str, Any]:
    """Percentiles and a ghz-style histogram of latencies in seconds."""
    if not values:
        return {"count": 0}
    a = np.asarray(values)
    counts, edges = np.histogram(a, bins=buckets)
    return {
        "count": int(a.size),
        "min": float(a.min()),
        "mean": float(a.mean()),
        "max": float(a.max()),
        "percentiles": {f"p{q:g}": float(np.percentile(a, q)) for q in PERCENTILES},
        "histogram": [{"le": float(e), "count": int(c)} for e, c in zip(edges[1:], counts)],
    }


def summarize(results: list[CallResult], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.code == "OK"]
    samples = sum(r.samples for r in results)
    nbytes = sum(r.bytes for r in results)
    wall = max(wall_s, 1e-9)
    return {
        "calls": len(results),
        "ok": len(ok),
        "seconds": wall_s,
        "streams_per_s": len(ok) / wall,
        "samples": samples,
        "samples_per_s": samples / wall,
        "bytes": nbytes,
        "mb_per_s": nbytes / wall / 1e6,
        "batches": sum(r.batches for r in results),
        "status_codes": dict(Counter(r.code for r in results)),
        "error_details": dict(Counter(f"{r.code}: {r.detail}" for r in results if r.code != "OK").most_common(5)),
        "time_to_first_sample": summarize_latency([r.first_sample_s for r in results if r.first_sample_s is not None]),
        "batch_latency": summarize_latency([x for r in results for x in r.batch_latencies_s]),
        "stream_duration": summarize_latency([r.duration_s for r in ok]),
        "per_target": per_target(results, wall),
    }


def per_target(results: list[CallResult], wall_s: float) -> dict[str, dict[str, float]]:
    """Each replica's calls, OK calls, samples and samples/s, as this client counted them."""
    out: dict[str, dict[str, float]] = {}
    for r in results:
        t = out.setdefault(r.target, {"calls": 0, "ok": 0, "samples": 0})
        t["calls"] += 1
        t["ok"] += r.code == "OK"
        t["samples"] += r.samples
    for t in out.values():
        t["samples_per_s"] = t["samples"] / max(wall_s, 1e-9)
    return dict(sorted(out.items()))


def _open_replicas(opts: LoadOptions, security: ClientSecurity, resolve: Resolver | None) -> list[Replica]:
    """`--connections` channels to every address the target stands for, in the Loader's order."""
    import grpc

    from croupier.client.connection import Servers, resolve_host
    from croupier.v1 import croupier_pb2_grpc as pb_grpc

    servers = Servers(opts.targets, resolve or resolve_host)
    credentials = security.channel_credentials()
    replicas = []
    for address in servers.refresh():
        options = [("grpc.max_receive_message_length", 256 << 20), ("grpc.enable_retries", 0),
                   # Separate channels must not share one TCP connection.
                   ("grpc.use_local_subchannel_pool", 1)] + security.channel_options()
        options += servers.channel_options(address, security)  # TLS: the certificate names the DNS name
        channels = [grpc.aio.insecure_channel(address, options=options) if credentials is None
                    else grpc.aio.secure_channel(address, credentials, options=options)
                    for _ in range(opts.connections)]
        replicas.append(Replica(address, channels, [pb_grpc.CroupierStub(ch) for ch in channels],
                                security.metadata(address)))
    return replicas


async def run_load_async(opts: LoadOptions, security: ClientSecurity | None = None,
                         resolve: Resolver | None = None) -> dict[str, Any]:
    """`security` (TLS, token) is kept out of `opts`: the report repeats opts, never a token.
    `resolve` finds the addresses of a dns:/// target (default: getaddrinfo)."""
    render_request(opts.data, 0, 0)  # a bad template fails before any call
    for target in opts.targets or [opts.target]:
        check_address(target)
    security = security or ClientSecurity.resolve()
    replicas = _open_replicas(opts, security, resolve)
    try:
        numbers = itertools.count()
        warmup = None
        if opts.warmup_s > 0:
            w_results, w_wall = await _phase(replicas, opts, None, opts.warmup_s, numbers)
            warmup = {k: v for k, v in summarize(w_results, w_wall).items()
                      if k in ("calls", "ok", "samples", "status_codes", "seconds")}
        results, wall = await _phase(replicas, opts, opts.total, opts.duration_s, numbers)
    finally:
        for replica in replicas:
            for channel in replica.channels:
                await channel.close()
    report = summarize(results, wall)
    report["warmup"] = warmup
    report["options"] = asdict(opts)
    return report


def run_load(opts: LoadOptions, security: ClientSecurity | None = None,
             resolve: Resolver | None = None) -> dict[str, Any]:
    """Blocking: run the load test on a fresh event loop (uvloop when installed)."""
    try:
        import uvloop

        return uvloop.run(run_load_async(opts, security, resolve))
    except ImportError:
        return asyncio.run(run_load_async(opts, security, resolve))


# ---- output -----------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def _latency_text(title: str, s: dict[str, Any]) -> list[str]:
    if not s.get("count"):
        return [f"{title}: none"]
    lines = [f"{title} ({s['count']}):",
             f"  fastest {_ms(s['min'])}  average {_ms(s['mean'])}  slowest {_ms(s['max'])}",
             "  " + "  ".join(f"{k} {_ms(v)}" for k, v in s["percentiles"].items())]
    top = max(b["count"] for b in s["histogram"]) or 1
    for b in s["histogram"]:
        lines.append(f"  {_ms(b['le']):>12} [{b['count']:>7}] |{'∎' * round(40 * b['count'] / top)}")
    return lines


def format_text(report: dict[str, Any]) -> str:
    o = report["options"]
    lines = [
        "Summary:",
        f"  Target:       {o['target']} ({CALL})",
        f"  Concurrency:  {o['concurrency']} workers on {o['connections']} connection(s)",
        f"  Calls:        {report['calls']} ({report['ok']} OK)",
        f"  Total:        {report['seconds']:.2f} s",
        f"  Streams/s:    {report['streams_per_s']:.2f}",
        f"  Samples/s:    {report['samples_per_s']:.0f} ({report['samples']} samples, {report['batches']} batches)",
        f"  MB/s:         {report['mb_per_s']:.2f}",
    ]
    if len(report["per_target"]) > 1:
        lines += [f"  Replica {a}: {t['calls']} calls ({t['ok']} OK), {t['samples']} samples, "
                  f"{t['samples_per_s']:.0f} samples/s" for a, t in report["per_target"].items()]
    if report.get("warmup"):
        w = report["warmup"]
        lines.append(f"  Warm-up:      {w['calls']} calls in {w['seconds']:.2f} s, not counted above")
    lines.append("")
    lines += _latency_text("Time to first sample", report["time_to_first_sample"])
    lines.append("")
    lines += _latency_text("Batch latency", report["batch_latency"])
    lines.append("")
    lines += _latency_text("Stream duration", report["stream_duration"])
    lines += ["", "Status code distribution:"]
    lines += [f"  [{code}]  {n} streams" for code, n in sorted(report["status_codes"].items())]
    if report["error_details"]:
        lines += ["", "Error distribution:"] + [f"  [{n}]  {d}" for d, n in report["error_details"].items()]
    return "\n".join(lines)


# ---- command line -----------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("loadtest", help="load-test a croupier server (like ghz)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", nargs="?", default="127.0.0.1:50051",
                   help="host:port, several comma-separated (replicas), or dns:///NAME:PORT (default 127.0.0.1:50051)")
    p.add_argument("--call", default=CALL, help=f"the method (only {CALL})")
    p.add_argument("-d", "--data", default='{"dataset": "rows", "batch_size": 64, "end_batch": 10}',
                   help="StreamEpochRequest as JSON; {{.RequestNumber}} and {{.WorkerID}} are substituted")
    p.add_argument("-D", "--data-file", help="read --data from this file")
    p.add_argument("-c", "--concurrency", type=int, default=10, help="concurrent workers (default 10)")
    p.add_argument("--connections", type=int, default=1, help="gRPC channels to each replica, shared by its workers (default 1)")
    p.add_argument("-n", "--total", type=int, help="calls to make (default 200 unless --duration)")
    p.add_argument("-z", "--duration", type=float, help="seconds to issue calls for")
    p.add_argument("--duration-stop", choices=["wait", "cancel"], default="wait",
                   help="at the end of --duration: let calls in flight finish, or cancel them")
    p.add_argument("--warmup", type=float, default=0.0, help="seconds of calls before measuring (reported apart)")
    p.add_argument("-t", "--timeout", type=float, default=20.0, help="deadline of each call in seconds (default 20)")
    p.add_argument("-O", "--format", choices=["text", "json"], default="text")
    p.add_argument("-o", "--output", help="write the report here instead of stdout")
    add_client_arguments(p.add_argument_group("connection security (README, Security)"))
    p.set_defaults(func=cmd_loadtest)


def cmd_loadtest(args: argparse.Namespace) -> int:
    if args.call != CALL:
        print(f"croupier loadtest: only {CALL} is supported, not {args.call}", file=sys.stderr)
        return 2
    data = open(args.data_file).read() if args.data_file else args.data
    total = args.total if args.total is not None else (None if args.duration else 200)
    try:
        opts = LoadOptions(target=args.target, data=data, concurrency=args.concurrency,
                           connections=args.connections, total=total, duration_s=args.duration,
                           warmup_s=args.warmup, timeout_s=args.timeout, duration_stop=args.duration_stop)
        report = run_load(opts, security_from_args(args))
    except ValueError as exc:
        print(f"croupier loadtest: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2) if args.format == "json" else format_text(report)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0 if report["ok"] == report["calls"] else 1
