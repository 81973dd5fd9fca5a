"""Live progress and the final summary of the demo, aggregated over ranks on rank 0.

Every rank contributes one row of counters per step through a single all-reduce (the
ranks step in lockstep anyway: RTP rotates weights between them every forward pass);
rank 0 shows a tqdm bar on a terminal, and a plain line per epoch everywhere.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist

#: One row per rank; cumulative over the run except the epoch_* fields.
FIELDS = ("samples", "train_s", "wait_s", "out_of_order", "epoch_loss_sum", "epoch_steps", "epoch_correct",
          "epoch_seen")


def gather_rows(row: dict[str, float], rank: int, world_size: int,
                device: torch.device | None = None) -> list[dict[str, float]]:
    """Every rank's `row`, on every rank (one all-reduce of a [world, fields] tensor on `device`)."""
    table = torch.zeros(world_size, len(FIELDS), dtype=torch.float64, device=device)
    table[rank] = torch.tensor([float(row[f]) for f in FIELDS], dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(table)
    return [dict(zip(FIELDS, r)) for r in table.tolist()]


def _rates(rows: list[dict[str, float]]) -> list[float]:
    return [r["samples"] / r["train_s"] if r["train_s"] > 0 else 0.0 for r in rows]


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds + 0.5), 60)
    return f"{m}:{s:02d}"


class Progress:
    """What rank 0 shows while training; other ranks construct it with `show=False`."""

    def __init__(self, epochs: int, steps_per_epoch: int, show: bool, out: TextIO = sys.stderr):
        self.epochs = epochs
        self.total = epochs * steps_per_epoch
        self.show = show
        self.out = out
        self.t0 = time.perf_counter()
        self.done = 0
        self.bar = None
        self.last: list[dict[str, float]] | None = None  # rows at the end of the previous epoch
        if show and out.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, file=out, unit="step", dynamic_ncols=True, leave=False)

    def step(self, epoch: int, rows: list[dict[str, float]]) -> None:
        self.done += 1
        if self.bar is None:
            return
        loss = sum(r["epoch_loss_sum"] for r in rows) / max(1.0, sum(r["epoch_steps"] for r in rows))
        rates = " ".join(f"r{i} {x:,.0f}/s" for i, x in enumerate(_rates(rows)))
        self.bar.set_description(f"epoch {epoch + 1}/{self.epochs}", refresh=False)
        self.bar.set_postfix_str(f"loss {loss:.3f} | {rates}", refresh=False)
        self.bar.update(1)

    def epoch_line(self, epoch: int, rows: list[dict[str, float]]) -> str:
        loss = sum(r["epoch_loss_sum"] for r in rows) / max(1.0, sum(r["epoch_steps"] for r in rows))
        acc = sum(r["epoch_correct"] for r in rows) / max(1.0, sum(r["epoch_seen"] for r in rows))
        # This epoch's figures: the counters are cumulative, so subtract the previous epoch's.
        last = self.last or [dict.fromkeys(FIELDS, 0.0) for _ in rows]
        delta = [{k: r[k] - p[k] for k in ("samples", "train_s", "wait_s")} for r, p in zip(rows, last)]
        rates = _rates(delta)
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(1, self.done) * (self.total - self.done)
        per_rank = ", ".join(f"rank {i} {x:,.0f}/s" for i, x in enumerate(rates))
        return (f"epoch {epoch + 1:>2}/{self.epochs}  loss {loss:.4f}  train acc {acc:6.2%}  "
                f"{sum(rates):,.0f} samples/s ({per_rank})  waited {max(d['wait_s'] for d in delta):.2f}s  "
                f"ETA {_clock(eta)}")

    def end_epoch(self, epoch: int, rows: list[dict[str, float]]) -> None:
        if not self.show:
            return
        line = self.epoch_line(epoch, rows)
        self.last = rows
        if self.bar is not None:
            self.bar.write(line, file=self.out)
        else:
            print(line, file=self.out, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class Summary:
    """The demo's result: what rank 0 prints and writes as JSON."""

    accuracy: float | None  # held-out; None when no test set was given
    test_correct: int
    test_samples: int
    epochs: int
    train_samples: int
    train_s: float
    samples_per_s: float
    samples_per_s_by_rank: list[float]
    out_of_order: int
    wait_s_by_rank: list[float]
    first_batch_s: float | None
    final_train_loss: float
    dataset: str
    servers: list[str]
    ordered: bool
    world_size: int
    backend: str = ""  # torch.distributed's, as the ranks used it
    extra: dict[str, str] = field(default_factory=dict)

    def text(self) -> str:
        waits = ", ".join(f"{w:.2f}s" for w in self.wait_s_by_rank)
        per_rank = ", ".join(f"rank {i} {x:,.0f}/s" for i, x in enumerate(self.samples_per_s_by_rank))
        if self.accuracy is None:
            acc = "held-out accuracy: n/a (no test set given: --test-data)"
        else:
            acc = (f"held-out accuracy: {self.accuracy:.4f} ({self.test_correct}/{self.test_samples} test "
                   "samples the training never saw)")
        lines = [
            "croupier demo: summary",
            f"  {acc}",
            f"  training: {self.epochs} epoch{'s' if self.epochs != 1 else ''}, {self.train_samples:,} samples in {self.train_s:.1f}s, "
            f"{self.samples_per_s:,.0f} samples/s ({per_rank}); final loss {self.final_train_loss:.4f}",
            f"  out of order: {self.out_of_order:,} of {self.train_samples:,} samples arrived before an "
            f"earlier sample of their batch",
            f"  waiting for data: {waits} (per rank; "
            f"{max(self.wait_s_by_rank) / max(self.train_s, 1e-9):.1%} of training time at most)"
            + (f"; first batch after {self.first_batch_s:.2f}s" if self.first_batch_s is not None else ""),
            f"  data: {self.dataset} from {', '.join(self.servers)}, "
            f"{'ordered (one read at a time)' if self.ordered else 'unordered'} fetching; "
            f"{self.world_size} ranks, each holding 1/{self.world_size} of the model (RTP)",
        ]
        return "\n".join(lines)

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")
