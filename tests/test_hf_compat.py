"""A row served from a Hugging Face `save_to_disk` folder equals the row `load_from_disk` gives."""

from __future__ import annotations

from pathlib import Path

import torch

from croupier.client import Loader


def _plain(value):
    return value.tolist() if isinstance(value, torch.Tensor) else value


def test_served_rows_equal_load_from_disk(serve_inprocess, tmp_path: Path) -> None:
    import datasets

    n = 257
    ds = datasets.Dataset.from_dict(
        {
            "text": [f"document {i} " + "word " * (i % 7) for i in range(n)],
            "label": [i % 5 for i in range(n)],
            "score": [i / 3 for i in range(n)],
            "tokens": [list(range(i % 11)) for i in range(n)],
        }
    )
    path = tmp_path / "hf"
    ds.save_to_disk(str(path), max_shard_size="8KB")  # several arrow files
    assert len(list(path.glob("data-*.arrow"))) > 1
    reference = datasets.load_from_disk(str(path))

    srv = serve_inprocess(datasets=[f"docs={path}"])
    loader = Loader("docs", servers=srv.address, batch_size=16, seed=3, collate_fn=list)
    seen = 0
    for batch in loader.batches():
        for index, sample in zip(batch.indices.tolist(), batch.data):
            assert {k: _plain(v) for k, v in sample.items()} == reference[index]
            seen += 1
    assert seen == n
