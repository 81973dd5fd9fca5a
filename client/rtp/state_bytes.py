"""Byte accounting of model state on one rank: parameters, gradients, optimizer state.

Counts what each rank actually stores: the local part of sharded tensors (including
FSDP2's DTensors, so the benchmark can use the same function for every engine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.optim import Optimizer


@dataclass(frozen=True)
class StateBytes:
    parameters: int
    gradients: int
    optimizer: int
    ring_buffers: int = 0

    @property
    def model_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        return self.model_state + self.ring_buffers


def local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def state_bytes(module: nn.Module, optimizer: Optimizer | None = None, ring_buffers: int = 0) -> StateBytes:
    params = list(module.parameters())  # tied parameters once
    grads = sum(local_bytes(p.grad) for p in params if p.grad is not None)
    opt, seen = 0, set()
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and id(v) not in seen:
                    seen.add(id(v))
                    opt += local_bytes(v)
    return StateBytes(sum(local_bytes(p) for p in params), grads, opt, ring_buffers)
