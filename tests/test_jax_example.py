"""examples/train_jax.py: a JAX MLP learns the digits from croupier's NumPy batches, torch unimportable.

A real `croupier serve` process on loopback serves the demo's digits (ImageFolder PNGs);
the example runs in a subprocess in which `import torch` fails, as on an install with
only the `jax` extra. Each epoch must be exactly the plan's batches (every training image
once, a new permutation each epoch), and the model must learn (held-out accuracy far
above the 10% of chance; JAX on CPU is deterministic, so this is not a timing).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax", reason="jax is not installed (pip install -e \".[jax]\")")
pytest.importorskip("sklearn", reason="the digits come from scikit-learn (pip install -e \".[demo]\")")

from croupier.demo.data import prepare  # noqa: E402
from croupier.protocol.epoch_plan import EpochPlan  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_jax.py"
EPOCHS, BATCH, SEED = 3, 32, 5

#: The example, run with torch (and everything under it) unimportable.
_WITHOUT_TORCH = (
    "import runpy, sys\n"
    "sys.modules['torch'] = None\n"
    f"sys.argv = [{str(EXAMPLE)!r}, *sys.argv[1:]]\n"
    f"runpy.run_path({str(EXAMPLE)!r}, run_name='__main__')\n"
)


@pytest.mark.slow
def test_jax_example_trains_on_each_epochs_plan_without_torch(serve_process, tmp_path: Path) -> None:
    digits = prepare(tmp_path / "digits")
    num_rows = sum(1 for _ in digits.path("train").rglob("*.png"))
    server = serve_process(digits.dataset_specs())
    cmd = [sys.executable, "-c", _WITHOUT_TORCH, "--servers", server.address, "--dataset", "digits",
           "--test-dataset", "digits-test", "--epochs", str(EPOCHS), "--batch-size", str(BATCH),
           "--seed", str(SEED), "--log-dir", str(tmp_path / "log")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr

    steps = [json.loads(line) for line in (tmp_path / "log" / "rank0.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    orders = []
    for epoch in range(EPOCHS):
        plan = EpochPlan(num_rows, SEED, epoch, BATCH, 1)
        got = [s for s in steps if s["epoch"] == epoch]
        assert [s["batch"] for s in got] == list(range(plan.num_batches))
        assert [s["indices"] for s in got] == [plan.rank_batch(0, b).indices.tolist() for b in range(plan.num_batches)]
        order = [i for s in got for i in s["indices"]]
        assert sorted(order) == list(range(num_rows))  # every training image once
        orders.append(order)
    assert len({tuple(o) for o in orders}) == EPOCHS  # a new permutation each epoch

    mean_loss = [sum(s["loss"] for s in steps if s["epoch"] == e) / len([s for s in steps if s["epoch"] == e])
                 for e in range(EPOCHS)]
    assert mean_loss[-1] < mean_loss[0] / 2
    accuracy = float(next(line for line in out.stdout.splitlines() if line.startswith("test accuracy")).split()[-1])
    assert accuracy > 0.8
    assert f"train_jax: finished at step {len(steps)} on cpu" in out.stdout
