"""Hugging Face accelerate with a croupier Loader: prepare() passes it through, save_state/load_state resume exactly.

examples/accelerate_train.py under `torchrun` (2 gloo ranks) against a croupier server on
loopback. `accelerator.prepare` must hand the Loader back untouched (the example fails
otherwise): each rank then trains on its own part of every epoch, the dataset once an
epoch, a new order each epoch. A run resumed with `load_state` from a `save_state`
folder (the Loader registered with `register_for_checkpointing`) must train on exactly
what the uninterrupted run trained after that step, mid-epoch and at an epoch's end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from framework_runs import BATCH, ROWS, SEED, assert_reshuffled_exactly_once, assert_resumed_exactly, run, \
    torchrun, trained

pytest.importorskip("accelerate", reason="Hugging Face accelerate is not installed (pip install -e '.[frameworks]')")

pytestmark = pytest.mark.slow
STEPS = 16  # two epochs of 8 steps


def _train(server: str, ckpt: Path, log: Path, *extra: str) -> None:
    run(torchrun("accelerate_train.py", "--servers", server, "--dataset", "rows", "--batch-size", str(BATCH),
                 "--seed", str(SEED), "--max-steps", str(STEPS), "--checkpoint-dir", str(ckpt),
                 "--checkpoint-every", "2", "--log-dir", str(log), *extra))


def test_accelerate_prepare_passes_loader_through_and_load_state_resumes_exactly(serve_inprocess,
                                                                                  tmp_path: Path) -> None:
    server = serve_inprocess(datasets=[f"rows=synthetic:{ROWS}"]).address
    _train(server, tmp_path / "ckpt", tmp_path / "full")
    reference = trained(tmp_path / "full")
    assert_reshuffled_exactly_once(reference, 2)
    assert len(reference[0]) == len(reference[1]) == STEPS

    # Step 6 is mid-epoch 0, step 8 its end (the resumed run then starts epoch 1).
    for step in (6, 8):
        _train(server, tmp_path / f"ckpt-{step}", tmp_path / f"resumed-{step}",
               "--resume", str(tmp_path / "ckpt" / f"step-{step:06d}"))
        assert_resumed_exactly(reference, trained(tmp_path / f"resumed-{step}"), steps_done=step)
