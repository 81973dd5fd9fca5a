"""Image datasets through the server: decoded on the trainer by default, or on the server."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from croupier.client import ImageDecoding, Loader
from readers_data import expected_pixel, write_imagefolder, write_webdataset


@pytest.mark.parametrize("layout", ["imagefolder", "webdataset"])
@pytest.mark.parametrize("server_decode", [False, True])
def test_images_arrive_decoded_with_labels(serve_inprocess, tmp_path: Path, layout: str, server_decode: bool) -> None:
    if layout == "imagefolder":
        labels = [lab for _, lab in write_imagefolder(tmp_path / "data", 5)]
    else:
        labels = [lab for _, lab in write_webdataset(tmp_path / "data", 15, shard_size=4)]
    srv = serve_inprocess(datasets=[f"imgs={tmp_path / 'data'}"])
    loader = Loader("imgs", servers=srv.address, batch_size=4, seed=2, decoding=ImageDecoding(on_server=server_decode))
    seen = []
    for b in loader.batches():
        images, got_labels = b.data["image"], b.data["label"]
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, 8, 8)
        for img, lab, idx in zip(images, got_labels.tolist(), b.indices.tolist()):
            assert lab == labels[idx]
            assert int(img[0, 0, 0]) == expected_pixel(idx)
            seen.append(idx)
    assert sorted(seen) == list(range(15))


def test_transform_and_pil_decoding(serve_inprocess, tmp_path: Path) -> None:
    write_imagefolder(tmp_path / "data", 2)
    srv = serve_inprocess(datasets=[f"imgs={tmp_path / 'data'}"])

    def to_float(sample):
        img = sample["image"]  # a PIL image with decode_images="pil"
        return {"x": torch.tensor(img.size, dtype=torch.float32), "y": sample["label"]}

    loader = Loader("imgs", servers=srv.address, batch_size=3, decoding=ImageDecoding(output="pil"), transform=to_float)
    batches = list(loader)
    assert sum(len(b["y"]) for b in batches) == 6
    assert all(b["x"].tolist() == [[8.0, 8.0]] * len(b["y"]) for b in batches)
