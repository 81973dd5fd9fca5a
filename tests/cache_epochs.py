"""One epoch of an image dataset through a real Loader, checked: every sample exactly once,
each image's first byte its expected pixel (the cache tier's tests, files and objects)."""

from __future__ import annotations

from croupier.client import Loader, RetryPolicy
from readers_data import expected_pixel


def image_epoch(address: str, dataset: str, epoch: int, n: int, seed: int = 5) -> None:
    loader = Loader(dataset, servers=address, batch_size=32, seed=seed, retry=RetryPolicy(max_retries=0))
    loader.set_epoch(epoch)
    seen: list[int] = []
    for batch in loader.batches():
        for i, img in zip(batch.indices.tolist(), batch.data["image"]):
            assert int(img.reshape(-1)[0]) == expected_pixel(i)
        seen += batch.indices.tolist()
    assert sorted(seen) == list(range(n)), f"epoch {epoch}: every sample exactly once"
