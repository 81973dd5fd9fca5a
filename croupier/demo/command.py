"""`croupier demo`: the main job end to end on one machine, with no network and no setup.

It writes scikit-learn's handwritten digits once to a cache (ImageFolder PNGs, tar
shards and Arrow tables, split 80/20 into train and test), starts `croupier serve` on a
free loopback port, launches WORLD_SIZE trainer ranks with torch.distributed (NCCL when
each rank can have a GPU of its own, else gloo on CPUs) that train an RTP-sharded CNN on
batches streamed from the server, prints live progress and a summary (held-out
accuracy, samples/s, out-of-order arrivals, time waiting for data), then stops the
server and the ranks.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

from croupier.protocol.security import check_address

DESCRIPTION = __doc__.split("\n\n", 1)[1] + """
Examples:
  croupier demo                                  # the digits, 2 ranks, 10 epochs
  croupier demo --ordered --latency-ms 5         # the ablation: one read at a time, slow storage
  croupier demo --data /data/pets/train --test-data /data/pets/val --image-size 32
  croupier demo --server 10.0.0.5:50051 --server 10.0.0.6:50051   # use running replicas
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train a sharded model end to end on embedded data",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=10, help="(default 10)")
    g.add_argument("--world-size", type=int, default=2, help="trainer ranks, each holding 1/N of the model (default 2)")
    g.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default 32)")
    g.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    g.add_argument("--seed", type=int, default=0, help="seeds the shuffle of every epoch and the weights (default 0)")
    g.add_argument("--timeout", type=float, default=900.0, help="seconds before the job is stopped (default 900)")
    g.add_argument("--summary-json", default="", help="also write the summary here as JSON")
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="PATH", help="train on your own dataset instead (ImageFolder, tar shards, "
                   "Arrow, Parquet, save_to_disk folder: anything `croupier serve` reads)")
    g.add_argument("--test-data", metavar="PATH", help="held-out split of --data for the final accuracy")
    g.add_argument("--format", choices=("imagefolder", "webdataset", "arrow"), default="imagefolder",
                   help="which copy of the embedded digits to serve (default imagefolder)")
    g.add_argument("--cache", metavar="DIR", help="where the digits are written "
                   "(default $CROUPIER_CACHE/demo or ~/.cache/croupier/demo)")
    g.add_argument("--prepare-only", action="store_true",
                   help="write the digits, print their paths and the serve command, and exit")
    g.add_argument("--num-classes", type=int, default=0, help="classes of a table dataset (image folders know theirs)")
    g.add_argument("--image-size", type=int, default=0, help="resize images to SIZE x SIZE (for mixed sizes)")
    g.add_argument("--label-column", default="label", help="(table datasets; default label)")
    g.add_argument("--features", default="", help="comma-separated feature columns (default: all numeric ones)")
    g = p.add_argument_group("server")
    g.add_argument("--server", action="append", default=[], metavar="ADDR",
                   help="use running croupier replicas (repeat or comma-separate) instead of starting one; "
                        "they must serve --train-name and --test-name")
    g.add_argument("--train-name", default="digits", help="dataset name on --server (default digits)")
    g.add_argument("--test-name", default="digits-test", help="held-out dataset on --server (default digits-test; "
                   "'' for none)")
    g.add_argument("--ordered", action="store_true", help="the ablation: fetch one sample at a time, in order")
    g.add_argument("--latency-ms", type=float, help="inject this median storage latency into every read")
    from croupier.protocol.security import add_client_arguments

    add_client_arguments(p.add_argument_group("connection security, with --server (README, Security)"))
    p.set_defaults(func=cmd_demo)


def _say(message: str) -> None:
    print(f"croupier demo: {message}", flush=True)


def _served_datasets(args: argparse.Namespace) -> tuple[list[str], str, str, int]:
    """(`croupier serve` dataset arguments, train name, test name, classes or 0 to ask the server)."""
    if args.data:
        specs = [f"data={args.data}"] + ([f"data-test={args.test_data}"] if args.test_data else [])
        return specs, "data", "data-test" if args.test_data else "", args.num_classes
    from croupier.demo.data import NUM_CLASSES, prepare

    t = time.perf_counter()
    data = prepare(Path(args.cache) if args.cache else None)
    _say(f"digits ready in {data.root} ({time.perf_counter() - t:.1f}s; 1,797 images of 8x8, every 5th of each class held out)")
    return data.dataset_specs(args.format), "digits", "digits-test", NUM_CLASSES


def _prepare_only(args: argparse.Namespace) -> int:
    from croupier.demo.data import FORMATS, prepare

    data = prepare(Path(args.cache) if args.cache else None)
    for fmt in FORMATS:
        print(f"{fmt:<12} train {data.path('train', fmt)}\n{'':<12} test  {data.path('test', fmt)}")
    print("serve them with:\n  croupier serve " + " ".join(data.dataset_specs(args.format)))
    return 0


def _check_reachable(addresses: tuple[str, ...], timeout_s: float = 15.0, security=None) -> None:
    """Fail in seconds, naming the address, when no server answers its health check:
    otherwise the ranks would wait out their whole timeout retrying."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from croupier.protocol.security import ClientSecurity

    security = security or ClientSecurity.resolve()
    credentials = security.channel_credentials()
    failures = []
    for address in addresses:
        with (grpc.insecure_channel(address) if credentials is None else
              grpc.secure_channel(address, credentials, options=security.channel_options())) as channel:
            try:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s,
                                                          metadata=security.metadata(address) or None)
            except grpc.RpcError as exc:
                failures.append(f"{address} ({exc.code().name}: {exc.details()})")
    if len(failures) == len(addresses):
        hint = " (is the loopback interface up?)" if any(a.startswith(("127.", "localhost", "[::1]")) for a in addresses) else ""
        raise RuntimeError(f"no croupier server answers at {', '.join(failures)}{hint}")
    for failure in failures:
        _say(f"server {failure} does not answer; its ranks start on another replica")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM too stops the server and the ranks before exiting


def cmd_demo(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    if args.prepare_only:
        return _prepare_only(args)
    if args.world_size < 1 or args.epochs < 1 or args.batch_size < 1:
        print("croupier demo: --world-size, --epochs and --batch-size must be at least 1", file=sys.stderr)
        return 2
    from croupier.demo.procs import RankGroup, ServerProcess
    from croupier.demo.train import TrainOptions, pick_backend

    t0 = time.perf_counter()
    from croupier.protocol.security import security_from_args

    servers = tuple(a for s in args.server for a in s.split(",") if a)
    try:
        for address in servers:
            check_address(address)
        security = security_from_args(args)
        for address in servers:
            security.metadata(address)
    except ValueError as exc:
        print(f"croupier demo: --server: {exc}", file=sys.stderr)
        return 2
    server: ServerProcess | None = None
    ranks: RankGroup | None = None
    with tempfile.TemporaryDirectory(prefix="croupier-demo-") as tmp:
        try:
            if servers:
                train, test, classes = args.train_name, args.test_name, args.num_classes
                if args.latency_ms is not None:
                    _say("--latency-ms is a server setting: ignored with --server")
            else:
                specs, train, test, classes = _served_datasets(args)
                extra = ["--latency-ms", str(args.latency_ms)] if args.latency_ms is not None else []
                server = ServerProcess(specs, Path(tmp), extra).start()
                servers = (server.address,)
                _say(f"croupier serve up on {server.address} (pid {server.proc.pid}) serving "
                     + ", ".join(specs))
            _check_reachable(servers, security=security if args.server else None)
            opts = TrainOptions(
                servers=servers, train=train, test=test, epochs=args.epochs, batch_size=args.batch_size,
                seed=args.seed, lr=args.lr, ordered=args.ordered, num_classes=classes, image_size=args.image_size,
                label_column=args.label_column, features=tuple(f for f in args.features.split(",") if f),
                summary_json=args.summary_json, timeout_s=args.timeout,
                **({} if not args.server else dict(
                    tls=bool(args.tls), tls_ca=args.tls_ca or "", tls_cert=args.tls_cert or "", tls_key=args.tls_key or "",
                    tls_server_name=args.tls_server_name or "", token_file=args.token_file or "")),
            )
            # The ranks run on this machine with LOCAL_WORLD_SIZE = world size: they pick the same.
            backend = pick_backend(args.world_size)
            _say(f"{args.world_size} ranks ({backend}), each holding 1/{args.world_size} of the model (RTP); "
                 f"{args.epochs} epoch{'s' if args.epochs != 1 else ''} of batch {args.batch_size} per rank, "
                 f"{'ordered' if args.ordered else 'unordered'} fetching")
            ranks = RankGroup("croupier.demo.train", opts.to_argv(), args.world_size, Path(tmp))
            codes = ranks.wait(args.timeout)
        except KeyboardInterrupt:
            _say("interrupted: stopping")
            return 130
        except (RuntimeError, TimeoutError) as exc:
            print(f"croupier demo: {exc}", file=sys.stderr)
            return 1
        finally:
            if ranks is not None:
                ranks.stop()
            if server is not None:
                server.stop()
        if any(c != 0 for c in codes):
            print(f"croupier demo: rank exit codes {codes}\n{ranks.failure_report()}", file=sys.stderr)
            return 1
    stopped = f"; server on {servers[0]} stopped" if server is not None else ""
    _say(f"done in {time.perf_counter() - t0:.1f}s{stopped}")
    return 0
