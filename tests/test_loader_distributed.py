"""The Loader takes rank and world size from torch.distributed when it is initialised."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank: int, world: int, port: int, address: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from croupier.client import Loader

        loader = Loader("rows", servers=address, batch_size=8, seed=3, device="cpu")
        indices = [i for b in loader.batches() for i in b.indices.tolist()]
        out.put((rank, loader.rank, loader.world_size, indices))
    finally:
        from croupier.client.rtp import destroy_process_group

        destroy_process_group()


def test_rank_and_world_default_from_torch_distributed(serve_inprocess) -> None:
    import socket

    srv = serve_inprocess(datasets=["rows=synthetic:100"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, srv.address, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert [(r, lr, w) for r, lr, w, _ in results] == [(0, 0, 2), (1, 1, 2)]
    assert sorted(results[0][3] + results[1][3]) == list(range(100))
