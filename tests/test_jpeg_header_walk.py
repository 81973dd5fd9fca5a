"""The JPEG header check in C (server/readers/_imagecheck.c) says what its Python reference
(images._jpeg_problem_py) says, word for word, on real files, every truncation of them,
corrupted bytes, and hand-made headers that take each branch of the walk."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from croupier.server.readers import images

native = pytest.importorskip("croupier.server.readers._imagecheck", reason="the native JPEG check is not built")


def _jpeg(size: int, mode: str = "RGB", seed: int = 0, **save) -> bytes:
    rng = np.random.default_rng(seed)
    shape = (size, size, 3) if mode == "RGB" else (size, size)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8), mode).save(buf, format="JPEG", **save)
    return buf.getvalue()


REAL = [
    _jpeg(1), _jpeg(64), _jpeg(64, "L"), _jpeg(33, quality=30), _jpeg(48, progressive=True),
    _jpeg(40, optimize=True), _jpeg(16, exif=b"Exif\x00\x00" + b"\x00" * 64),
]


def _both(data: bytes) -> str | None:
    want = images._jpeg_problem_py(data)
    got = native.jpeg_problem(data)
    assert got == want, (data[:64], got, want)
    return got


def test_the_native_walk_is_the_one_images_uses() -> None:
    assert images._jpeg_problem is native.jpeg_problem


@pytest.mark.parametrize("k", range(len(REAL)))
def test_every_truncation_of_a_real_jpeg_gets_the_same_verdict(k: int) -> None:
    data = REAL[k]
    assert _both(data) is None
    verdicts = {_both(data[:cut]) for cut in range(len(data))}
    assert len(verdicts) >= 3, verdicts  # several kinds of problem seen
    # cut before the scan's end marker: always a problem, never None
    assert all(_both(data[:cut]) is not None for cut in range(data.rindex(b"\xff\xd9")))


def test_corrupted_bytes_get_the_same_verdict() -> None:
    rng = np.random.default_rng(7)
    seen: set[str | None] = set()
    for data in REAL:
        sos = data.index(b"\xff\xda")
        for _ in range(300):
            b = bytearray(data)
            for pos in rng.integers(0, sos + 12, rng.integers(1, 4)):
                b[pos] = int(rng.integers(0, 256))
            seen.add(_both(bytes(b)))
    assert None in seen and len(seen) >= 5, seen


SOF = b"\xff\xc0\x00\x11\x08\x00\x10\x00\x10\x03" + b"\x01\x22\x00\x02\x11\x01\x03\x11\x01"
SOS = b"\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00"


@pytest.mark.parametrize("data, problem", [
    (b"\xff\xd8" + SOF + SOS + b"\x12\x34\xff\xd9", None),
    (b"\xff\xd8\xff\xff\xff" + SOF + SOS + b"\xff\xd9", None),  # fill bytes before a marker
    (b"\xff\xd8\xff\xd0\xff\x01" + SOF + SOS + b"\xff\xd9", None),  # standalone markers (RST0, TEM)
    (b"\xff\xd8" + SOS + b"\xff\xd9", "image data starts before any frame header (SOF)"),
    (b"\xff\xd8" + SOF + SOS + b"\x00\x00", "no end-of-image marker after its image data (truncated or overwritten?)"),
    (b"\xff\xd8\xff\xd9\x00\x00", "it ends (end-of-image marker) before any image data"),
    (b"\xff\xd8" + SOF[:5] + b"\x00\x00" + SOF[7:] + SOS + b"\xff\xd9", "its frame header declares a zero width or height"),
    (b"\xff\xd8\xff\xc0\x00\x06\x08\x00\x10\x00" + SOS + b"\xff\xd9", "its frame header declares a zero width or height"),
    (b"\xff\xd8\xff\xe0\x00\x01" + b"\x00" * 8, "the header segment at byte 2 runs past the end of the file (truncated?)"),
    (b"\xff\xd8\x00\xe0\x00\x10" + b"\x00" * 8, "no segment marker at byte 2 of its header (corrupt)"),
    (b"\xff\xd8\xff", "the file ends inside its header (truncated?)"),
    (b"\xff\xd8" + b"\xff\xfe\x00\x02" * 4100, "its header has too many segments (corrupt)"),
])
def test_each_branch_of_the_walk(data: bytes, problem: str | None) -> None:
    assert _both(data) == problem


def test_any_buffer_is_read_and_a_non_buffer_is_refused() -> None:
    data = REAL[1]
    assert native.jpeg_problem(memoryview(data)) is None and native.jpeg_problem(bytearray(data)) is None
    with pytest.raises(TypeError):
        native.jpeg_problem("not bytes")


def _checked_is_jpeg(data) -> bool:
    try:
        return images.checked_format(data, 0, "f") == "jpeg"
    except Exception:
        return False


def test_a_groups_sound_jpegs_are_those_checked_format_passes_as_jpeg() -> None:
    """`sound_jpegs` (one call for a read group) says True exactly where `checked_format`
    returns "jpeg" for a landed read: never for a failed read, another format, a truncated
    or corrupted JPEG, or data that is not bytes; the Python fallback says the same."""
    rng = np.random.default_rng(3)
    datas: list = [d for data in REAL for d in (data, data[: len(data) // 2], data[:3])]
    for data in REAL:
        b = bytearray(data)
        b[int(rng.integers(2, data.index(b"\xff\xda")))] ^= 0xFF
        datas.append(bytes(b))
    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, format="PNG")
    datas += [png.getvalue(), b"", b"\xff\xd8", bytearray(REAL[0]), memoryview(REAL[0])]
    landed = [(k, d, None) for k, d in enumerate(datas)] + [(len(datas), REAL[0], OSError("gone")), (len(datas) + 1, None, None)]
    want = [err is None and type(d) is bytes and _checked_is_jpeg(d) for _, d, err in landed]
    assert native.sound_jpegs(landed) == want
    assert [err is None and type(d) is bytes and d[:3] == b"\xff\xd8\xff" and images._jpeg_problem_py(d) is None
            for _, d, err in landed] == want  # the fallback's rule
    assert want[0:len(REAL) * 3] == [True, False, False] * len(REAL)  # the real ones pass, their cuts do not
    assert not any(want[len(REAL) * 3 + len(REAL):])  # the PNG, the stubs, the views, the failed and empty reads
