"""Helpers for the DCP and torchrun tests: a small token dataset, and launches of examples/train_rtp_dcp.py."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

from framework_runs import torchrun

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train_rtp_dcp.py"
#: A tiny model: 1 layer, width 48 (6 heads: it shards over 2 and 3 ranks), 16 tokens per sample.
MODEL_ARGS = ["--layers", "1", "--width", "48", "--heads", "6", "--context", "16"]


def make_tokens(folder: Path, rows: int, seed: int = 0) -> Path:
    """`rows` samples of 17 random byte tokens, written with Hugging Face save_to_disk."""
    import datasets

    rng = random.Random(seed)
    data = [[rng.randrange(256) for _ in range(17)] for _ in range(rows)]
    datasets.Dataset.from_dict({"input_ids": data}).save_to_disk(str(folder))
    return folder


def run_example(world: int, server: str, ckpt: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """One `torchrun --standalone --nnodes=1 --nproc-per-node=world --max-restarts 0` launch of the example."""
    cmd = torchrun(EXAMPLE.name, "--servers", server, "--checkpoint-dir", str(ckpt), *MODEL_ARGS, *args, world=world)
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=timeout)


def steps_logged(ckpt: Path, world: int) -> list[dict]:
    """Every step each rank logged, in log order (a run appends to rank{r}.jsonl)."""
    out = []
    for rank in range(world):
        path = ckpt / f"rank{rank}.jsonl"
        if path.exists():
            out += [{**json.loads(line), "rank": rank} for line in path.read_text().splitlines()]
    return out


def latest_step(ckpt: Path) -> int:
    return int((ckpt / "latest").read_text().split("-")[1])
