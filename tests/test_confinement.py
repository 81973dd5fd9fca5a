"""Confinement: nothing outside a dataset's roots is read, whatever links its folders hold.

Every escape here is served (status OK, outside bytes) when the check is off: the
`follow_symlinks_outside_roots` control tests show it with the very same layout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pytest

from croupier.client import ImageDecoding, Loader, LoaderError, RetryPolicy
from readers_data import png_bytes, write_imagefolder, write_tar, write_webdataset

OUTSIDE_VALUE = 7_000_000  # every row of the outside table: seen only if it leaked
DENIED = "outside the dataset's roots"


def _arrow(path: Path, values) -> Path:
    table = pa.table({"x": np.asarray(values, dtype=np.int64)})
    path.parent.mkdir(parents=True, exist_ok=True)
    with pa.ipc.new_file(path, table.schema) as w:
        w.write_table(table)
    return path


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """Files outside every root: a table, an image, a class folder, a shard, a text file."""
    out = tmp_path / "outside"
    _arrow(out / "secret.arrow", [OUTSIDE_VALUE] * 5)
    (out / "cls").mkdir(parents=True)
    for k in range(2):
        (out / "cls" / f"{k}.png").write_bytes(png_bytes(200 + k))
    (out / "secret.png").write_bytes(png_bytes(250))
    write_tar(out / "secret.tar", {"s0.png": png_bytes(251), "s0.cls": b"1"})
    (out / "secret.txt").write_text("TOPSECRET-LINE-1\nTOPSECRET-LINE-2\n")
    return out


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "data"
    r.mkdir()
    return r


def _rows(address: str, dataset: str, **kw) -> list:
    loader = Loader(dataset, servers=address, batch_size=2, retry=RetryPolicy(max_retries=0),
                    decoding=ImageDecoding(output="none"), **kw)
    out = []
    for b in loader.batches():
        out.extend(b.data["x"].tolist() if isinstance(b.data, dict) and "x" in b.data else b.indices.tolist())
    return out


def _describe(address: str, dataset: str):
    from croupier.v1 import croupier_pb2 as pb, croupier_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        return croupier_pb2_grpc.CroupierStub(ch).DescribeDataset(pb.DescribeDatasetRequest(name=dataset), timeout=30)


def _denied(address: str, dataset: str, member: str, outside: Path) -> LoaderError:
    with pytest.raises(LoaderError) as info:
        _rows(address, dataset)
    err = info.value
    assert err.code == grpc.StatusCode.PERMISSION_DENIED, str(err)
    assert DENIED in str(err) and member in str(err), str(err)
    # Where the link points, and what the outside file holds, are never told.
    assert str(outside) not in str(err) and "secret" not in str(err) and "TOPSECRET" not in str(err), str(err)
    return err


def _escapes(root: Path, outside: Path) -> dict[str, str]:
    """Dataset folder (under root) -> the member that links outside, one per escape."""
    write_imagefolder(root / "img_file", 2, classes=("a", "b"))
    os.symlink(outside / "secret.png", root / "img_file" / "a" / "zz.png")
    write_imagefolder(root / "img_class", 2, classes=("a", "b"))
    os.symlink(outside / "cls", root / "img_class" / "c")
    _arrow(root / "arrow_dir" / "part-0.arrow", range(4))
    os.symlink(outside / "secret.arrow", root / "arrow_dir" / "part-1.arrow")
    write_webdataset(root / "shards", 4, shard_size=4)
    os.symlink(outside / "secret.tar", root / "shards" / "shard-0009.tar")
    write_webdataset(root / "shards_classes", 4, shard_size=4)
    os.symlink(outside / "secret.txt", root / "shards_classes" / "classes.txt")
    return {
        "img_file": "zz.png",
        "img_class": "img_class/c",
        "arrow_dir": "part-1.arrow",
        "shards": "shard-0009.tar",
        "shards_classes": "classes.txt",
    }


def test_links_out_of_a_data_root_are_refused_naming_the_member(serve_inprocess, root: Path, outside: Path) -> None:
    escapes = _escapes(root, outside)
    _arrow(root / "good.arrow", range(10))
    srv = serve_inprocess(data_roots=[str(root)])
    for dataset, member in escapes.items():
        _denied(srv.address, dataset, member, outside)
    assert sorted(_rows(srv.address, "good.arrow")) == list(range(10))  # the server goes on


def test_the_same_links_are_served_when_the_operator_allows_it(serve_inprocess, root: Path, outside: Path) -> None:
    # The control: each layout above really reaches outside bytes without the check.
    _escapes(root, outside)
    srv = serve_inprocess(data_roots=[str(root)], follow_symlinks_outside_roots=True)
    assert sorted(_rows(srv.address, "arrow_dir")) == [0, 1, 2, 3] + [OUTSIDE_VALUE] * 5
    assert len(_rows(srv.address, "img_file")) == 5
    assert len(_rows(srv.address, "img_class")) == 6
    assert len(_rows(srv.address, "shards")) == 5
    assert "TOPSECRET-LINE-1" in _describe(srv.address, "shards_classes").classes


def test_a_named_dataset_is_confined_to_its_own_folder(serve_inprocess, tmp_path: Path, outside: Path) -> None:
    # No data roots: a dataset named on the command line is its own root.
    named = tmp_path / "named"
    _arrow(named / "part-0.arrow", range(4))
    os.symlink(outside / "secret.arrow", named / "part-1.arrow")
    good = _arrow(tmp_path / "good" / "t.arrow", range(6))
    srv = serve_inprocess(datasets=[f"named={named}", f"good={good}"])
    with pytest.raises(LoaderError) as info:
        _rows(srv.address, "named")
    # Left unserved at start (reported), so FAILED_PRECONDITION with the reason.
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and DENIED in str(info.value)
    assert "part-1.arrow" in str(info.value) and str(outside) not in str(info.value)
    assert sorted(_rows(srv.address, "good")) == list(range(6))


def test_links_that_stay_inside_the_roots_are_followed(serve_inprocess, root: Path, tmp_path: Path) -> None:
    write_imagefolder(root / "imgs", 2, classes=("a", "b"))
    os.symlink(root / "imgs" / "a" / "00000.png", root / "imgs" / "b" / "zz.png")  # a file link
    os.symlink(root / "imgs" / "a", root / "imgs" / "c")  # a class folder link
    shared = _arrow(root / "store" / "t.arrow", range(3))
    (root / "tables").mkdir()
    os.symlink(shared, root / "tables" / "part-0.arrow")
    os.symlink("../store/t.arrow", root / "tables" / "part-1.arrow")  # relative, with '..'
    srv = serve_inprocess(data_roots=[str(root)])
    assert len(_rows(srv.address, "imgs")) == 4 + 1 + 2
    assert sorted(_rows(srv.address, "tables")) == [0, 0, 1, 1, 2, 2]
    # A named dataset may link across its own folder too (no data roots).
    srv2 = serve_inprocess(datasets=[f"t={root / 'tables'}", "ok=synthetic:4"])
    with pytest.raises(LoaderError) as info:  # ../store is outside the folder 'tables'
        _rows(srv2.address, "t")
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "part-0.arrow" in str(info.value)


def test_hf_state_json_cannot_name_files_outside_its_folder(serve_inprocess, root: Path, outside: Path) -> None:
    from readers_data import write_hf_dataset

    write_hf_dataset(root / "hf_ok", 20)
    srv_paths = {}
    for name, files in (
        ("hf_dotdot", ["../../outside/secret.arrow"]),
        ("hf_abs", [str(outside / "secret.arrow")]),
        ("hf_dotdot_plain", [".."]),
    ):
        write_hf_dataset(root / name, 20)
        state = json.loads((root / name / "state.json").read_text())
        state["_data_files"] = [{"filename": f} for f in files]
        (root / name / "state.json").write_text(json.dumps(state))
        srv_paths[name] = files
    # A data file that is itself a link out of the folder, and a state.json that is.
    write_hf_dataset(root / "hf_link", 20)
    data_file = sorted((root / "hf_link").glob("*.arrow"))[0]
    data_file.unlink()
    os.symlink(outside / "secret.arrow", data_file)
    write_hf_dataset(root / "hf_state_link", 20)
    (outside / "state.json").write_text((root / "hf_state_link" / "state.json").read_text())
    (root / "hf_state_link" / "state.json").unlink()
    os.symlink(outside / "state.json", root / "hf_state_link" / "state.json")
    srv = serve_inprocess(data_roots=[str(root)])
    assert len(_rows(srv.address, "hf_ok")) == 20
    for name in srv_paths:
        with pytest.raises(LoaderError) as info:
            _rows(srv.address, name)
        assert info.value.code in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.PERMISSION_DENIED)
        assert "outside its folder" in str(info.value) and "secret" not in str(info.value).replace("secret.arrow']", "")
    _denied(srv.address, "hf_link", data_file.name, outside)
    _denied(srv.address, "hf_state_link", "state.json", outside)


def test_an_image_swapped_for_a_link_after_open_is_refused_on_read(serve_inprocess, root: Path, outside: Path) -> None:
    write_imagefolder(root / "imgs", 3, classes=("a", "b"))
    srv = serve_inprocess(data_roots=[str(root)])
    assert len(_rows(srv.address, "imgs")) == 6  # opened, every file checked and read once
    victim = root / "imgs" / "b" / "00001.png"
    victim.unlink()
    os.symlink(outside / "secret.png", victim)
    _denied(srv.address, "imgs", "00001.png", outside)


def test_a_class_folder_swapped_for_a_link_after_open_is_refused_on_read(serve_inprocess, root: Path, outside: Path) -> None:
    # A swap of a folder on the way to the file: the check is on the file opened, not its name.
    write_imagefolder(root / "imgs", 2, classes=("a", "b"))
    srv = serve_inprocess(data_roots=[str(root)])
    assert len(_rows(srv.address, "imgs")) == 4
    (root / "imgs" / "b").rename(root / "b-moved")
    (outside / "b").mkdir()
    for k in range(2):
        (outside / "b" / f"{k:05d}.png").write_bytes(png_bytes(240 + k))
    os.symlink(outside / "b", root / "imgs" / "b")
    _denied(srv.address, "imgs", "imgs/b/0000", outside)


def test_a_table_file_swapped_after_open_is_still_read_from_the_file_opened(serve_inprocess, root: Path, outside: Path) -> None:
    # Table files are opened (and checked) once, at open: a later swap of the name is not followed.
    _arrow(root / "tables" / "part-0.arrow", range(5))
    srv = serve_inprocess(data_roots=[str(root)])
    assert sorted(_rows(srv.address, "tables")) == list(range(5))
    (root / "tables" / "part-0.arrow").rename(root / "old.arrow")
    os.symlink(outside / "secret.arrow", root / "tables" / "part-0.arrow")
    assert sorted(_rows(srv.address, "tables")) == list(range(5))


def test_the_tar_index_write_never_follows_a_planted_link(tmp_path: Path) -> None:
    # The data folder may be writable by others: a link under the index's temporary name,
    # or under the index's own name, must not make the server write through it.
    import io
    import os
    import tarfile

    from croupier.server.readers.webdataset import load_index

    data, outside = tmp_path / "data", tmp_path / "outside"
    data.mkdir()
    outside.mkdir()
    shard = data / "s-000.tar"
    with tarfile.open(shard, "w") as tar:
        for i in range(3):
            for ext, payload in (("cls", b"1"), ("jpg", b"\xff\xd8\xff\xd9")):
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    victim = outside / "victim.txt"
    victim.write_text("precious")
    (data / f"s-000.tar.idx.json.{os.getpid()}.tmp").symlink_to(victim)
    assert len(load_index(shard)) == 3
    assert victim.read_text() == "precious"
    (data / f"s-000.tar.idx.json.{os.getpid()}.tmp").unlink()
    (data / "s-000.tar.idx.json").unlink(missing_ok=True)
    (data / "s-000.tar.idx.json").symlink_to(victim)
    assert len(load_index(shard)) == 3
    assert victim.read_text() == "precious"
