"""Checkpoints of a rotated model: per-rank shards, or the whole model as one state_dict.

Sharded checkpoints are each rank's local `state_dict` (same keys as the original
module, local shapes) plus a description of the shard, so loading into a different
world size fails loudly instead of silently mixing shards. The full `state_dict` has
exactly the original module's keys and shapes; that is also the way to reshard.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from .split import Split

if TYPE_CHECKING:
    from .api import RotatedTensorParallel

FORMAT = "croupier.rtp.sharded/1"


def _describe(split: Split | None, rank: int) -> dict[str, Any] | None:
    if split is None:
        return None
    return {"full_shape": list(split.full_shape), "dim": split.dim,
            "ranges": [list(r) for r in split.ranges[rank]]}


def _shard_descriptions(rtp: RotatedTensorParallel) -> dict[str, dict[str, Any] | None]:
    rank = rtp._ring.rank
    return {key: _describe(rtp._splits.get(id(t)), rank) for key, t in rtp.module.state_dict(keep_vars=True).items()}


def full_state_dict(rtp: RotatedTensorParallel) -> dict[str, torch.Tensor]:
    """The unsharded state_dict (collective: every rank of the group must call it)."""
    ring, out, gathered = rtp._ring, {}, {}
    for key, t in rtp.module.state_dict(keep_vars=True).items():
        split = rtp._splits.get(id(t))
        if split is None:
            out[key] = t.detach().clone()
            continue
        if id(t) not in gathered:  # tied weights: gathered once, shared by both keys
            numels = [split.numel(s) for s in range(ring.size)]
            pieces = ring.all_gather_flat(t.detach().reshape(-1), numels)
            gathered[id(t)] = split.assemble([p.view(split.shape(s)) for s, p in enumerate(pieces)])
        out[key] = gathered[id(t)]
    return out


def load_full_state_dict(rtp: RotatedTensorParallel, state_dict: dict[str, torch.Tensor],
                         strict: bool = True) -> None:
    """Load an unsharded state_dict: each rank copies its own shard out of it (no communication)."""
    own = rtp.module.state_dict(keep_vars=True)
    missing, unexpected = sorted(own.keys() - state_dict.keys()), sorted(state_dict.keys() - own.keys())
    if strict and (missing or unexpected):
        raise KeyError(f"state_dict does not match the model: missing keys {missing}, unexpected keys {unexpected}")
    rank = rtp._ring.rank
    with torch.no_grad():
        for key, t in own.items():
            if key not in state_dict:
                continue
            src = state_dict[key].to(t.device)
            split = rtp._splits.get(id(t))
            if split is not None:
                if tuple(src.shape) != split.full_shape:
                    raise ValueError(f"{key}: expected full shape {split.full_shape}, got {tuple(src.shape)}")
                src = split.take(src, rank)
            if src.shape != t.shape:
                raise ValueError(f"{key}: expected shape {tuple(t.shape)}, got {tuple(src.shape)}")
            t.copy_(src)


def sharded_state_dict(rtp: RotatedTensorParallel, optimizer: Optimizer | None = None) -> dict[str, Any]:
    """This rank's shards (and optimizer state), with what is needed to check them on load."""
    ring = rtp._ring
    return {
        "format": FORMAT,
        "rank": ring.rank,
        "world_size": ring.size,
        "shards": _shard_descriptions(rtp),
        "model": rtp.module.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
    }


def load_sharded_state_dict(rtp: RotatedTensorParallel, state: dict[str, Any],
                            optimizer: Optimizer | None = None) -> None:
    ring = rtp._ring
    if state.get("format") != FORMAT:
        raise ValueError(f"not an RTP sharded checkpoint (format {state.get('format')!r}, expected {FORMAT!r})")
    if (state["world_size"], state["rank"]) != (ring.size, ring.rank):
        raise ValueError(f"checkpoint holds shard {state['rank']} of {state['world_size']}, but this is rank "
                         f"{ring.rank} of {ring.size}; load a full state_dict to change the world size")
    mine = _shard_descriptions(rtp)
    for key in sorted(mine.keys() | state["shards"].keys()):
        if mine.get(key) != state["shards"].get(key):
            raise ValueError(f"{key}: checkpoint shard {state['shards'].get(key)} does not match this model's "
                             f"{mine.get(key)}")
    rtp.module.load_state_dict(state["model"])
    if optimizer is not None:
        if state["optimizer"] is None:
            raise ValueError("the checkpoint was saved without optimizer state")
        optimizer.load_state_dict(state["optimizer"])


def shard_path(directory: str | os.PathLike, rank: int, world_size: int) -> Path:
    return Path(directory) / f"rank{rank:05d}-of-{world_size:05d}.pt"


def save_sharded(rtp: RotatedTensorParallel, directory: str | os.PathLike,
                 optimizer: Optimizer | None = None) -> Path:
    """Each rank writes its own file under `directory`; returns once every rank has written."""
    ring = rtp._ring
    path = shard_path(directory, ring.rank, ring.size)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(sharded_state_dict(rtp, optimizer), path)
    ring.barrier()
    return path


def load_sharded(rtp: RotatedTensorParallel, directory: str | os.PathLike,
                 optimizer: Optimizer | None = None) -> None:
    ring = rtp._ring
    path = shard_path(directory, ring.rank, ring.size)
    if not path.exists():
        found = sorted(p.name for p in Path(directory).glob("rank*-of-*.pt")) if Path(directory).is_dir() else []
        raise FileNotFoundError(f"{path} not found (files there: {found}); a checkpoint from another world size "
                                "must be loaded as a full state_dict")
    device = next(rtp.module.parameters()).device
    load_sharded_state_dict(rtp, torch.load(path, map_location=device, weights_only=True), optimizer)
