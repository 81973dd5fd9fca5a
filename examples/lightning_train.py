"""PyTorch Lightning with croupier: a LightningDataModule whose train_dataloader() is a Loader.

    croupier serve rows=synthetic:1000 --port 50051 &
    python examples/lightning_train.py --servers 127.0.0.1:50051 --dataset rows --devices 2 \
        --max-epochs 3 --checkpoint-dir runs/lightning --checkpoint-every 5
    # later, resume mid-epoch from the last checkpoint:
    python examples/lightning_train.py ... --resume runs/lightning/last.ckpt

Lightning passes a Loader through untouched (it adds a DistributedSampler only to a
`torch.utils.data.DataLoader`); each rank's Loader streams its own part of each epoch's
global shuffle, and a new pass starts the next epoch by itself. Lightning saves the
Loader's `state_dict()` in every checkpoint (the fit loop's "combined_loader" states of
stateful loaders) and loads it into the new Loader on `fit(ckpt_path=...)`, so a resumed
run continues the epoch at the batch after the checkpoint's. The model regresses the
synthetic dataset's `value` column (index / 2) on its `index`; with `--log-dir` each rank
appends what it trained on (epoch, global step, indices) to rank{r}.jsonl.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from croupier.client import Loader


class CroupierDataModule(L.LightningDataModule):
    """The training data of one rank, streamed from croupier."""

    def __init__(self, servers: list[str], dataset: str, batch_size: int, seed: int) -> None:
        super().__init__()
        self.servers, self.dataset, self.batch_size, self.seed = servers, dataset, batch_size, seed

    def train_dataloader(self) -> Loader:
        # The trainer knows the rank and world size before it asks for data (the Loader
        # would also take them from torch.distributed by itself). `epoch=` keeps the order
        # right when Lightning asks again (reload_dataloaders_every_n_epochs); a resume then
        # loads the checkpoint's Loader state into this Loader, which moves it mid-epoch.
        return Loader(self.dataset, servers=self.servers, batch_size=self.batch_size, seed=self.seed,
                      epoch=self.trainer.current_epoch, rank=self.trainer.global_rank,
                      world_size=self.trainer.world_size, columns=["index", "value"])


class Regression(L.LightningModule):
    """value ~ w * index + b, logging the indices each step trained on."""

    def __init__(self, log_dir: Path | None) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)
        self.log_dir = log_dir

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = batch["index"].float().unsqueeze(1) / 1000
        loss = torch.nn.functional.mse_loss(self.linear(x).squeeze(1), batch["value"].float() / 1000)
        if self.log_dir is not None:
            record = {"epoch": self.current_epoch, "step": self.global_step, "batch_idx": batch_idx,
                      "indices": batch["index"].tolist()}
            with open(self.log_dir / f"rank{self.global_rank}.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", nargs="+", default=["127.0.0.1:50051"])
    ap.add_argument("--dataset", default="rows")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--devices", type=int, default=2, help="CPU ranks (DDP over gloo)")
    ap.add_argument("--max-epochs", type=int, default=3)
    ap.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (-1: epochs decide)")
    ap.add_argument("--checkpoint-dir", type=Path, default=Path("runs/lightning"))
    ap.add_argument("--checkpoint-every", type=int, default=5, help="training steps between checkpoints")
    ap.add_argument("--resume", default=None, help="a checkpoint to resume from (fit(ckpt_path=...))")
    ap.add_argument("--log-dir", type=Path, default=None, help="append each rank's trained indices here")
    args = ap.parse_args(argv)

    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    checkpoints = ModelCheckpoint(dirpath=args.checkpoint_dir, every_n_train_steps=args.checkpoint_every,
                                  save_top_k=-1, filename="{epoch}-{step}", save_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp", max_epochs=args.max_epochs,
                        max_steps=args.max_steps, callbacks=[checkpoints], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    data = CroupierDataModule(args.servers, args.dataset, args.batch_size, args.seed)
    trainer.fit(Regression(args.log_dir), datamodule=data, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
