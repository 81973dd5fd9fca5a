"""Checkpoints of a rotated model: per-rank shards, or the whole model as one state_dict.

Sharded checkpoints are each rank's local `state_dict` (same keys as the original
module, local shapes) plus a description of the shard, so loading into a different
world size fails loudly instead of silently mixing shards. The full `state_dict` has
exactly the original module's keys and shapes; that is also the way to reshard.

Each function takes the wrapped `module`, `splits` (id of each local shard parameter ->
its Split; replicated parameters are absent) and the `ring`: what
`RotatedTensorParallel` holds, without depending on it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from .ring import Ring
from .split import Split

Splits = Mapping[int, Split]

FORMAT = "croupier.rtp.sharded/1"


def _describe(split: Split | None, rank: int) -> dict[str, Any] | None:
    if split is None:
        return None
    return {"full_shape": list(split.full_shape), "dim": split.dim,
            "ranges": [list(r) for r in split.ranges[rank]]}


def _shard_descriptions(module: nn.Module, splits: Splits, rank: int) -> dict[str, dict[str, Any] | None]:
    return {key: _describe(splits.get(id(t)), rank) for key, t in module.state_dict(keep_vars=True).items()}


def full_state_dict(module: nn.Module, splits: Splits, ring: Ring) -> dict[str, torch.Tensor]:
    """The unsharded state_dict (collective: every rank of the group must call it)."""
    out, gathered = {}, {}
    for key, t in module.state_dict(keep_vars=True).items():
        split = splits.get(id(t))
        if split is None:
            out[key] = t.detach().clone()
            continue
        if id(t) not in gathered:  # tied weights: gathered once, shared by both keys
            numels = [split.numel(s) for s in range(ring.size)]
            pieces = ring.all_gather_flat(t.detach().reshape(-1), numels)
            gathered[id(t)] = split.assemble([p.view(split.shape(s)) for s, p in enumerate(pieces)])
        out[key] = gathered[id(t)]
    return out


def load_full_state_dict(module: nn.Module, splits: Splits, ring: Ring, state_dict: dict[str, torch.Tensor],
                         strict: bool = True) -> None:
    """Load an unsharded state_dict: each rank copies its own shard out of it (no communication)."""
    own = module.state_dict(keep_vars=True)
    missing, unexpected = sorted(own.keys() - state_dict.keys()), sorted(state_dict.keys() - own.keys())
    if strict and (missing or unexpected):
        raise KeyError(f"state_dict does not match the model: missing keys {missing}, unexpected keys {unexpected}")
    rank = ring.rank
    with torch.no_grad():
        for key, t in own.items():
            if key not in state_dict:
                continue
            src = state_dict[key].to(t.device)
            split = splits.get(id(t))
            if split is not None:
                if tuple(src.shape) != split.full_shape:
                    raise ValueError(f"{key}: expected full shape {split.full_shape}, got {tuple(src.shape)}")
                src = split.take(src, rank)
            if src.shape != t.shape:
                raise ValueError(f"{key}: expected shape {tuple(t.shape)}, got {tuple(src.shape)}")
            t.copy_(src)


def sharded_state_dict(module: nn.Module, splits: Splits, ring: Ring,
                       optimizer: Optimizer | None = None) -> dict[str, Any]:
    """This rank's shards (and optimizer state), with what is needed to check them on load."""
    return {
        "format": FORMAT,
        "rank": ring.rank,
        "world_size": ring.size,
        "shards": _shard_descriptions(module, splits, ring.rank),
        "model": module.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
    }


def load_sharded_state_dict(module: nn.Module, splits: Splits, ring: Ring, state: dict[str, Any],
                            optimizer: Optimizer | None = None) -> None:
    if state.get("format") != FORMAT:
        raise ValueError(f"not an RTP sharded checkpoint (format {state.get('format')!r}, expected {FORMAT!r})")
    if (state["world_size"], state["rank"]) != (ring.size, ring.rank):
        raise ValueError(f"checkpoint holds shard {state['rank']} of {state['world_size']}, but this is rank "
                         f"{ring.rank} of {ring.size}; load a full state_dict to change the world size")
    mine = _shard_descriptions(module, splits, ring.rank)
    for key in sorted(mine.keys() | state["shards"].keys()):
        if mine.get(key) != state["shards"].get(key):
            raise ValueError(f"{key}: checkpoint shard {state['shards'].get(key)} does not match this model's "
                             f"{mine.get(key)}")
    module.load_state_dict(state["model"])
    if optimizer is not None:
        if state["optimizer"] is None:
            raise ValueError("the checkpoint was saved without optimizer state")
        optimizer.load_state_dict(state["optimizer"])


def shard_path(directory: str | os.PathLike, rank: int, world_size: int) -> Path:
    return Path(directory) / f"rank{rank:05d}-of-{world_size:05d}.pt"


def save_sharded(module: nn.Module, splits: Splits, ring: Ring, directory: str | os.PathLike,
                 optimizer: Optimizer | None = None) -> Path:
    """Each rank writes its own file under `directory`; returns once every rank has written."""
    path = shard_path(directory, ring.rank, ring.size)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(sharded_state_dict(module, splits, ring, optimizer), path)
    ring.barrier()
    return path


def load_sharded(module: nn.Module, splits: Splits, ring: Ring, directory: str | os.PathLike,
                 optimizer: Optimizer | None = None) -> None:
    path = shard_path(directory, ring.rank, ring.size)
    if not path.exists():
        found = sorted(p.name for p in Path(directory).glob("rank*-of-*.pt")) if Path(directory).is_dir() else []
        raise FileNotFoundError(f"{path} not found (files there: {found}); a checkpoint from another world size "
                                "must be loaded as a full state_dict")
    device = next(module.parameters()).device
    load_sharded_state_dict(module, splits, ring, torch.load(path, map_location=device, weights_only=True), optimizer)
