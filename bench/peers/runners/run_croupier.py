"""croupier: one trainer rank's Loader, against a `croupier serve` the harness started.

    python run_croupier.py read '<Job as JSON>'     (in croupier's own environment)

The server reads the same rows from the same slow storage (the latency FS mount's save_to_disk
folder or ImageFolder tree, or their s3:// URLs); job.extra holds its address and, for images,
the id of each dataset index (croupier's ImageFolder order is class-major; ids are the rows'
storage order that every system reports). Resume: each rank's Loader.state_dict().
"""

from __future__ import annotations

import sys

from _common import Job, command_line, guarded, emit, load_state, now, run_epochs


def read(job: Job) -> None:
    import numpy as np

    import torch  # noqa: F401  (a torch trainer's, imported before it builds its loader, as the peers' runners do)

    from croupier.client import Loader

    ids = np.asarray(job.extra["ids"], dtype=np.int64) if job.extra.get("ids") else None
    emit("start", t=now())
    loader = Loader(job.extra["dataset"], servers=job.extra["address"], batch_size=job.batch, rank=job.rank,
                    world_size=job.world, seed=job.seed)
    if job.resume:
        loader.load_state_dict(load_state(job))
    start = loader.epoch

    def epoch(e: int):
        loader.set_epoch(start + e)
        for b in loader.batches():
            real = b.indices[~b.padding].astype(np.int64)  # padding repeats rows to even out the ranks
            yield (ids[real] if ids is not None else real).tolist()

    try:
        run_epochs(job, epoch, loader.state_dict)
    finally:
        loader.close()


if __name__ == "__main__":
    sys.exit(guarded(lambda: command_line("croupier", read)))
