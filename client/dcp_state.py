"""Every rank's Loader state as one `Stateful` for `torch.distributed.checkpoint` (DCP).

A Loader is itself a `Stateful` (it has `state_dict`/`load_state_dict`), but DCP writes
a key that several ranks hold only once, from one of them, and may take each key from a
different rank: `{"dataloader": loader}` keeps one rank's value of `step`, `next_batch`,
`batches_ahead`... That is exact only while every rank stands at the same batch
(`in_order=True`). `LoaderStates(loader)` gathers all ranks' states into one value that is
the same on every rank, so nothing is lost by that de-duplication, and the keys do not
depend on the world size, so a checkpoint saved at W ranks loads at W'. On load every rank
gets all old ranks' states: at the same shape each resumes exactly where it stood, at
another the rest of the epoch is cut anew (client/resume.py), `in_order=False` included.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from croupier.client.loader import Loader


class LoaderStates:
    """`{"dataloader": LoaderStates(loader)}` in the dict given to `dcp.save`/`dcp.load`.

    `state_dict()` is collective (an all-gather over `group`, default the whole world),
    as `dcp.save` and `dcp.load` are: every rank of the group calls it, in the same order.
    Ranks that share a Loader rank (tensor- or pipeline-parallel replicas of one data-parallel
    rank, whose `group` is the world) must hold equal states; one of each is kept."""

    def __init__(self, loader: "Loader", group: "ProcessGroup | None" = None) -> None:
        self.loader = loader
        self.group = group

    def state_dict(self) -> dict[str, Any]:
        states = _by_rank(self._gather(self.loader.state_dict()), self.loader.world_size)
        # One string: DCP would flatten a list of dicts into keys that depend on the world size.
        return {"world_size": len(states), "states": json.dumps(states, sort_keys=True)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            states = json.loads(state["states"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a LoaderStates checkpoint entry (keys {sorted(state)}): {e}") from None
        self.loader.load_state_dict(states)

    def _gather(self, own: dict[str, Any]) -> list[dict[str, Any]]:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(self.group) == 1:
            return [own]
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, own, group=self.group)
        return out


def _by_rank(states: list[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """One state per Loader rank, in rank order; replicas of a rank must agree."""
    kept: dict[int, dict[str, Any]] = {}
    for s in states:
        r = int(s["rank"])
        if r in kept and kept[r] != s:
            raise ValueError(f"two processes hold Loader rank {r} at different states ({kept[r]} and {s}): give "
                             "LoaderStates the process group of the data-parallel ranks (one process per Loader rank)")
        kept[r] = s
    if sorted(kept) != list(range(world_size)):
        raise ValueError(f"the group's Loaders are ranks {sorted(kept)} of a world of {world_size}: LoaderStates "
                         "needs every Loader rank in its group (pass group= the data-parallel ranks)")
    return [kept[r] for r in range(world_size)]
