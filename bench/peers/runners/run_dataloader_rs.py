"""dataloader-rs: PyDataloader with items_in_parallel, over the benchmark's own files (in its own venv).

    python run_dataloader_rs.py read '<Job as JSON>'

PyTorch's DataLoader model with a Rust core, set up as its Python README has it: a `PyDataset`
subclass (`__len__`, `__getitem__`, `super().__init__()`), `PyDataloader(dataset, batch_size,
sampler, num_workers, collate_fn, prefetch_depth, items_in_parallel)`. Its workers are threads of
one process: `num_workers` batches in parallel (the suite's workers per rank), each batch's items
fetched ITEMS_IN_PARALLEL at a time (`items_in_parallel`, the fetching of a batch's items in
parallel inside one process that issue 21 names); batches come out in epoch order. The files are
the ones the DataLoader baseline and torchdata read (own_files.Rows: a JPEG per image, a row of the
memory-mapped Arrow files per text sample); the order is torch's DistributedSampler (any iterable
of ints is a sampler; set_epoch before each epoch). No checkpoint of its own: no resume case.

Every dataloader-rs release on the package index requires Python >= 3.13 (venvs.PEERS), so on a
machine with an older Python its venv is not made and the suite records that, runner unrun.
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
    from dataloader_rs import PyDataloader, PyDataset
    from torch.utils.data import DistributedSampler, default_collate

    class Items(PyDataset):
        def __init__(self, rows: Rows) -> None:
            super().__init__()  # its README: required when a dataset defines __init__
            self.rows = rows

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, index: int) -> dict:
            return self.rows.get(index)

    emit("start", t=now())
    rows = Rows(job, connections=max(1, job.workers) * ITEMS_IN_PARALLEL)
    sampler = DistributedSampler(range(len(rows)), num_replicas=job.world, rank=job.rank, shuffle=True, seed=job.seed)
    loader = PyDataloader(Items(rows), batch_size=job.batch, sampler=sampler, num_workers=job.workers,
                          collate_fn=default_collate, items_in_parallel=ITEMS_IN_PARALLEL)

    def epoch(e: int):
        sampler.set_epoch(e)
        for batch in loader:
            yield batch["id"].tolist()

    run_epochs(job, epoch)


if __name__ == "__main__":
    sys.exit(guarded(lambda: command_line("dataloader-rs", read)))
