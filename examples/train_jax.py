"""JAX with croupier: an MLP classifier trained on NumPy batches, without torch.

    croupier demo --prepare-only      # writes scikit-learn's digits, prints the serve command
    croupier serve digits=DIR/imagefolder/train digits-test=DIR/imagefolder/test --port 50051 &
    python examples/train_jax.py --servers 127.0.0.1:50051 --dataset digits --test-dataset digits-test

`Loader(..., format="numpy")` yields dicts of NumPy arrays (images uint8 [B, H, W, C],
labels int64) and never imports torch, so this runs on `pip install -e ".[jax]"`
(CPU jax from PyPI) with no `client` extra. Each batch goes to the accelerator with
`jax.device_put`; the step is a jitted `jax.value_and_grad` with plain SGD. The Loader
takes its rank and world size from JAX's processes (`jax.process_index()`,
`jax.process_count()`), so every host of a multi-host job streams its own part of each
epoch's global shuffle; a new pass over the Loader starts the next epoch by itself.
With `--log-dir`, each step's epoch, batch, global indices and loss go to
rank{r}.jsonl (tests/test_jax_example.py checks them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from croupier.client import Loader

Params = list[dict[str, jax.Array]]


def init_mlp(key: jax.Array, sizes: list[int]) -> Params:
    """He-initialised dense layers, `sizes[0]` inputs to `sizes[-1]` logits."""
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        params.append({"w": jax.random.normal(sub, (fan_in, fan_out)) * jnp.sqrt(2.0 / fan_in),
                       "b": jnp.zeros(fan_out)})
    return params


def logits(params: Params, images: jax.Array) -> jax.Array:
    # uint8 [B, H, W, C] -> float [B, H*W*C] in [0, 1], converted on the device.
    x = images.reshape(images.shape[0], -1).astype(jnp.float32) / 255.0
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params: Params, images: jax.Array, labels: jax.Array) -> jax.Array:
    log_probs = jax.nn.log_softmax(logits(params, images))
    return -jnp.take_along_axis(log_probs, labels[:, None], axis=1).mean()


@jax.jit
def train_step(params: Params, images: jax.Array, labels: jax.Array, lr: float) -> tuple[Params, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss


@jax.jit
def correct(params: Params, images: jax.Array, labels: jax.Array) -> jax.Array:
    return (logits(params, images).argmax(axis=1) == labels).sum()


def evaluate(params: Params, loader: Loader) -> float:
    """Accuracy over one epoch of `loader` (this process's part of it)."""
    right = total = 0
    for batch in loader:
        images, labels = jax.device_put((batch["image"], batch["label"]))
        right += int(correct(params, images, labels))
        total += len(batch["label"])
    return right / total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", nargs="+", default=["127.0.0.1:50051"])
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--test-dataset", default=None, help="a held-out dataset to report accuracy on")
    ap.add_argument("--num-classes", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", type=Path, default=None, help="append each step's indices and loss here")
    args = ap.parse_args(argv)

    rank, world = jax.process_index(), jax.process_count()
    loader = Loader(args.dataset, servers=args.servers, batch_size=args.batch_size, seed=args.seed,
                    rank=rank, world_size=world, format="numpy")
    log = None
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(args.log_dir / f"rank{rank}.jsonl", "a")
    params: Any = None
    step = 0
    for _ in range(args.epochs):
        losses = []
        for batch in loader.batches():  # a new pass: the next epoch, a new permutation
            images, labels = jax.device_put((batch.data["image"], batch.data["label"]))
            if params is None:  # the input size comes from the first batch
                size = int(np.prod(images.shape[1:]))
                params = init_mlp(jax.random.key(args.seed), [size, args.hidden, args.num_classes])
            params, loss = train_step(params, images, labels, args.lr)
            losses.append(float(loss))
            step += 1
            if log is not None:
                log.write(json.dumps({"step": step, "epoch": batch.epoch, "batch": batch.batch,
                                      "indices": batch.indices.tolist(), "loss": losses[-1]}) + "\n")
        print(f"epoch {loader.epoch}  steps {len(losses)}  mean loss {np.mean(losses):.4f}", flush=True)
    loader.close()
    if log is not None:
        log.close()
    if args.test_dataset is not None:
        test = Loader(args.test_dataset, servers=args.servers, batch_size=256, rank=rank, world_size=world,
                      format="numpy")
        print(f"test accuracy {evaluate(params, test):.4f}", flush=True)
        test.close()
    print(f"train_jax: finished at step {step} on {jax.devices()[0].platform}", flush=True)


if __name__ == "__main__":
    main()
