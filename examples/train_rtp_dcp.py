"""A torchtitan-style loop: RTP-sharded GPT, croupier's Loader, checkpoints with torch.distributed.checkpoint.

    torchrun --standalone --nproc-per-node 3 --max-restarts 0 examples/train_rtp_dcp.py \
        --servers 127.0.0.1:50051 --dataset text --checkpoint-dir runs/dcp --epochs 1

Every `--checkpoint-every` steps the ranks call `dcp.save` on one dict of Stateful
objects, as torchtitan's CheckpointManager does: the model (RTP's unsharded weights,
gathered, so any world size can load them), the Loader's position (`LoaderStates`: every
rank's state, so each rank resumes exactly where it stood, and a job restarted with
another number of ranks deals the rest of the epoch anew, nothing lost or repeated) and
the step. Start the same command again, with the same or another `--nproc-per-node`, and
`dcp.load` resumes from the latest checkpoint.

The optimizer is SGD without momentum: it has no state, so a checkpoint holds everything
a resume at another world size needs (RTP's optimizer state is sharded per rank:
`model.save_sharded(folder, optimizer)` keeps it, for a restart at the same world size).

`--fail-rank R --fail-after-step K` makes rank R exit with status 1 after step K, as a
lost node does: `torchrun --max-restarts 0` then stops the job, and the next launch
resumes from the checkpoint before it (tests/test_torchrun_elastic.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from croupier.client import Loader
from croupier.client.dcp_state import LoaderStates
from croupier.client.rtp import RotatedTensorParallel, destroy_process_group

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt_model import GPT, GPTConfig  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", required=True, help="croupier replicas, comma-separated host:port")
    p.add_argument("--dataset", default="text", help="served dataset with an input_ids list column (default text)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--epochs", type=int, default=1, help="stop after this many epochs (default 1)")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (default 0: no limit)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and every epoch's shuffle")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--context", type=int, default=256, help="longest sequence the model takes (default 256)")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("runs/dcp"))
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (default 50)")
    p.add_argument("--fail-rank", type=int, default=-1, help="fault injection: this rank exits after --fail-after-step")
    p.add_argument("--fail-after-step", type=int, default=0)
    return p.parse_args(argv)


class ModelState:
    """RTP's weights for DCP as full tensors: the same on every rank (DCP writes them once)
    and loadable at any world size, each rank taking its own shard."""

    def __init__(self, model: RotatedTensorParallel) -> None:
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.full_state_dict()  # collective, as dcp.save is

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_full_state_dict(state)


def save(root: Path, state: dict[str, Any], step: int) -> None:
    """`dcp.save` into step-NNNNNNN/, then `latest` names it: a crash mid-save leaves the previous one in charge."""
    folder = root / f"step-{step:07d}"
    dcp.save(state, checkpoint_id=folder)
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest.tmp").write_text(folder.name)
        os.replace(root / "latest.tmp", root / "latest")


def load(root: Path, state: dict[str, Any]) -> bool:
    pointer = root / "latest"
    if not pointer.exists():
        return False
    dcp.load(state, checkpoint_id=root / pointer.read_text().strip())
    return True


def next_epoch(loader: Loader) -> int:
    """The epoch the next pass yields: the Loader's, or the next once its last batch was handed out."""
    s = loader.state_dict()
    return s["epoch"] + int(s["num_rows"] is not None and s["position"] == s["num_rows"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)  # identical initial weights on every rank before sharding
    model = RotatedTensorParallel(GPT(GPTConfig(block=args.context, layers=args.layers, heads=args.heads,
                                                width=args.width)).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loader = Loader(args.dataset, servers=args.servers.split(","), batch_size=args.batch_size, seed=args.seed,
                    columns=["input_ids"], device=device if use_cuda else None, pin_memory=use_cuda)
    progress = {"step": 0}
    state = {"model": ModelState(model), "dataloader": LoaderStates(loader), "progress": progress}
    resumed = load(args.checkpoint_dir, state)  # fills progress["step"] in place
    step = progress["step"]
    if rank == 0:
        print(f"train_rtp_dcp: {world} ranks, {'resuming at step ' + str(step) if resumed else 'from scratch'} "
              f"(epoch {loader.epoch}, {len(loader)} batches per rank in this pass)", flush=True)
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    log = open(args.checkpoint_dir / f"rank{rank}.jsonl", "a")  # what each step trained on, for audits
    while next_epoch(loader) < args.epochs and not (args.max_steps and step >= args.max_steps):
        for b in loader.batches():
            ids = b.data["input_ids"].long()
            loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            log.write(json.dumps({"step": step, "world": world, "epoch": b.epoch, "batch": b.batch,
                                  "loss": loss.item(), "indices": b.indices[~b.padding].tolist()}) + "\n")
            log.flush()
            if rank == args.fail_rank and step == args.fail_after_step:
                os._exit(1)  # a lost node: no checkpoint, no goodbye
            if step % args.checkpoint_every == 0:
                progress["step"] = step
                save(args.checkpoint_dir, state, step)
            if args.max_steps and step >= args.max_steps:
                break
    progress["step"] = step
    save(args.checkpoint_dir, state, step)
    if rank == 0:
        print(f"train_rtp_dcp: finished at step {step}, epoch {loader.epoch}; checkpoint in {args.checkpoint_dir}",
              flush=True)
    log.close()
    destroy_process_group()  # croupier's: safe to exit after (see client/rtp/teardown.py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
