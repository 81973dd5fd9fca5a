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

from framework_runs import ROWS, assert_trains_and_resumes_exactly

pytest.importorskip("accelerate", reason="Hugging Face accelerate is not installed (pip install -e '.[frameworks]')")

pytestmark = pytest.mark.slow
STEPS = 16  # two epochs of 8 steps


def test_accelerate_prepare_passes_loader_through_and_load_state_resumes_exactly(serve_inprocess,
                                                                                  tmp_path: Path) -> None:
    server = serve_inprocess(datasets=[f"rows=synthetic:{ROWS}"]).address
    assert_trains_and_resumes_exactly("accelerate_train.py", server, tmp_path, STEPS, "--checkpoint-dir",
                                      lambda out, step: out / f"step-{step:06d}", "--checkpoint-every", "2")
