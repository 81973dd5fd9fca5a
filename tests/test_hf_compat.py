"""A row served from a Hugging Face `save_to_disk` folder equals the row `load_from_disk` gives."""

from __future__ import annotations

from pathlib import Path

import torch

from croupier.client import ImageDecoding, Loader


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


def test_image_features_arrive_decoded_as_load_from_disk_decodes_them(serve_inprocess, tmp_path: Path) -> None:
    import datasets
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 256, (6 + i % 3, 5, 3), dtype=np.uint8)) for i in range(12)]
    features = datasets.Features({"img": datasets.Image(), "label": datasets.Value("int64")})
    ds = datasets.Dataset.from_dict({"img": pictures, "label": list(range(12))}, features=features)
    path = tmp_path / "hf-images"
    ds.save_to_disk(str(path))
    reference = datasets.load_from_disk(str(path))

    srv = serve_inprocess(datasets=[f"pics={path}"])
    for mode in ("tensor", "pil"):
        loader = Loader("pics", servers=srv.address, batch_size=4, seed=1, collate_fn=list,
                        decoding=ImageDecoding(output=mode))
        seen = 0
        for batch in loader.batches():
            for index, sample in zip(batch.indices.tolist(), batch.data):
                want = np.asarray(reference[index]["img"].convert("RGB"))
                got = sample["img"].permute(1, 2, 0).numpy() if mode == "tensor" else np.asarray(sample["img"])
                assert np.array_equal(got, want) and sample["label"] == reference[index]["label"]
                seen += 1
        assert seen == 12
