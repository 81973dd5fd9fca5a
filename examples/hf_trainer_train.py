"""Hugging Face Trainer with croupier: the Loader as the train dataloader, its place saved with each checkpoint.

    croupier serve rows=synthetic:1000 --port 50051 &
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer_train.py \
        --servers 127.0.0.1:50051 --dataset rows --max-steps 200 --output-dir runs/hf-trainer
    # later, resume from a checkpoint:
    torchrun ... examples/hf_trainer_train.py ... --resume runs/hf-trainer/checkpoint-100

Trainer builds its DataLoader in `get_train_dataloader()`; `LoaderTrainer` returns a croupier
Loader there instead (rank and world size from the TrainingArguments). Trainer takes the
epoch's steps from `len()` and calls `set_epoch(epoch)` at each epoch's start, which pins
that epoch, as with a DataLoader. Trainer does not save a loader's state, and its own
mid-epoch resume skips batches with accelerate's `skip_first_batches`, which needs a
DataLoader; so `ignore_data_skip=True`, `LoaderCheckpoints` writes `loader.state_dict()`
into each `checkpoint-N/` folder (one file per rank) and, on resume, loads it back at
`on_train_begin`: after Trainer measured the epoch's length, before it calls `set_epoch`.
The resumed epoch then continues at the batch after the checkpoint's (nothing lost or
repeated), and the next epochs are whole. With `--log-dir` each rank appends what it
trained on (epoch, step, indices) to rank{r}.jsonl.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from croupier.client import Loader


class Regression(torch.nn.Module):
    """Trainer calls model(**batch) and wants a dict holding the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)

    def forward(self, index: torch.Tensor, value: torch.Tensor, **_: Any) -> dict[str, torch.Tensor]:
        pred = self.linear(index.float().unsqueeze(1) / 1000).squeeze(1)
        return {"loss": torch.nn.functional.mse_loss(pred, value.float() / 1000)}


class LoaderTrainer(Trainer):
    """A Trainer whose training batches come from a croupier Loader."""

    def __init__(self, *args: Any, loader: Loader, trained_log: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.loader, self.trained_log = loader, trained_log  # not `log`: Trainer.log is a method

    def get_train_dataloader(self) -> Loader:  # type: ignore[override]
        return self.loader

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None):
        if self.trained_log is not None:
            self.trained_log.write(json.dumps({"epoch": self.loader.epoch, "step": self.state.global_step + 1,
                                               "indices": inputs["index"].tolist()}) + "\n")
            self.trained_log.flush()
        return super().training_step(model, inputs, num_items_in_batch)


class LoaderCheckpoints(TrainerCallback):
    """Saves the Loader's place with every checkpoint; restores it when training resumes."""

    def __init__(self, loader: Loader, rank: int, resume: Path | None):
        self.loader, self.rank, self.resume = loader, rank, resume

    def on_save(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"loader-rank{self.rank}.json").write_text(json.dumps(self.loader.state_dict()))

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if self.resume is not None:
            self.loader.load_state_dict(json.loads((self.resume / f"loader-rank{self.rank}.json").read_text()))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", nargs="+", default=["127.0.0.1:50051"])
    ap.add_argument("--dataset", default="rows")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--output-dir", type=Path, default=Path("runs/hf-trainer"))
    ap.add_argument("--save-steps", type=int, default=50)
    ap.add_argument("--resume", type=Path, default=None, help="a checkpoint-N folder to resume from")
    ap.add_argument("--log-dir", type=Path, default=None, help="append each rank's trained indices here")
    args = ap.parse_args(argv)

    targs = TrainingArguments(output_dir=str(args.output_dir), max_steps=args.max_steps, save_steps=args.save_steps,
                              per_device_train_batch_size=args.batch_size, learning_rate=0.1, report_to="none",
                              use_cpu=not torch.cuda.is_available(), ignore_data_skip=True, logging_strategy="no",
                              seed=args.seed, ddp_find_unused_parameters=False, disable_tqdm=True)
    loader = Loader(args.dataset, servers=args.servers, batch_size=args.batch_size, seed=args.seed,
                    rank=targs.process_index, world_size=targs.world_size, columns=["index", "value"])
    log = None
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(args.log_dir / f"rank{targs.process_index}.jsonl", "a")
    trainer = LoaderTrainer(model=Regression(), args=targs, loader=loader, trained_log=log,
                            callbacks=[LoaderCheckpoints(loader, targs.process_index, args.resume)])
    trainer.train(resume_from_checkpoint=str(args.resume) if args.resume is not None else None)
    if targs.process_index == 0:
        print(f"hf_trainer_train: finished at step {trainer.state.global_step}, epoch {loader.epoch}")


if __name__ == "__main__":
    main()
