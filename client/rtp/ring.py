"""Every byte RTP moves between ranks: ring shifts, plus the few collectives around them.

Peers are addressed by group rank and translated with `dist.get_global_rank`, so a
ring built on a sub-group talks only to that sub-group's members.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

# Weights and gradient accumulators travel the same ring at overlapping times; distinct
# tags keep a gloo receive from matching the other kind of message.
TAG_WEIGHTS = 17
TAG_GRADS = 18

FORWARD = 1  # send to the next rank, receive from the previous one
BACKWARD = -1  # the reverse: shards rotate back


class Transfer:
    """Outstanding sends and receives of one ring shift."""

    def __init__(self, works: list[dist.Work]):
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []


class Ring:
    """The ranks of one process group arranged in a ring."""

    def __init__(self, group: ProcessGroup | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("RotatedTensorParallel needs torch.distributed initialised "
                               "(dist.init_process_group, or launch with torchrun)")
        self.group: ProcessGroup = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError(f"global rank {dist.get_rank()} is not a member of the given process group")
        self.size = dist.get_world_size(self.group)
        self.backend = str(dist.get_backend(self.group))
        self._next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self._prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        self._root = dist.get_global_rank(self.group, 0)

    def shift(self, send: torch.Tensor | None, recv: torch.Tensor | None, direction: int,
              tag: int) -> Transfer:
        """Start sending `send` one step along `direction` and receiving into `recv`.

        Sender and receiver always agree on a shard's size, so empty shards are simply
        skipped on both sides. One batch lets NCCL pair the two calls without deadlock.
        """
        to, frm = (self._next, self._prev) if direction == FORWARD else (self._prev, self._next)
        ops = []
        if send is not None and send.numel() > 0:
            ops.append(dist.P2POp(dist.isend, send, to, self.group, tag))
        if recv is not None and recv.numel() > 0:
            ops.append(dist.P2POp(dist.irecv, recv, frm, self.group, tag))
        return Transfer(dist.batch_isend_irecv(ops) if ops else [])

    def broadcast_(self, tensor: torch.Tensor) -> None:
        """Overwrite `tensor` with group rank 0's copy."""
        dist.broadcast(tensor, src=self._root, group=self.group)

    def all_reduce_mean_(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        tensor.div_(self.size)

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def all_gather_flat(self, local: torch.Tensor, numels: list[int]) -> list[torch.Tensor]:
        """Every rank's 1-D `local` (sizes `numels`, uneven allowed), in group-rank order."""
        width = max(max(numels), 1)
        padded = local.new_zeros(width)
        padded[: local.numel()].copy_(local)
        out = [local.new_empty(width) for _ in range(self.size)]
        dist.all_gather(out, padded, group=self.group)
        return [o[:n] for o, n in zip(out, numels)]

    def barrier(self) -> None:
        dist.barrier(group=self.group)


class RingBuffers:
    """The shard memory in flight: two weight and two gradient-accumulator buffers.

    Every layer reuses the same four flat buffers (sized for the largest shard), so
    weights in flight never exceed two shards plus two accumulators, whatever the depth.
    Layers run one at a time on a rank, which is what makes sharing them safe.
    """

    ROLES = ("weights0", "weights1", "grads0", "grads1")

    def __init__(self) -> None:
        self._sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def reserve(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        key = (dtype, torch.device(device))
        self._sizes[key] = max(self._sizes.get(key, 0), numel)

    def get(self, role: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        device = torch.device(device)
        key = (role, dtype, device)
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty(self._sizes.get((dtype, device), 0), dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf

    def nbytes(self) -> int:
        """Bytes of the buffers allocated so far (gradient buffers appear at the first backward)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def capacity_bytes(self) -> int:
        """Bytes all four buffers take once allocated."""
        return sum(len(self.ROLES) * n * torch.empty(0, dtype=dt).element_size()
                   for (dt, _), n in self._sizes.items())
