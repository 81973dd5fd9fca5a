"""Train a small GPT on byte-level text served by croupier, RTP-sharded, with checkpoint/resume.

Launch with torchrun (one process per GPU, or per CPU rank with gloo):

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py \
        --servers 127.0.0.1:50051 --dataset text --checkpoint-dir runs/gpt

Every rank streams its part of each globally shuffled epoch from croupier (several
`--servers` replicas: rank r starts on servers[r % n] and fails over), holds 1/WORLD of
every layer's weights (RTP), and every `--checkpoint-every` steps writes its weight
shard, optimizer state and Loader position. A run started again with the same
`--checkpoint-dir` resumes from the latest checkpoint, at the next batch of the same
epoch: no sample is lost or repeated. SIGTERM (or Ctrl-C) stops all ranks at the same
step with a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from croupier.client import Loader
from croupier.client.rtp import RotatedTensorParallel, destroy_process_group

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt_model import GPT, GPTConfig  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", required=True, help="croupier replicas, comma-separated host:port")
    p.add_argument("--dataset", default="text", help="served dataset with an input_ids list column (default text)")
    p.add_argument("--val-dataset", default="", help="served validation split, evaluated at the end")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step (default 16)")
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and every epoch's shuffle")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--context", type=int, default=1024, help="longest sequence the model takes (default 1024)")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("runs/gpt"))
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (default 100)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--fresh", action="store_true", help="ignore existing checkpoints")
    return p.parse_args(argv)


class StopFlag:
    """SIGTERM/SIGINT on any rank stops every rank after the same step (one all-reduce a step)."""

    def __init__(self) -> None:
        self.raised = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._set)

    def _set(self, signum: int, frame: Any) -> None:
        self.raised = True

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor([float(self.raised)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


# ---- checkpoints: RTP's weight + optimizer shards, the Loader's position, `latest` last ----
def save_checkpoint(root: Path, step: int, model: RotatedTensorParallel, optimizer: torch.optim.Optimizer,
                    loader: Loader) -> None:
    folder = root / f"step-{step:07d}"
    model.save_sharded(folder, optimizer)  # rank{r}-of-{N}.pt: this rank's weights and optimizer state
    position = folder / f"loader-rank{dist.get_rank()}.json"
    position.with_suffix(".tmp").write_text(json.dumps({"step": step, "loader": loader.state_dict()}))
    os.replace(position.with_suffix(".tmp"), position)
    dist.barrier()  # every rank's files are on disk before `latest` names the step
    if dist.get_rank() == 0:
        (root / "latest.tmp").write_text(folder.name)
        os.replace(root / "latest.tmp", root / "latest")


def load_checkpoint(root: Path, model: RotatedTensorParallel, optimizer: torch.optim.Optimizer,
                    loader: Loader) -> int:
    """Restores the latest checkpoint under `root` if any; returns the step it was taken at."""
    pointer = root / "latest"
    if not pointer.exists():
        return 0
    folder = root / pointer.read_text().strip()
    model.load_sharded(folder, optimizer)
    saved = json.loads((folder / f"loader-rank{dist.get_rank()}.json").read_text())
    loader.load_state_dict(saved["loader"])  # taken at an epoch's end: the next pass is the next epoch
    return int(saved["step"])


def validate(model: torch.nn.Module, loader: Loader, device: torch.device) -> float:
    total = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for b in loader.batches():
            ids = b.data["input_ids"].long()
            real = torch.as_tensor(~b.padding, device=ids.device)
            loss = F.cross_entropy(model(ids[:, :-1]).transpose(1, 2), ids[:, 1:], reduction="none").mean(1)
            total += torch.stack([(loss * real).sum().double(), real.sum().double()])
    dist.all_reduce(total)
    return float(total[0] / total[1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # NCCL needs a GPU per rank on this node; with fewer, all ranks train on CPUs over gloo.
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    servers = [s for s in args.servers.split(",") if s]
    stop = StopFlag()

    torch.manual_seed(args.seed)  # identical initial weights on every rank before sharding
    gpt = GPT(GPTConfig(block=args.context, layers=args.layers, heads=args.heads, width=args.width)).to(device)
    model = RotatedTensorParallel(gpt)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    loader = Loader(args.dataset, servers=servers, batch_size=args.batch_size, seed=args.seed,
                    columns=["input_ids"], device=device if use_cuda else None, pin_memory=use_cuda)
    batches_per_epoch = len(loader)  # asked before iterating: the Loader's network thread is busy after
    step = 0 if args.fresh else load_checkpoint(args.checkpoint_dir, model, optimizer, loader)
    if rank == 0:
        print(f"train_gpt: {world} ranks, {sum(p.numel() for p in gpt.parameters()):,} weights "
              f"({'resuming at step ' + str(step) if step else 'from scratch'}; epoch {loader.epoch}, "
              f"batch {loader.state_dict()['next_batch']})", flush=True)
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    log = open(args.checkpoint_dir / f"rank{rank}.jsonl", "a")  # what each step trained on, for audits
    t0, tokens = time.perf_counter(), 0
    stopped = False
    while step < args.max_steps and not stopped:
        for b in loader.batches():
            ids = b.data["input_ids"].long()
            loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)  # the whole model's norm: RTP's shards summed over ranks
            optimizer.step()
            step += 1
            tokens += ids[:, 1:].numel()
            log.write(json.dumps({"step": step, "epoch": b.epoch, "batch": b.batch, "loss": loss.item(),
                                  "indices": b.indices.tolist()}) + "\n")
            log.flush()
            if rank == 0 and step % args.log_every == 0:
                rate = tokens * world / (time.perf_counter() - t0)
                print(f"step {step:>6}  epoch {b.epoch} batch {b.batch:>5}/{batches_per_epoch}  loss {loss.item():.4f}  "
                      f"{rate:,.0f} tokens/s  waited {loader.stats.wait_s:.2f}s", flush=True)
            stopped = stop.agreed(device)
            if stopped or step >= args.max_steps or step % args.checkpoint_every == 0:
                save_checkpoint(args.checkpoint_dir, step, model, optimizer, loader)
            if stopped or step >= args.max_steps:
                break
        # An epoch that ran out: the next pass of the Loader is the next epoch, reshuffled.
    if args.val_dataset and not stopped:
        val = Loader(args.val_dataset, servers=servers, batch_size=args.batch_size, seed=args.seed,
                     columns=["input_ids"], device=device if use_cuda else None)
        val_loss = validate(model, val, device)
        if rank == 0:
            print(f"validation loss {val_loss:.4f} ({val_loss / math.log(2):.3f} bits per byte)", flush=True)
    if rank == 0:
        print(f"train_gpt: {'stopped' if stopped else 'finished'} at step {step}; "
              f"checkpoint in {args.checkpoint_dir}", flush=True)
    log.close()
    destroy_process_group()  # croupier's: safe to exit after (see client/rtp/teardown.py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
