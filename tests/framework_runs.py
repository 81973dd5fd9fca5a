"""Helpers for the Lightning and accelerate tests: launch an example, read what each rank trained on.

The examples append one JSON line per training step to `rank{r}.jsonl` (epoch and the
batch's global indices, from the synthetic dataset's `index` column); a resumed run
appends to a fresh folder, so its log is exactly what it trained on after the checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
#: The job every test runs: 60 rows, 2 ranks of 4 rows a batch: 8 steps an epoch, the
#: last one short (60 = 7 x 8 + 4), so a checkpoint at step 6 is mid-epoch and one at
#: step 8 ends epoch 0.
ROWS, WORLD, BATCH, SEED = 60, 2, 4, 5


def run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """Run a job to its end; fail with its output if it fails."""
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def torchrun(script: str, *args: str, world: int = WORLD) -> list[str]:
    """The command line of a `torchrun --standalone` launch of an example on `world` ranks
    (no restarts: a lost rank ends the job, as the elastic test needs)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc-per-node={world}", "--max-restarts", "0", str(EXAMPLES / script), *args]


def trained(log_dir: Path) -> list[list[tuple[int, list[int]]]]:
    """Per rank, in order: (epoch, indices) of every step it trained."""
    out = []
    for rank in range(WORLD):
        lines = (log_dir / f"rank{rank}.jsonl").read_text().splitlines()
        out.append([(rec["epoch"], rec["indices"]) for rec in map(json.loads, lines)])
    return out


def epoch_indices(logs: list[list[tuple[int, list[int]]]], epoch: int) -> list[list[int]]:
    """Per rank, the indices it trained on in `epoch`, in order."""
    return [[i for e, idx in rank_log if e == epoch for i in idx] for rank_log in logs]


def assert_reshuffled_exactly_once(logs: list[list[tuple[int, list[int]]]], epochs: int) -> None:
    """Every epoch covers the dataset exactly once over the ranks, and no two epochs share an order."""
    orders = []
    for epoch in range(epochs):
        per_rank = epoch_indices(logs, epoch)
        everything = [i for idx in per_rank for i in idx]
        assert sorted(everything) == list(range(ROWS)), f"epoch {epoch} did not cover the {ROWS} rows once"
        orders.append(per_rank)
    for a in range(epochs):
        for b in range(a + 1, epochs):
            for rank in range(WORLD):
                assert orders[a][rank] != orders[b][rank], f"rank {rank}: epochs {a} and {b} have the same order"


def assert_resumed_exactly(reference: list[list[tuple[int, list[int]]]],
                           resumed: list[list[tuple[int, list[int]]]], steps_done: int) -> None:
    """The resumed run trained, on every rank, exactly what the uninterrupted run trained after
    its first `steps_done` steps: nothing lost, nothing repeated, same epochs, same order."""
    for rank in range(WORLD):
        assert resumed[rank] == reference[rank][steps_done:], (
            f"rank {rank}: after a resume at step {steps_done} the run trained "
            f"{resumed[rank][:2]}..., the uninterrupted run {reference[rank][steps_done:steps_done + 2]}...")


def assert_trains_and_resumes_exactly(example: str, server: str, tmp_path: Path, steps: int, out_flag: str,
                                      checkpoint: Callable[[Path, int], Path], *flags: str) -> None:
    """An example trained `steps` steps (2 epochs of 8) reshuffles its epochs, each once; started
    again from its checkpoint at step 6 (mid-epoch 0) and at step 8 (its end: the resumed run
    starts epoch 1) it trains on exactly what the uninterrupted run trained after that step.
    `checkpoint(out, step)` is the folder the example's checkpoint of `step` is in."""

    def train(out: Path, log: Path, *extra: str) -> None:
        run(torchrun(example, "--servers", server, "--dataset", "rows", "--batch-size", str(BATCH), "--seed", str(SEED),
                     "--max-steps", str(steps), out_flag, str(out), "--log-dir", str(log), *flags, *extra))

    train(tmp_path / "out", tmp_path / "full")
    reference = trained(tmp_path / "full")
    assert_reshuffled_exactly_once(reference, 2)
    assert len(reference[0]) == len(reference[1]) == steps
    for step in (6, 8):
        train(tmp_path / f"out-{step}", tmp_path / f"resumed-{step}", "--resume", str(checkpoint(tmp_path / "out", step)))
        assert_resumed_exactly(reference, trained(tmp_path / f"resumed-{step}"), steps_done=step)
