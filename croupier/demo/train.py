"""One trainer rank of the demo: `python -m croupier.demo.train --servers ADDR ...`.

It reads its place in the job from torch.distributed's environment variables (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as `torchrun` or `croupier demo` or a container
sets them), streams its part of every epoch from croupier, trains an RTP-sharded model
(each rank holds 1/WORLD_SIZE of every layer's weights), evaluates on a held-out split
and, on rank 0, shows progress and prints the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from croupier.client import Loader
from croupier.client.rtp.teardown import destroy_process_group
from croupier.client.connection import RETRYABLE, Connection
from croupier.protocol.security import ClientSecurity
from croupier.demo.model import batch_inputs, build_model
from croupier.demo.progress import Progress, Summary, gather_rows

DEFAULT_TRAIN, DEFAULT_TEST = "digits", "digits-test"


@dataclass(frozen=True)
class TrainOptions:
    """What every rank needs to know; travels from `croupier demo` as command-line flags."""

    servers: tuple[str, ...]
    train: str = DEFAULT_TRAIN
    test: str = DEFAULT_TEST  # "" for none
    epochs: int = 10
    batch_size: int = 32
    seed: int = 0
    lr: float = 3e-3
    ordered: bool = False
    num_classes: int = 0  # 0: the server's class list (image datasets)
    image_size: int = 0  # 0: as stored; else images are resized to image_size x image_size
    label_column: str = "label"
    features: tuple[str, ...] = field(default_factory=tuple)
    summary_json: str = ""
    timeout_s: float = 600.0
    # Connection security (croupier/protocol/security.py); the token travels as a file or in
    # CROUPIER_TOKEN, never as a command-line value.
    tls: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""
    token_file: str = ""

    def security(self) -> ClientSecurity:
        token = None
        if self.token_file:
            try:
                token = Path(self.token_file).read_text().strip()
            except OSError as exc:
                raise SystemExit(f"croupier demo: --token-file {self.token_file}: {exc.strerror or exc}") from None
        return ClientSecurity.resolve(tls=self.tls or None, tls_ca=self.tls_ca or None, tls_cert=self.tls_cert or None,
                                      tls_key=self.tls_key or None, token=token,
                                      server_name=self.tls_server_name or None)

    def to_argv(self) -> list[str]:
        argv: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                argv += [flag] if value else []
            elif isinstance(value, tuple):
                argv += [flag, ",".join(value)]
            else:
                argv += [flag, str(value)]
        return argv


def parse_options(argv: Sequence[str] | None = None) -> TrainOptions:
    p = argparse.ArgumentParser(prog="python -m croupier.demo.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(TrainOptions):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            p.add_argument(flag, action="store_true")
        elif f.type.startswith("tuple"):
            p.add_argument(flag, type=lambda s: tuple(x for x in s.split(",") if x),
                           required=f.name == "servers", default=())
        else:
            kind = {"int": int, "float": float}.get(f.type, str)
            p.add_argument(flag, type=kind, default=f.default)
    args = p.parse_args(argv)
    from croupier.protocol.security import check_address

    for address in args.servers:
        try:
            check_address(address)
        except ValueError as exc:
            p.error(f"--servers: {exc}")
    return TrainOptions(**vars(args))


async def _describe(servers: Sequence[str], dataset: str, security: ClientSecurity | None = None):
    """The dataset's info from the first replica that answers."""
    import grpc

    last: Exception | None = None
    for address in servers:
        conn = Connection(address, security)
        try:
            return await conn.describe(dataset, timeout=30)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in RETRYABLE:
                hint = ("" if dataset != DEFAULT_TRAIN else
                        " (`croupier demo --prepare-only` writes the digits and prints the command that serves them)")
                raise SystemExit(f"croupier demo: {address}: {exc.details()}{hint}") from None
            last = exc
        finally:
            await conn.close()
    raise SystemExit(f"croupier demo: no server among {list(servers)} answered: {last}")


def _resize(size: int):
    def transform(sample: dict) -> dict:
        img = sample["image"].unsqueeze(0).float()
        img = F.interpolate(img, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        return {"image": img[0].round().clamp(0, 255).to(torch.uint8), "label": sample["label"]}

    return transform


def training_columns(info, label_column: str, features: Sequence[str]) -> tuple[str, ...]:
    """The columns a table dataset's batches need: the label and the named features, or
    (none named) every scalar numeric column. Other columns (text, variable-length
    lists) are not fetched, so they never reach collation. () for image datasets."""
    import pyarrow as pa

    if not info.arrow_schema:
        return ()
    schema = pa.ipc.read_schema(pa.py_buffer(info.arrow_schema))
    if label_column not in schema.names:
        raise SystemExit(f"croupier demo: dataset {info.name!r} has no label column {label_column!r}; "
                         f"columns: {schema.names} (pass --label-column)")
    if features:
        missing = [f for f in features if f not in schema.names]
        if missing:
            raise SystemExit(f"croupier demo: dataset {info.name!r} has no column {missing[0]!r}; columns: {schema.names}")
        return (label_column, *features)
    def numeric(t) -> bool:
        return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)

    # Scalar numeric columns; a table with none (the demo's own: `pixels` is a list of 64
    # uint8) trains on its numeric list columns, which must then be of one length.
    features = [f.name for f in schema if f.name != label_column and numeric(f.type)]
    if not features:
        features = [f.name for f in schema if f.name != label_column and (
            pa.types.is_list(f.type) or pa.types.is_large_list(f.type) or pa.types.is_fixed_size_list(f.type))
            and numeric(f.type.value_type)]
    if not features:
        raise SystemExit(f"croupier demo: dataset {info.name!r} has no numeric feature column besides "
                         f"{label_column!r}; columns: {schema.names} (name them with --features)")
    return (label_column, *features)


def _loader(opts: TrainOptions, dataset: str, rank: int, world: int, device: torch.device,
            columns: Sequence[str] = ()) -> Loader:
    return Loader(dataset, servers=list(opts.servers), batch_size=opts.batch_size, rank=rank, world_size=world,
                  seed=opts.seed, ordered=opts.ordered, transform=_resize(opts.image_size) if opts.image_size else None,
                  device=device if device.type != "cpu" else None, pin_memory=device.type == "cuda",
                  columns=columns, security=opts.security())


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    from croupier.client.rtp import RotatedTensorParallel

    return RotatedTensorParallel(model)


def evaluate(model: torch.nn.Module, loader: Loader, opts: TrainOptions) -> tuple[int, int]:
    """(correct, total) over this rank's share of the test set, padding excluded."""
    correct = total = 0
    model.eval()
    with torch.no_grad():
        for b in loader.batches():
            x, y = batch_inputs(b.data, opts.label_column, opts.features)
            real = torch.as_tensor(~b.padding, device=y.device)
            correct += int(((model(x).argmax(1) == y) & real).sum())
            total += int(real.sum())
    model.train()
    return correct, total


def pick_backend(local_world_size: int) -> str:
    """NCCL needs a GPU per rank on this node; with fewer, all ranks train on CPUs over gloo.

    `croupier demo` asks the same question before it starts its ranks, to say which it will be.
    """
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size else "gloo"


def train(opts: TrainOptions) -> Summary | None:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    backend = pick_backend(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if backend == "nccl" else "cpu")
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=opts.timeout_s))
    try:
        return _train(opts, rank, world, device)
    finally:
        destroy_process_group()  # croupier's: safe to exit after (see client/rtp/teardown.py)


def _train(opts: TrainOptions, rank: int, world: int, device: torch.device) -> Summary | None:
    info = asyncio.run(_describe(opts.servers, opts.train, opts.security()))
    num_classes = opts.num_classes or len(info.classes)
    if num_classes < 2:
        raise SystemExit(f"croupier demo: dataset {opts.train!r} has no class list; pass --num-classes")
    columns = training_columns(info, opts.label_column, opts.features)
    loader = _loader(opts, opts.train, rank, world, device, columns)
    progress = Progress(opts.epochs, len(loader), show=rank == 0)  # len() before iterating: it asks the server
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    train_s = 0.0
    row: dict[str, float] = {}

    def gather() -> list[dict[str, float]]:
        return gather_rows(_with_stats(row, loader, train_s), rank, world, device)

    for epoch in range(opts.epochs):
        loader.set_epoch(epoch)
        row = dict(epoch_loss_sum=0.0, epoch_steps=0, epoch_correct=0, epoch_seen=0)
        t = time.perf_counter()
        for b in loader.batches():
            x, y = batch_inputs(b.data, opts.label_column, opts.features)
            if model is None:  # built from the first batch: its shape decides CNN or MLP
                torch.manual_seed(opts.seed)  # reproducible initial weights
                model = _shard(build_model(x, num_classes).to(device))
                optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=1e-4)
            assert optimizer is not None
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            row["epoch_loss_sum"] += loss.item()
            row["epoch_steps"] += 1
            row["epoch_correct"] += int((logits.argmax(1) == y).sum())
            row["epoch_seen"] += len(y)
            train_s += time.perf_counter() - t
            progress.step(epoch, gather())
            t = time.perf_counter()  # the progress all-reduce is not training time
        progress.end_epoch(epoch, gather())
    progress.close()
    assert model is not None, "the training set gave no batch"
    rows = gather()
    correct = total = 0
    if opts.test:
        correct, total = evaluate(model, _loader(opts, opts.test, rank, world, device, columns), opts)
        counts = torch.tensor([correct, total], dtype=torch.int64, device=device)
        dist.all_reduce(counts)
        correct, total = (int(v) for v in counts.tolist())
    if rank != 0:
        return None
    summary = _summary(opts, rows, correct, total, loader, info.num_rows, world)
    print(summary.text(), flush=True)
    if opts.summary_json:
        summary.write_json(opts.summary_json)
    return summary


def _summary(opts: TrainOptions, rows: list[dict[str, float]], correct: int, total: int, loader: Loader,
             num_rows: int, world: int) -> Summary:
    rates = [r["samples"] / r["train_s"] if r["train_s"] else 0.0 for r in rows]
    return Summary(
        accuracy=correct / total if total else None,
        test_correct=correct,
        test_samples=total,
        epochs=opts.epochs,
        train_samples=int(sum(r["samples"] for r in rows)),
        train_s=max(r["train_s"] for r in rows),
        samples_per_s=sum(rates),
        samples_per_s_by_rank=rates,
        out_of_order=int(sum(r["out_of_order"] for r in rows)),
        wait_s_by_rank=[r["wait_s"] for r in rows],
        first_batch_s=loader.stats.first_batch_s,
        final_train_loss=sum(r["epoch_loss_sum"] for r in rows) / max(1.0, sum(r["epoch_steps"] for r in rows)),
        dataset=f"{num_rows:,} rows of {opts.train}" + (f" (held out: {opts.test})" if opts.test else ""),
        servers=list(opts.servers),
        ordered=opts.ordered,
        world_size=world,
        backend=str(dist.get_backend()),
    )


def _with_stats(row: dict[str, float], loader: Loader, train_s: float) -> dict[str, float]:
    s = loader.stats
    return {**row, "samples": s.samples, "train_s": train_s, "wait_s": s.wait_s, "out_of_order": s.out_of_order}


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_options(argv)
    # One rank per core share unless OMP_NUM_THREADS says otherwise: oversubscribed cores stall the ring.
    share = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or share))
    try:
        train(opts)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank; `croupier demo` reports it once
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
