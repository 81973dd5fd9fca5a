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

from framework_runs import ROWS, assert_trains_and_resumes_exactly

pytest.importorskip("transformers", reason="Hugging Face transformers is not installed (pip install -e '.[frameworks]')")

pytestmark = pytest.mark.slow
STEPS = 16  # two epochs of 8 steps


def test_trainer_reshuffles_epochs_and_resumes_exactly_from_a_checkpoint(serve_inprocess, tmp_path: Path) -> None:
    server = serve_inprocess(datasets=[f"rows=synthetic:{ROWS}"]).address
    assert_trains_and_resumes_exactly("hf_trainer_train.py", server, tmp_path, STEPS, "--output-dir",
                                      lambda out, step: out / f"checkpoint-{step}", "--save-steps", "2")
