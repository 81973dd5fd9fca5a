"""Hugging Face accelerate with croupier: prepare() passes the Loader through, save_state keeps its place.

    croupier serve rows=synthetic:1000 --port 50051 &
    torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py \
        --servers 127.0.0.1:50051 --dataset rows --max-steps 200 --checkpoint-dir runs/accelerate
    # later, resume from a checkpoint:
    torchrun ... examples/accelerate_train.py ... --resume runs/accelerate/step-000100

`accelerator.prepare(model, optimizer, loader)` wraps a `torch.utils.data.DataLoader` (it
shards it and moves its batches); anything else, a croupier Loader included, comes back
as it was given: each rank's Loader already streams only its own part of every epoch,
so nothing is sharded twice. Batches go to `accelerator.device` because the Loader is
given that device. `accelerator.register_for_checkpointing(loader)` makes
`save_state`/`load_state` store and restore the Loader's `state_dict()` (saved by the main
process: every rank stands at the same step, and a Loader resumes from any rank's
state at the step all ranks reached). The loop counts steps: iterating the Loader again
after an epoch starts the next epoch, so no `set_epoch` is needed. With `--log-dir` each
rank appends what it trained on (epoch, step, indices) to rank{r}.jsonl.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from croupier.client import Loader


class Progress:
    """The step count, checkpointed beside the model, optimizer and Loader."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", nargs="+", default=["127.0.0.1:50051"])
    ap.add_argument("--dataset", default="rows")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--checkpoint-dir", type=Path, default=Path("runs/accelerate"))
    ap.add_argument("--checkpoint-every", type=int, default=50, help="steps between save_state calls")
    ap.add_argument("--resume", type=Path, default=None, help="a save_state folder to load_state from")
    ap.add_argument("--log-dir", type=Path, default=None, help="append each rank's trained indices here")
    args = ap.parse_args(argv)

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    loader = Loader(args.dataset, servers=args.servers, batch_size=args.batch_size, seed=args.seed,
                    rank=accelerator.process_index, world_size=accelerator.num_processes,
                    device=accelerator.device, columns=["index", "value"])
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    if prepared is not loader:  # accelerate wraps DataLoaders only; a Loader must come back untouched
        raise RuntimeError(f"accelerator.prepare wrapped the Loader in {type(prepared).__name__}")
    progress = Progress()
    accelerator.register_for_checkpointing(loader, progress)
    if args.resume is not None:
        accelerator.load_state(str(args.resume))
    log = None
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(args.log_dir / f"rank{accelerator.process_index}.jsonl", "a")

    while progress.step < args.max_steps:
        for batch in loader:  # the rest of the current epoch, or the next epoch once it ended
            x = batch["index"].float().unsqueeze(1) / 1000
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), batch["value"].float() / 1000)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            progress.step += 1
            if log is not None:
                log.write(json.dumps({"epoch": loader.epoch, "step": progress.step,
                                      "indices": batch["index"].tolist()}) + "\n")
                log.flush()
            if progress.step % args.checkpoint_every == 0:
                accelerator.save_state(str(args.checkpoint_dir / f"step-{progress.step:06d}"))
            if progress.step >= args.max_steps:
                break
    accelerator.print(f"accelerate_train: finished at step {progress.step}, epoch {loader.epoch}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
