"""examples/train_gpt.py under torchrun: killed, stopped, resumed, it trains on every block once.

A real job: `python -m torch.distributed.run` with 2 gloo ranks, RTP-sharded GPT, batches
from a `croupier serve` subprocess over loopback. It is killed (SIGKILL, resumes from
the last periodic checkpoint), then stopped (SIGTERM, checkpoints where it stops), then
run to the end. Each resume must continue at the batch after its checkpoint's, with the
same loss the interrupted run had there, and epoch 0 must cover every block once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from croupier.protocol.epoch_plan import EpochPlan

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
WORLD, BATCH, SEED = 2, 4, 3


def _children(pid: int) -> list[int]:
    """Process ids whose parent is `pid` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _log(ckpt: Path, rank: int) -> list[dict]:
    path = ckpt / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _latest(ckpt: Path) -> int:
    return int((ckpt / "latest").read_text().split("-")[1])


class Job:
    """One torchrun launch of the example."""

    def __init__(self, server: str, ckpt: Path, max_steps: int):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
               str(EXAMPLES / "train_gpt.py"), "--servers", server, "--dataset", "text", "--batch-size", str(BATCH),
               "--seed", str(SEED), "--layers", "1", "--width", "32", "--heads", "2", "--context", "64",
               "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3", "--max-steps", str(max_steps),
               "--log-every", "1"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.ckpt = ckpt
        self.lines_before = [len(_log(ckpt, r)) for r in range(WORLD)]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def steps(self, rank: int = 0) -> list[dict]:
        """What this launch logged."""
        return _log(self.ckpt, rank)[self.lines_before[rank] :]

    def wait_for_step(self, step: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not any(s["step"] >= step for s in self.steps(0)):
            assert self.proc.poll() is None, self.proc.communicate()[0]
            assert time.monotonic() < deadline, f"step {step} not reached in {timeout}s"
            time.sleep(0.1)

    def kill(self) -> str:
        """SIGKILL for torchrun and its workers (which torchrun starts in sessions of their own)."""
        workers = _children(self.proc.pid)
        for pid in [*workers, self.proc.pid]:
            os.kill(pid, signal.SIGKILL)
        return self.proc.communicate(timeout=120)[0]

    def stop(self) -> str:
        """SIGTERM to torchrun, as a scheduler preempting the job does; it passes it on to the workers."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.communicate(timeout=120)[0]

    def finish(self, timeout: float = 300) -> str:
        out = self.proc.communicate(timeout=timeout)[0]
        assert self.proc.returncode == 0, out
        return out


def _assert_resumed(before: list[list[dict]], after: Job, checkpoint: int, num_rows: int) -> None:
    """The resumed launch's first step follows the checkpoint's batch, and repeats the lost step exactly."""
    for rank in range(WORLD):
        at_ckpt = next(s for s in before[rank] if s["step"] == checkpoint)
        first = after.steps(rank)[0]
        plan = EpochPlan(num_rows, SEED, at_ckpt["epoch"], BATCH, WORLD)
        epoch, batch = at_ckpt["epoch"], at_ckpt["batch"] + 1
        if batch == plan.num_batches:
            epoch, batch = epoch + 1, 0
        assert (first["step"], first["epoch"], first["batch"]) == (checkpoint + 1, epoch, batch)
        expected = EpochPlan(num_rows, SEED, epoch, BATCH, WORLD).rank_batch(rank, batch).indices.tolist()
        assert first["indices"] == expected
        lost = [s for s in before[rank] if s["step"] == checkpoint + 1]
        if lost:  # the interrupted launch got past its checkpoint: same data, same weights, same loss
            assert lost[-1]["indices"] == first["indices"]
            assert first["loss"] == pytest.approx(lost[-1]["loss"], rel=1e-4)


@pytest.fixture
def launch():
    """Factory of Jobs; whatever is still running at the end of the test is killed."""
    jobs: list[Job] = []

    def start(*args, **kwargs) -> Job:
        jobs.append(Job(*args, **kwargs))
        return jobs[-1]

    yield start
    for job in jobs:
        if job.proc.poll() is None:
            job.kill()


@pytest.mark.slow
def test_gpt_example_killed_stopped_and_resumed_trains_every_block_once(serve_process, launch, tmp_path: Path) -> None:
    data = tmp_path / "text"
    subprocess.run([sys.executable, str(EXAMPLES / "make_text_dataset.py"), str(data), "--block", "32",
                    "--max-mb", "0.004"], check=True, capture_output=True, timeout=120)
    import datasets

    num_rows = len(datasets.load_from_disk(str(data / "train")))
    steps_per_epoch = EpochPlan(num_rows, SEED, 0, BATCH, WORLD).num_batches
    server = serve_process([f"text={data / 'train'}"])
    ckpt = tmp_path / "ckpt"

    # 1. Killed without warning: the next launch resumes from the last periodic checkpoint.
    job = launch(server.address, ckpt, max_steps=1000)
    job.wait_for_step(5)
    job.kill()
    first_ckpt = _latest(ckpt)
    assert first_ckpt >= 3 and first_ckpt % 3 == 0
    before = [job.steps(r) for r in range(WORLD)]

    # 2. Stopped with SIGTERM: every rank stops after the same step and checkpoints it.
    job = launch(server.address, ckpt, max_steps=1000)
    job.wait_for_step(first_ckpt + 3)
    job.stop()
    _assert_resumed(before, job, first_ckpt, num_rows)
    stopped_at = _latest(ckpt)
    assert [job.steps(r)[-1]["step"] for r in range(WORLD)] == [stopped_at] * WORLD
    before = [job.steps(r) for r in range(WORLD)]

    # 3. Run to the end, past the end of epoch 0.
    end = max(stopped_at + 3, steps_per_epoch + 2)
    job = launch(server.address, ckpt, max_steps=end)
    out = job.finish()
    _assert_resumed(before, job, stopped_at, num_rows)
    assert f"finished at step {end}" in out

    # What the three launches trained on, each step once: epoch 0 covered every block once.
    for rank in range(WORLD):
        assert [s["step"] for s in _effective(ckpt, rank)] == list(range(1, end + 1))
    epoch0 = [i for r in range(WORLD) for s in _effective(ckpt, r) if s["epoch"] == 0 for i in s["indices"]]
    assert sorted(set(epoch0)) == list(range(num_rows))
    assert len(epoch0) == num_rows + (-num_rows) % WORLD  # plus the padding that evens out the ranks


def _effective(ckpt: Path, rank: int) -> list[dict]:
    """The steps that count: a step logged again after a resume replaces the lost one."""
    by_step: dict[int, dict] = {}
    for s in _log(ckpt, rank):
        by_step[s["step"]] = s
    return [by_step[k] for k in sorted(by_step)]
