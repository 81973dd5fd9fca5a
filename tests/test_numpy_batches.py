"""format="numpy": batches of NumPy arrays (images uint8 HWC), and torch never imported.

Real server on loopback; the torch-free client runs in a subprocess in which `import
torch` fails, as on a base install (torch is in the `client` extra).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from croupier.client import Loader, numpy_collate
from readers_data import expected_pixel, write_arrow_file, write_imagefolder

#: Run first in the subprocess: torch and everything under it cannot be imported.
_NO_TORCH = textwrap.dedent('''
    import sys
    sys.modules["torch"] = None  # `import torch` now raises ImportError
    try:
        import torch
    except ImportError:
        pass
    else:
        raise SystemExit("torch is still importable")
''')


def _run_without_torch(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _NO_TORCH + textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def datasets(serve_inprocess, tmp_path: Path):
    write_arrow_file(tmp_path / "rows.arrow", 40)
    write_imagefolder(tmp_path / "images", 4)
    return serve_inprocess(datasets=[f"rows={tmp_path / 'rows.arrow'}", f"images={tmp_path / 'images'}"]).address


def test_numpy_batches_without_torch_importable(datasets: str) -> None:
    got = _run_without_torch(f'''
        import json, sys
        import numpy as np
        import croupier.client
        from croupier.client import Loader

        rows = Loader("rows", servers="{datasets}", batch_size=8, seed=1, format="numpy")
        table = [b for b in rows.batches()]
        images = Loader("images", servers="{datasets}", batch_size=5, seed=2, format="numpy")
        image_batches = list(images)
        first = table[0].data
        print(json.dumps({{
            "torch_modules": sorted(m for m, v in sys.modules.items() if m.split(".")[0] == "torch" and v is not None),
            "table_types": {{k: type(v).__name__ for k, v in first.items()}},
            "id_dtype": str(first["id"].dtype), "tokens": [str(first["tokens"].dtype), list(first["tokens"].shape)],
            "ids": sorted(i for b in table for i in b.data["id"].tolist()),
            "ids_match_plan": all(b.data["id"].tolist() == b.indices.tolist() for b in table),
            "image": [str(image_batches[0]["image"].dtype), list(image_batches[0]["image"].shape)],
            "pixels": [int(b["image"][k, 0, 0, 0]) for b in image_batches for k in range(len(b["label"]))],
        }}))
    ''')
    assert got["torch_modules"] == []
    assert got["table_types"] == {"id": "ndarray", "text": "list", "score": "ndarray", "tokens": "ndarray"}
    assert got["id_dtype"] == "int64" and got["tokens"] == ["int32", [8, 3]]
    assert got["ids"] == list(range(40)) and got["ids_match_plan"]
    assert got["image"] == ["uint8", [5, 8, 8, 3]]  # [B, H, W, C]
    assert sorted(got["pixels"]) == sorted(expected_pixel(i) for i in range(12))


def test_numpy_batches_hold_what_torch_batches_hold(datasets: str) -> None:
    for name, bs in (("rows", 8), ("images", 5)):
        as_numpy = list(Loader(name, servers=datasets, batch_size=bs, seed=3, format="numpy"))
        as_torch = list(Loader(name, servers=datasets, batch_size=bs, seed=3))
        assert len(as_numpy) == len(as_torch)
        for n, t in zip(as_numpy, as_torch):
            assert n.keys() == t.keys()
            for key in n:
                if isinstance(t[key], torch.Tensor):
                    want = t[key].permute(0, 2, 3, 1).numpy() if key == "image" else t[key].numpy()
                    assert np.array_equal(n[key], want) and n[key].dtype == want.dtype, key
                else:
                    assert n[key] == t[key], key


def test_the_numpy_path_through_samples_equals_the_column_fast_path(datasets: str) -> None:
    fast = list(Loader("rows", servers=datasets, batch_size=8, seed=4, format="numpy"))
    per_sample = list(Loader("rows", servers=datasets, batch_size=8, seed=4, format="numpy", transform=lambda s: s))
    for a, b in zip(fast, per_sample):
        for key in a:
            assert np.array_equal(np.asarray(a[key]), np.asarray(b[key])), key


def test_numpy_collate() -> None:
    out = numpy_collate([{"x": np.zeros((2, 3), np.float32), "n": 1, "f": 0.5, "ok": True, "s": "a", "v": None},
                         {"x": np.ones((2, 3), np.float32), "n": 2, "f": 1, "ok": False, "s": "b", "v": None}])
    assert out["x"].shape == (2, 2, 3) and out["x"].dtype == np.float32
    assert out["n"].dtype == np.int64 and out["f"].dtype == np.float64 and out["ok"].dtype == np.bool_
    assert out["s"] == ["a", "b"] and out["v"] == [None, None]
    ragged = numpy_collate([np.zeros(2), np.zeros(3)])
    assert isinstance(ragged, list) and len(ragged) == 2


def test_numpy_format_refuses_torch_only_options(datasets: str) -> None:
    with pytest.raises(ValueError, match="format='numpy' takes neither"):
        Loader("rows", servers=datasets, batch_size=8, format="numpy", device="cpu")
    with pytest.raises(ValueError, match="format must be 'torch' or 'numpy', got 'jax'"):
        Loader("rows", servers=datasets, batch_size=8, format="jax")  # type: ignore[arg-type]
