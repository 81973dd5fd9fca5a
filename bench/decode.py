"""The CPU side of the ceiling: how fast one core turns stored samples into batch tensors.

Measured in this process on page-cache data, with the work a trainer cannot avoid:
for table rows, a random take of a batch from the memory-mapped files and its
column-wise collation; for images, reading each file and decoding it to a uint8 tensor
with croupier's client decoder (`decode_image`: simplejpeg for JPEGs, else Pillow), the
fastest decoder any system in the suite uses. The machine's decode ceiling is this rate
times its cores.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def text_rate(path: Path, batch: int = 64, seconds: float = 1.5, max_batches: int = 2000) -> float:
    import pyarrow as pa

    from croupier.client.samples import collate_table
    from croupier.server.readers import open_dataset

    table = open_dataset(str(path)).mapped_table().combine_chunks()  # one chunk: take stays O(batch)
    rng = np.random.default_rng(0)
    n, t0 = 0, time.perf_counter()
    for _ in range(max_batches):
        rows = table.take(pa.array(rng.integers(0, table.num_rows, batch)))
        collate_table(rows)
        n += batch
        if time.perf_counter() - t0 > seconds:
            break
    return n / (time.perf_counter() - t0)


def image_rate(root: Path, seconds: float = 1.5, max_images: int = 20_000) -> float:
    from croupier.client.samples import decode_image
    from croupier.v1 import croupier_pb2 as pb

    from .baselines import list_imagefolder

    files, _ = list_imagefolder(root)
    rng = np.random.default_rng(0)
    n, t0 = 0, time.perf_counter()
    for i in rng.integers(0, len(files), max_images).tolist():
        with open(files[i], "rb") as f:
            decode_image(pb.Image(data=f.read()), "tensor", i)
        n += 1
        if time.perf_counter() - t0 > seconds:
            break
    return n / (time.perf_counter() - t0)


def decode_rates(paths: dict[str, Path], seconds: float = 1.5) -> dict[str, float]:
    """Samples/s on one core, per dataset (the tar shards hold the same JPEGs as the folder)."""
    images = image_rate(paths["imagefolder"], seconds)
    return {"text": text_rate(paths["text"], seconds=seconds), "imagefolder": images, "shards": images}


class DecodeCeiling:
    """One core's decode rates, measured when a suite starts and again when it ends: on a
    shared machine the better of the two is the ceiling (other jobs may have slowed one)."""

    def __init__(self, paths: dict[str, Path], seconds: float, say: Callable[[str], None]):
        self.paths, self.seconds = paths, seconds
        self.start = decode_rates(paths, seconds)
        say("decode rate, one core: " + ", ".join(f"{k} {v:,.0f} samples/s" for k, v in self.start.items()))

    def end(self, rep: dict[str, Any], say: Callable[[str], None]) -> dict[str, float]:
        """Measures again; records both ("decode_rates_measured") and the better per dataset
        ("decode_rates") in `rep`, and returns the better."""
        again = decode_rates(self.paths, self.seconds)
        rep["decode_rates_measured"] = {"start": self.start, "end": again}
        rep["decode_rates"] = best = {k: max(v, again[k]) for k, v in self.start.items()}
        say("decode rate at the end: " + ", ".join(f"{k} {v:,.0f} samples/s" for k, v in again.items()))
        return best
