"""torchrun elastic: a 3-rank job loses a rank mid-epoch, restarts at 2 ranks, and the epoch completes exactly once.

Real processes: `torchrun --standalone --nnodes=1 --max-restarts 0` running
examples/train_rtp_dcp.py (gloo, RTP-sharded model, croupier Loader) against a
`croupier serve` subprocess on loopback. Rank 1 exits after step 5 (`--fail-rank`), after
the checkpoint of step 4 and before the next; torchrun stops the job. The same command at
`--nproc-per-node=2` resumes from that checkpoint: `dcp.load` gives each new rank every old
rank's Loader state, and the rest of the epoch is dealt anew over 2 ranks.
"""

from __future__ import annotations

from pathlib import Path

from dcp_jobs import latest_step, make_tokens, run_example, steps_logged

ROWS, BATCH = 60, 2


def test_rank_lost_at_3_ranks_restart_at_2_completes_the_epoch_exactly_once(serve_process, tmp_path: Path) -> None:
    server = serve_process([f"text={make_tokens(tmp_path / 'text', ROWS)}"])
    ckpt = tmp_path / "ckpt"
    common = ["--batch-size", str(BATCH), "--epochs", "1", "--checkpoint-every", "2", "--seed", "7"]

    lost = run_example(3, server.address, ckpt, *common, "--fail-rank", "1", "--fail-after-step", "5")
    assert lost.returncode != 0, lost.stdout + lost.stderr
    assert latest_step(ckpt) == 4  # the step-5 work of every rank is lost with the job
    run1 = steps_logged(ckpt, 3)
    assert {(s["rank"], s["step"]) for s in run1 if s["step"] == 5} >= {(1, 5)}, "rank 1 stopped before step 5"

    done = run_example(2, server.address, ckpt, *common)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 ranks, resuming at step 4" in done.stdout
    # 24 rows delivered by 3 ranks x 4 steps; the other 36 in global batches of 2 x 2: 9 steps.
    assert "finished at step 13, epoch 0" in done.stdout
    run2 = [s for s in steps_logged(ckpt, 2) if s["world"] == 2]
    assert sorted({s["step"] for s in run2}) == list(range(5, 14))

    kept = [s for s in run1 if s["step"] <= 4] + run2  # what the checkpointed model trained on
    assert all(s["epoch"] == 0 for s in kept)
    seen = [i for s in kept for i in s["indices"]]
    assert len(seen) == ROWS, f"{len(seen) - len(set(seen))} samples repeated"
    assert sorted(seen) == list(range(ROWS))
