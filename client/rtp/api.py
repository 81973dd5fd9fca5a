"""`RotatedTensorParallel`: the one call that shards a model for rotated tensor parallelism."""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from . import checkpoint
from .hooks import average_replicated_grads, disable_nested_tensor_paths, install_rotation, warn_replicated
from .state_bytes import StateBytes, state_bytes
from .sharding_plan import ModelPlan, plan_model
from .ring import Ring, RingBuffers
from .shard import RotatingShard
from .split import Split


DEFAULT_CHUNK_BYTES = 16 * 2**20


def uses_nccl(backend: str) -> bool:
    """Whether a group's backend string ("nccl", or a mix such as "cpu:gloo,cuda:nccl") includes NCCL."""
    return "nccl" in backend


def _local_cuda_index() -> int:
    local = os.environ.get("LOCAL_RANK")
    index = int(local) if local is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(f"RotatedTensorParallel: LOCAL_RANK={local} but this process sees {count} CUDA "
                         "device(s); pass device= explicitly")
    return index


def _device_for(ring: Ring, module: nn.Module, device: torch.device | str | None) -> torch.device:
    """Where this rank's shards live.

    An explicit `device` is honoured ("cuda" without an index means cuda:LOCAL_RANK when the
    group uses NCCL, else the current device). Otherwise a pure NCCL group means
    cuda:LOCAL_RANK (the current device when LOCAL_RANK is unset), and any other group, a
    mixed "cpu:gloo,cuda:nccl" one included, keeps the module where it is. Whenever NCCL can
    carry the shards (a CUDA device, a group using NCCL) that device is made current: NCCL's
    communicators and batch_isend_irecv use the current device, and a rank left on another
    one hangs or corrupts its peers' transfers.
    """
    nccl = uses_nccl(ring.backend)
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", _local_cuda_index() if nccl else torch.cuda.current_device())
    elif ring.backend == "nccl":
        dev = torch.device("cuda", _local_cuda_index())
    else:
        first = next(itertools.chain(module.parameters(), module.buffers()), None)
        dev = first.device if first is not None else torch.device("cpu")
    if nccl and dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif ring.backend == "nccl":
        raise ValueError(f"RotatedTensorParallel: the nccl backend moves CUDA tensors only, not {dev}")
    return dev


class RotatedTensorParallel(nn.Module):
    """Shards `module` across the ranks of `process_group` for rotated tensor parallelism.

    Usage: ``model = RotatedTensorParallel(model)``, then train it with any elementwise
    ``torch.optim`` optimizer over ``model.parameters()``, each rank feeding its own
    micro-batch, as with DDP.

    Sharding: every nn.Linear, nn.Embedding, nn.Conv2d, nn.LayerNorm and
    nn.MultiheadAttention (by heads) keeps only its 1/N shard of each parameter on
    each rank, as ordinary parameters under the original names. Sizes that do not
    divide by N give uneven shards; spare rows rotate between ranks so the totals stay
    balanced. Attention written with Linear projections is sharded as those Linears.
    Any other module with parameters (and a subclass of the above, which may have its
    own forward) stays replicated, with one ``ReplicatedLayerWarning`` naming them.

    Forward: each layer call computes with the owned shard, while a copy travels to the
    next rank and the following shard arrives (two buffers, double-buffered isend/irecv),
    until all N shards have been used. Parameters never move, so eval, no_grad, or an
    interrupted forward leaves every shard where it belongs.

    Backward: the shards travel back around the ring carrying gradient accumulators;
    each rank adds its micro-batch's contribution, and each accumulator ends at its
    owner. Gradients are the MEAN over ranks (as DDP): with equal micro-batches and a
    per-rank mean loss they equal a single process's gradients on the concatenated
    batch with the mean loss. Replicated parameters' gradients are averaged the same way.

    Memory per rank: 1/N of parameters, gradients and optimizer state, plus, only while
    a layer rotates, two weight shards in flight (and in backward two gradient
    accumulators), or two slices of at most ``chunk_bytes`` for a large layer. Activations
    are as in data parallel; attention recomputes its per-head activations in backward.

    Requirements: every rank of the group runs the same layers in the same order for
    every forward and backward (as FSDP). Parameters of sharded layers are local
    shards: code outside the layer that reads them directly sees 1/N of a weight, and
    optimizers that look across elements of a tensor (LBFGS, Adafactor, Shampoo) see
    only the shard; use ``clip_grad_norm_`` below, not ``torch.nn.utils``'s.

    Args:
        module: the model; moved to ``device``.
        process_group: the ranks to shard over (default: the whole world). Ring peers are
            this group's members, so several independent groups can train side by side.
        device: defaults to ``cuda:LOCAL_RANK`` with NCCL, else where the module is. With a
            group using NCCL, a CUDA device (given or default) is made current with
            ``torch.cuda.set_device``.
        sync_module_states: start every rank from group rank 0's parameters and buffers.
        chunk_bytes: a Linear, Embedding, LayerNorm or ungrouped Conv2d whose shard is larger
            rotates in slices of about this size, bounding the bytes in flight (None: never).
    """

    def __init__(self, module: nn.Module, process_group: ProcessGroup | None = None, *,
                 device: torch.device | str | None = None, sync_module_states: bool = True,
                 chunk_bytes: int | None = DEFAULT_CHUNK_BYTES):
        super().__init__()
        ring = Ring(process_group)
        dev = _device_for(ring, module, device)
        module.to(dev)
        plan = plan_model(module, ring.size)
        # The group's first call is a collective of every rank, never a ring shift: see Ring.join.
        ring.join(dev, [sum(p.split.numel(s) for p in pl.plan.params for s in range(ring.size))
                        for pl in plan.layers])
        if sync_module_states and ring.size > 1:
            with torch.no_grad():
                for t in itertools.chain(module.parameters(), module.buffers()):
                    ring.broadcast_(t.data)
        self._ring = ring
        self._ring_buffers = RingBuffers()
        self._splits: dict[int, Split] = {}
        self._shard_parameters(plan)
        self.rotating_layers: list[RotatingShard] = [
            RotatingShard(pl.name, pl.module, pl.rule, pl.plan, ring, self._ring_buffers, chunk_bytes)
            for pl in plan.layers]
        for layer in self.rotating_layers:
            install_rotation(layer)
        self._replicated = [p for p in module.parameters() if id(p) not in self._splits]
        self._grad_hooks = average_replicated_grads(self._replicated, ring)
        disable_nested_tensor_paths(module)
        self.module = module
        warn_replicated(plan.replicated)

    def _shard_parameters(self, plan: ModelPlan) -> None:
        """Replace each planned parameter, wherever it is registered, by this rank's shard."""
        rank = self._ring.rank
        with torch.no_grad():
            for layer in plan.layers:
                for sp in layer.plan.params:
                    full = getattr(sp.owner, sp.name)
                    if id(full) in self._splits:  # a tied weight, already replaced everywhere
                        continue
                    local = nn.Parameter(sp.split.take(full.detach(), rank), requires_grad=full.requires_grad)
                    for owner, name in plan.registrations[id(full)]:
                        setattr(owner, name, local)
                    self._splits[id(local)] = sp.split

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def process_group(self) -> ProcessGroup:
        return self._ring.group

    @property
    def rank(self) -> int:
        """This process's rank in the group, which is also the index of the shard it owns."""
        return self._ring.rank

    @property
    def world_size(self) -> int:
        return self._ring.size

    def sharding(self) -> dict[str, Split | None]:
        """How each parameter (by its original name) is split; None for replicated ones."""
        return {name: self._splits.get(id(p)) for name, p in self.module.named_parameters(remove_duplicate=False)}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state_dict, keys and shapes as the original module (collective)."""
        return checkpoint.full_state_dict(self.module, self._splits, self._ring)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        checkpoint.load_full_state_dict(self.module, self._splits, self._ring, state_dict, strict)

    def sharded_state_dict(self, optimizer: Optimizer | None = None) -> dict[str, Any]:
        """This rank's shards, optionally with the optimizer's (already sharded) state."""
        return checkpoint.sharded_state_dict(self.module, self._splits, self._ring, optimizer)

    def load_sharded_state_dict(self, state: dict[str, Any], optimizer: Optimizer | None = None) -> None:
        checkpoint.load_sharded_state_dict(self.module, self._splits, self._ring, state, optimizer)

    def save_sharded(self, directory: str | os.PathLike, optimizer: Optimizer | None = None) -> Path:
        """Each rank writes ``rank{r}-of-{N}.pt`` under `directory` (collective: ends with a barrier)."""
        return checkpoint.save_sharded(self.module, self._splits, self._ring, directory, optimizer)

    def load_sharded(self, directory: str | os.PathLike, optimizer: Optimizer | None = None) -> None:
        checkpoint.load_sharded(self.module, self._splits, self._ring, directory, optimizer)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient (collective); returns that norm."""
        norm_type = float(norm_type)
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        sharded = [id(p.grad) for p in self.module.parameters() if p.grad is not None and id(p) in self._splits]
        device = next(self.module.parameters()).device
        if not grads:
            return torch.zeros((), device=device)
        if math.isinf(norm_type):
            local = torch.stack([g.abs().max() if g.numel() else g.new_zeros(()) for g in grads]).max().double()
            self._ring.all_reduce_max_(local)
            total = local
        else:
            # Shards partition a tensor, so their p-th powers add up; replicated grads are equal
            # on every rank and must count once.
            local = torch.zeros((), dtype=torch.float64, device=device)
            for g in grads:
                part = torch.linalg.vector_norm(g, norm_type).double() ** norm_type
                local += part if id(g) in sharded else part / self._ring.size
            self._ring.all_reduce_sum_(local)
            total = local ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total.to(grads[0].dtype)

    def state_bytes(self, optimizer: Optimizer | None = None) -> StateBytes:
        """Bytes this rank holds for parameters, gradients and optimizer state, and the
        high-water mark of its ring buffers so far."""
        return state_bytes(self.module, optimizer, self._ring_buffers.peak_bytes)

    def ring_buffer_bound(self) -> int:
        """Most bytes ring buffers can take: two weight shards (or slices) and two gradient
        accumulators of the largest unit that rotates."""
        return max((4 * layer.max_chunk_numel * layer.dtype.itemsize for layer in self.rotating_layers), default=0)
