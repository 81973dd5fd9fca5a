"""dataloader-rs: PyDataloader with items_in_parallel, over the benchmark's own files (in its own venv).

    python run_dataloader_rs.py read '<Job as JSON>'

PyTorch's DataLoader model with a Rust core, set up as its Python README has it: a `PyDataset`
subclass (`__len__`, `__getitem__`, `super().__init__()`), `PyDataloader(dataset, batch_size,
sampler, num_workers, collate_fn, prefetch_depth, items_in_parallel)`. Its workers are threads of
one process: `num_workers` batches in parallel (the suite's workers per rank), each batch's items
fetched ITEMS_IN_PARALLEL at a time (`items_in_parallel`, the fetching of a batch's items in
parallel inside one process that issue 21 names); batches come out in epoch order. The files are
the ones the DataLoader baseline and torchdata read (own_files.Rows: a JPEG per image, a row of the
memory-mapped Arrow files per text sample); the order is DistributedSampler's (any iterable of ints
is a sampler): each epoch a permutation seeded by seed + epoch, padded to a multiple of the world,
every world-th index to a rank. No checkpoint of its own: no resume case.

Every dataloader-rs release on the package index requires Python >= 3.13 (venvs.PEERS): its venv is
made with a Python 3.13 found on the machine (venvs.newer_python), without torch, whose only
Python 3.13 wheels on the index are CUDA builds of several GB; samples are NumPy arrays, collated
into a dict of lists (ids, labels) and stacked arrays. Where no such Python is found the suite
records that, runner unrun.
"""

from __future__ import annotations

import sys

from _common import Job, command_line, emit, guarded, now, run_epochs
from own_files import Rows

#: Items of one batch fetched at once per batch in flight (torchdata's runner reads with 16 threads too).
ITEMS_IN_PARALLEL = 16


def read(job: Job) -> None:
    if job.endpoint and job.dataset == "text":
        raise SystemExit("dataloader-rs: text on S3 is not set up (see own_files' doc)")
    import numpy as np
    from dataloader_rs import PyDataloader, PyDataset

    class Items(PyDataset):
        def __init__(self, rows: Rows) -> None:
            super().__init__()  # its README: required when a dataset defines __init__
            self.rows = rows

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, index: int) -> dict:
            return self.rows.get(index)

    emit("start", t=now())
    rows = Rows(job, connections=max(1, job.workers) * ITEMS_IN_PARALLEL, numpy=True)
    sampler = Sampler(len(rows), job.world, job.rank, job.seed)
    loader = PyDataloader(Items(rows), batch_size=job.batch, sampler=sampler, num_workers=job.workers,
                          collate_fn=collate, items_in_parallel=ITEMS_IN_PARALLEL)

    def epoch(e: int):
        sampler.epoch = e
        for batch in loader:
            yield list(batch["id"])

    run_epochs(job, epoch)


class Sampler:
    """DistributedSampler's order without torch: a permutation of the indices seeded by seed +
    epoch, padded with its head to a multiple of the world, every world-th one to `rank`."""

    def __init__(self, n: int, world: int, rank: int, seed: int):
        self.n, self.world, self.rank, self.seed = n, world, rank, seed
        self.epoch = 0

    def __len__(self) -> int:
        return -(-self.n // self.world)

    def __iter__(self):
        import numpy as np

        order = np.random.default_rng(self.seed + self.epoch).permutation(self.n)
        total = len(self) * self.world
        order = np.concatenate([order, order[:total - self.n]])
        return iter(order[self.rank::self.world].tolist())


def collate(samples: list[dict]) -> dict:
    """A batch as a dict: arrays stacked (images, tokens of one length), the rest as lists."""
    import numpy as np

    out = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        stackable = isinstance(values[0], np.ndarray) and all(v.shape == values[0].shape for v in values)
        out[key] = np.stack(values) if stackable else values
    return out


if __name__ == "__main__":
    sys.exit(guarded(lambda: command_line("dataloader-rs", read)))
