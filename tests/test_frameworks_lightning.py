"""PyTorch Lightning with a croupier Loader: DDP over 2 gloo ranks, reshuffled epochs, exact resume.

examples/lightning_train.py is run as users run it (Lightning's DDP launches the second
rank itself), against a croupier server on loopback. Lightning must pass the Loader
through (no DistributedSampler: each rank's Loader already streams its own part), every
epoch must cover the dataset once with a new order, and a fit resumed with
`ckpt_path=` from a `ModelCheckpoint(every_n_train_steps=...)` checkpoint must train on
exactly what the uninterrupted run trained after that checkpoint, mid-epoch and at an
epoch's end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from framework_runs import BATCH, EXAMPLES, ROWS, SEED, WORLD, assert_reshuffled_exactly_once, \
    assert_resumed_exactly, run, trained

pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (pip install -e '.[frameworks]')")

pytestmark = pytest.mark.slow
EPOCHS = 2


def _fit(server: str, ckpt: Path, log: Path, *extra: str) -> None:
    run([sys.executable, str(EXAMPLES / "lightning_train.py"), "--servers", server, "--dataset", "rows",
         "--devices", str(WORLD), "--batch-size", str(BATCH), "--seed", str(SEED), "--max-epochs", str(EPOCHS),
         "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--log-dir", str(log), *extra])


def test_lightning_ddp_reshuffles_epochs_and_resumes_mid_epoch_exactly(serve_inprocess, tmp_path: Path) -> None:
    server = serve_inprocess(datasets=[f"rows=synthetic:{ROWS}"]).address
    _fit(server, tmp_path / "ckpt", tmp_path / "full")
    reference = trained(tmp_path / "full")
    assert_reshuffled_exactly_once(reference, EPOCHS)
    assert len(reference[0]) == len(reference[1]) == 2 * 8

    # Step 6 is mid-epoch 0: the checkpoint holds the Loader's state at batch 6 of 8.
    _fit(server, tmp_path / "ckpt-a", tmp_path / "resumed-6", "--resume", str(tmp_path / "ckpt" / "epoch=0-step=6.ckpt"))
    assert_resumed_exactly(reference, trained(tmp_path / "resumed-6"), steps_done=6)

    # Step 8 ends epoch 0: the resumed fit starts epoch 1 with epoch 1's order, not epoch 0 again.
    _fit(server, tmp_path / "ckpt-b", tmp_path / "resumed-8", "--resume", str(tmp_path / "ckpt" / "epoch=0-step=8.ckpt"))
    assert_resumed_exactly(reference, trained(tmp_path / "resumed-8"), steps_done=8)
