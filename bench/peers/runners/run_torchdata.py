"""torchdata.nodes: DistributedSampler -> ParallelMapper(in_order=False) -> Batcher -> Loader (own venv).

    python run_torchdata.py read '<Job as JSON>'

No shards of its own: torchdata reads plain files, the benchmark's own (the closest prior art
to croupier's out-of-order batches is in how it maps, not how it stores), read as own_files.Rows
reads them. The order is DistributedSampler's
global permutation (set_epoch per epoch via SamplerWrapper); `ParallelMapper` reads with
`threads` threads and yields samples as they complete (in_order=False). Resume:
Loader.state_dict() per rank.
"""

from __future__ import annotations

import sys

from _common import Job, command_line, emit, guarded, load_state, now, run_loader_epochs
from own_files import Rows

#: Reads in flight per rank (threads): the I/O parallelism a torchdata user gives a slow store.
THREADS = 16


def read(job: Job) -> None:
    if job.endpoint and job.dataset == "text":
        raise SystemExit("torchdata: text on S3 is not set up (see the module's doc)")
    from torch.utils.data import DistributedSampler, default_collate
    from torchdata.nodes import Batcher, Loader, Mapper, ParallelMapper, SamplerWrapper

    emit("start", t=now())
    rows = Rows(job, connections=THREADS * 2)
    sampler = DistributedSampler(range(len(rows)), num_replicas=job.world, rank=job.rank, shuffle=True, seed=job.seed)
    node = SamplerWrapper(sampler)  # calls sampler.set_epoch() at each new pass
    node = ParallelMapper(node, map_fn=rows.get, num_workers=THREADS, in_order=False, method="thread")
    node = Batcher(node, batch_size=job.batch, drop_last=False)
    node = Mapper(node, default_collate)
    loader = Loader(node)
    if job.resume:
        loader.load_state_dict(load_state(job))

    run_loader_epochs(job, loader)


if __name__ == "__main__":
    sys.exit(guarded(lambda: command_line("torchdata", read)))
