"""`croupier demo`: the main job end to end, as a user runs it.

Real processes throughout: the `croupier` CLI, a `croupier serve` subprocess on a
loopback port, two torch.distributed (gloo) rank processes training an RTP-sharded
model from batches streamed over gRPC.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from croupier.demo.data import FORMATS, NUM_CLASSES, SPLITS, load_digits_uint8, prepare, split_indices


def _demo(args: list[str], cache: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "CROUPIER_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "croupier.cli", "demo", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_demo_on_a_fresh_machine_reaches_95_percent_held_out(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    done = _demo(["--epochs", "2", "--summary-json", str(summary)], tmp_path / "cache")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "cache" / "demo" / "VERSION").exists()  # prepared from nothing
    match = re.search(r"held-out accuracy: ([0-9.]+) \((\d+)/(\d+) ", done.stdout)
    assert match, done.stdout
    result = json.loads(summary.read_text())
    assert float(match.group(1)) == pytest.approx(result["accuracy"], abs=1e-4)
    assert result["accuracy"] >= 0.95
    assert result["test_samples"] == int(match.group(3)) == 355  # every test image, once
    assert result["train_samples"] == 2 * 1442 and result["world_size"] == 2
    # the backend announced before the ranks start is the one they used (no GPU here: gloo)
    assert result["backend"] == "gloo" and "croupier demo: 2 ranks (gloo), " in done.stdout
    assert len(result["samples_per_s_by_rank"]) == 2 and min(result["samples_per_s_by_rank"]) > 0
    assert re.search(r"out of order: [\d,]+ of [\d,]+ samples", done.stdout)
    assert re.search(r"waiting for data: [\d.]+s, [\d.]+s", done.stdout)
    assert "server on 127.0.0.1:" in done.stdout and "stopped" in done.stdout


@pytest.mark.slow
def test_demo_on_two_running_replicas_in_ordered_mode(serve_process, tmp_path: Path) -> None:
    data = prepare(tmp_path / "digits")
    replicas = [serve_process(data.dataset_specs("arrow")) for _ in range(2)]
    summary = tmp_path / "summary.json"
    done = _demo(["--server", ",".join(r.address for r in replicas), "--ordered", "--epochs", "2",
                  "--num-classes", str(NUM_CLASSES), "--summary-json", str(summary)], tmp_path / "unused")
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(summary.read_text())
    assert result["ordered"] and result["out_of_order"] == 0  # one read at a time arrives in order
    assert result["accuracy"] >= 0.9  # an MLP over the Arrow table's pixels, two epochs
    assert result["servers"] == [r.address for r in replicas]
    assert not (tmp_path / "unused").exists()  # a running server needs no local data


@pytest.mark.parametrize("gpus, backend", [(2, "nccl"), (1, "gloo")])
def test_demo_announces_the_backend_its_ranks_pick(monkeypatch, capsys, gpus: int, backend: str) -> None:
    # In-process, with the GPUs faked and the ranks not started: what the launcher prints
    # must follow the ranks' own choice (NCCL once every rank can have a GPU), not a constant.
    import signal

    import torch

    import croupier.demo.command
    import croupier.demo.procs
    from croupier.cli import main
    from croupier.demo.train import pick_backend

    launched = []

    class Ranks:
        def __init__(self, module, argv, world_size, workdir):
            launched.append(world_size)

        def wait(self, timeout_s):
            return [0] * launched[-1]

        def stop(self):
            pass

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(croupier.demo.procs, "RankGroup", Ranks)
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    monkeypatch.setattr(croupier.demo.command, "_check_reachable", lambda addresses, **kw: None)  # no server either
    assert pick_backend(2) == backend
    assert main(["demo", "--server", "127.0.0.1:1", "--world-size", "2"]) == 0
    assert launched == [2]
    assert f"croupier demo: 2 ranks ({backend}), each holding 1/2 of the model" in capsys.readouterr().out


def test_demo_refuses_a_dataset_it_cannot_serve(tmp_path: Path) -> None:
    done = _demo(["--data", str(tmp_path / "missing")], tmp_path / "cache", timeout=120)
    assert done.returncode == 1
    assert "does not exist" in done.stderr


def test_demo_names_a_server_that_does_not_answer_instead_of_waiting(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a loopback port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = _demo(["--server", f"127.0.0.1:{port}", "--epochs", "1"], tmp_path / "cache", timeout=120)
    assert done.returncode == 1
    assert f"no croupier server answers at 127.0.0.1:{port}" in done.stderr


def test_digits_are_split_80_20_by_class_and_the_same_in_every_format(tmp_path: Path) -> None:
    from croupier.server.readers import open_dataset

    images, labels = load_digits_uint8()
    train, test = split_indices(labels)
    assert sorted([*train, *test]) == list(range(len(labels)))
    assert len(test) == 355
    for c in range(NUM_CLASSES):  # every 5th image of each class
        assert np.sum(labels[test] == c) == np.sum(labels == c) // 5
    data = prepare(tmp_path / "digits")
    assert prepare(tmp_path / "digits") == data  # a second call reuses the files
    for split, indices in zip(SPLITS, (train, test)):
        counts = {fmt: len(open_dataset(data.path(split, fmt))) for fmt in FORMATS}
        assert set(counts.values()) == {len(indices)}, counts
        folder = open_dataset(data.path(split, "imagefolder"))
        assert folder.info().classes == tuple(str(c) for c in range(NUM_CLASSES))
        assert sorted(folder.labels) == sorted(labels[indices].tolist())
