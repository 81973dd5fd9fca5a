"""How many encodes a server's CPU pool ran over one epoch of one Loader (tests of which
chunks are encoded on the event loop and which in the pool: `Reader.encodes_on_loop`)."""

from __future__ import annotations

from typing import Any

from croupier.client import ImageDecoding, Loader


def encodes_in_executor(srv: Any, dataset: str, batch_size: int, **decoding: Any) -> tuple[int, int]:
    """(samples delivered, encode calls the server's CPU pool ran) over epoch 0."""
    executor = srv.running.executor
    names: list[str] = []
    submit = executor.submit

    def counted(fn, *args, **kwargs):
        names.append(getattr(fn, "__name__", ""))
        return submit(fn, *args, **kwargs)

    executor.submit = counted
    loader = Loader(dataset, servers=srv.address, batch_size=batch_size, seed=0, epoch=0, format="numpy",
                    decoding=ImageDecoding(**decoding))
    try:
        n = sum(len(b.indices) for b in loader.batches())
    finally:
        loader.close()
        executor.submit = submit
    return n, names.count("encode")
