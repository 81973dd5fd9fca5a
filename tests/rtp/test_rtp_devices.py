"""Device selection for NCCL, in-process with torch.cuda's device calls faked (no GPU here).

NCCL uses the current CUDA device for a group's communicator and for batch_isend_irecv
(torch's docs: "users must set the current GPU device with torch.cuda.set_device,
otherwise it will lead to unexpected hang issues"), so whichever device RTP settles on,
given or default, must be made current. gloo needs nothing of the kind.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from croupier.client.rtp import api


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """Two fake CUDA devices, the current one 0; returns the devices passed to set_device."""
    current: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(torch.device(d)))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return current


def _device(backend: str, device=None) -> torch.device:
    return api._device_for(SimpleNamespace(backend=backend), nn.Linear(2, 2), device)


def test_nccl_defaults_to_local_rank_and_makes_it_current(cuda, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _device("nccl") == torch.device("cuda", 1)
    assert cuda == [torch.device("cuda", 1)]


def test_nccl_without_local_rank_uses_the_current_device(cuda):
    assert _device("nccl") == torch.device("cuda", 0)
    assert cuda == [torch.device("cuda", 0)]


def test_an_explicit_cuda_device_is_honoured_and_made_current(cuda, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _device("nccl", "cuda:0") == torch.device("cuda", 0)
    assert _device("nccl", torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert _device("nccl", "cuda") == torch.device("cuda", 1)  # no index: LOCAL_RANK's
    assert cuda == [torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 1)]


def test_a_mixed_backend_keeps_the_models_device_and_sets_a_cuda_one(cuda, monkeypatch):
    # init_process_group() without a backend gives "cpu:gloo,cuda:nccl", also on machines without GPUs
    monkeypatch.setenv("LOCAL_RANK", "1")
    mixed = "cpu:gloo,cuda:nccl"
    assert _device(mixed) == torch.device("cpu")
    assert _device(mixed, "cpu") == torch.device("cpu")
    assert cuda == []
    assert _device(mixed, "cuda") == torch.device("cuda", 1)
    assert _device(mixed, "cuda:0") == torch.device("cuda", 0)
    assert cuda == [torch.device("cuda", 1), torch.device("cuda", 0)]


def test_nccl_refuses_a_device_it_cannot_use(cuda, monkeypatch):
    with pytest.raises(ValueError, match="CUDA tensors only"):
        _device("nccl", "cpu")
    monkeypatch.setenv("LOCAL_RANK", "2")  # only 2 devices visible
    with pytest.raises(ValueError, match="pass device= explicitly"):
        _device("nccl")
    assert cuda == []


def test_gloo_keeps_the_module_where_it_is_and_sets_no_device(cuda):
    assert _device("gloo") == torch.device("cpu")
    assert _device("gloo", "cpu") == torch.device("cpu")
    assert cuda == []
