"""The client's image decoding: the fast JPEG path gives Pillow's pixels exactly, and
everything it does not take (CMYK, PNG, corrupt bytes) still decodes, or fails, as Pillow does."""

from __future__ import annotations

import concurrent.futures
import io

import numpy as np
import pytest
import torch
from PIL import Image

from croupier.client import samples
from croupier.client.samples import SampleDecodeError, decode_image
from croupier.v1 import croupier_pb2 as pb

simplejpeg = pytest.importorskip("simplejpeg", reason="simplejpeg (a croupier dependency) is not installed")


def _encoded(mode: str, fmt: str = "JPEG", **save: object) -> bytes:
    rng = np.random.default_rng(7)
    # Smooth gradients plus noise: chroma subsampling and DCT rounding both matter.
    y, x = np.mgrid[0:41, 0:59]
    arr = np.stack([(x * 4) % 256, (y * 6) % 256, (x + y) % 256], axis=-1).astype(np.int16)
    arr = np.clip(arr + rng.integers(-20, 21, arr.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).convert(mode).save(buf, fmt, **save)
    return buf.getvalue()


def _pillow(data: bytes) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as img:
        return torch.from_numpy(np.asarray(img.convert("RGB")).copy()).permute(2, 0, 1)


JPEGS = {
    "rgb 4:2:0": _encoded("RGB", quality=75),
    "rgb 4:4:4 q95": _encoded("RGB", quality=95, subsampling=0),
    "rgb 4:2:2": _encoded("RGB", subsampling=1),
    "progressive": _encoded("RGB", progressive=True),
    "grayscale": _encoded("L"),
    "cmyk": _encoded("CMYK"),
}


@pytest.mark.parametrize("name", sorted(JPEGS))
def test_a_decoded_jpeg_is_pillows_tensor_bit_for_bit(name: str) -> None:
    data = JPEGS[name]
    got = decode_image(pb.Image(data=data, key=name), "tensor", 0)
    want = _pillow(data)
    assert got.dtype == torch.uint8 and got.shape == want.shape
    assert torch.equal(got, want)


def test_ycbcr_and_grayscale_jpegs_take_the_fast_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = simplejpeg.decode_jpeg

    def counting(data, *args, **kwargs):
        calls.append(len(data))
        return real(data, *args, **kwargs)

    monkeypatch.setattr(samples._simplejpeg, "decode_jpeg", counting)
    for name in ("rgb 4:2:0", "grayscale", "progressive"):
        decode_image(pb.Image(data=JPEGS[name]), "tensor", 0)
    decode_image(pb.Image(data=JPEGS["cmyk"]), "tensor", 0)  # Pillow's own CMYK conversion
    decode_image(pb.Image(data=_encoded("RGB", "PNG")), "tensor", 0)
    assert len(calls) == 3


def test_png_and_pil_mode_still_go_through_pillow() -> None:
    png = _encoded("RGB", "PNG")
    assert torch.equal(decode_image(pb.Image(data=png), "tensor", 0), _pillow(png))
    img = decode_image(pb.Image(data=JPEGS["rgb 4:2:0"]), "pil", 0)
    assert isinstance(img, Image.Image) and img.mode == "RGB"


@pytest.mark.parametrize("damage", ["truncated", "garbage after the marker"])
def test_a_corrupt_jpeg_fails_with_pillows_reason_naming_the_sample(damage: str) -> None:
    good = JPEGS["rgb 4:2:0"]
    bad = good[: len(good) // 2] if damage == "truncated" else good[:3] + b"\0" * 300
    with pytest.raises(SampleDecodeError, match=r"sample 12 \(cats/1\.jpg\): not a decodable image"):
        decode_image(pb.Image(data=bad, key="cats/1.jpg"), "tensor", 12)


def test_a_jpeg_over_pillows_decompression_bomb_limit_is_refused_as_pillow_refuses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = JPEGS["rgb 4:2:0"]  # 41 x 59 = 2,419 pixels
    want = _pillow(data)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1_000)  # Pillow refuses over twice the limit
    with pytest.raises(Image.DecompressionBombError):
        decode_image(pb.Image(data=data), "tensor", 0)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2_000)  # over the limit: Pillow warns, and decodes
    with pytest.warns(Image.DecompressionBombWarning):
        got = decode_image(pb.Image(data=data), "tensor", 0)
    assert torch.equal(got, want)


class _CountingPool(concurrent.futures.ThreadPoolExecutor):
    """A real thread pool that counts the tasks it is given."""

    def __init__(self, workers: int):
        super().__init__(workers)
        self.tasks = 0

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        self.tasks += 1
        return super().submit(fn, *args, **kwargs)


@pytest.mark.parametrize("workers", [2, 3])
def test_a_batch_is_decoded_in_one_slice_per_thread_in_order_and_its_first_error_is_raised(workers: int) -> None:
    """A thread hand-off per image cost more than decoding a small one: a batch is cut into
    one contiguous slice per decode thread, the first decoded by the calling thread."""
    good = [_encoded("RGB", quality=70 + i) for i in range(10)]
    images = [pb.Image(data=d, format="jpeg", key=f"k{i}", label=i % 3) for i, d in enumerate(good)]
    indices = np.arange(100, 110)
    with _CountingPool(workers) as pool:
        got = samples.image_samples(images, indices, "tensor", pool)
        assert pool.tasks == workers - 1  # not one per image
    assert [s["label"] for s in got] == [i % 3 for i in range(10)]
    for s, d in zip(got, good):
        assert torch.equal(s["image"], _pillow(d))
    # two bad images: the earlier one's error, whichever slice it is in
    images[7] = pb.Image(data=b"\xff\xd8\xffnot a jpeg", format="jpeg", key="bad7")
    images[3] = pb.Image(data=b"neither", format="jpeg", key="bad3")
    with _CountingPool(workers) as pool, pytest.raises(SampleDecodeError, match=r"sample 103 \(bad3\)"):
        samples.image_samples(images, indices, "tensor", pool)
    images[3] = pb.Image(data=good[3], format="jpeg", key="k3")
    with _CountingPool(workers) as pool, pytest.raises(SampleDecodeError, match=r"sample 107 \(bad7\)"):
        samples.image_samples(images, indices, "tensor", pool)
