"""Hugging Face Trainer with a croupier Loader: reshuffled epochs, and a mid-epoch resume that is exact.

examples/hf_trainer_train.py under `torchrun` (2 gloo ranks) against a croupier server on
loopback: `get_train_dataloader()` returns the Loader, Trainer's `set_epoch` calls pin each
epoch, every epoch covers the dataset once in a new order; a run resumed from a
`checkpoint-N` folder (the Loader's state saved beside it by a callback,
`ignore_data_skip=True`) trains on exactly what the uninterrupted run trained after step N,
mid-epoch and at an epoch's end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from framework_runs import BATCH, ROWS, SEED, assert_reshuffled_exactly_once, assert_resumed_exactly, run, \
    torchrun, trained

pytest.importorskip("transformers", reason="Hugging Face transformers is not installed (pip install -e '.[frameworks]')")

pytestmark = pytest.mark.slow
STEPS = 16  # two epochs of 8 steps


def _train(server: str, out: Path, log: Path, *extra: str) -> None:
    run(torchrun("hf_trainer_train.py", "--servers", server, "--dataset", "rows", "--batch-size", str(BATCH),
                 "--seed", str(SEED), "--max-steps", str(STEPS), "--output-dir", str(out), "--save-steps", "2",
                 "--log-dir", str(log), *extra))


def test_trainer_reshuffles_epochs_and_resumes_exactly_from_a_checkpoint(serve_inprocess, tmp_path: Path) -> None:
    server = serve_inprocess(datasets=[f"rows=synthetic:{ROWS}"]).address
    _train(server, tmp_path / "out", tmp_path / "full")
    reference = trained(tmp_path / "full")
    assert_reshuffled_exactly_once(reference, 2)
    assert len(reference[0]) == len(reference[1]) == STEPS

    # Step 6 is mid-epoch 0, step 8 its end (the resumed run then starts epoch 1).
    for step in (6, 8):
        _train(server, tmp_path / f"out-{step}", tmp_path / f"resumed-{step}",
               "--resume", str(tmp_path / "out" / f"checkpoint-{step}"))
        assert_resumed_exactly(reference, trained(tmp_path / f"resumed-{step}"), steps_done=step)
