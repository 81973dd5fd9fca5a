"""Every byte RTP moves between ranks: ring shifts, plus the few collectives around them.

Peers are addressed by group rank and translated with `dist.get_global_rank`, so a
ring built on a sub-group talks only to that sub-group's members.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

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
        # The default group is kept as None (torch.distributed's own spelling of it), never
        # as an object: a model that held the world group would keep it alive past
        # destroy_process_group, and gloo's worker threads would then be torn down during
        # interpreter exit, which aborts the process ("terminate called without an active
        # exception") when one is still releasing a tensor.
        self._group: ProcessGroup | None = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError(f"global rank {dist.get_rank()} is not a member of the given process group")
        self.size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self._next = self._global_rank((self.rank + 1) % self.size)
        self._prev = self._global_rank((self.rank - 1) % self.size)
        self._root = self._global_rank(0)

    @property
    def group(self) -> ProcessGroup:
        return self._group if self._group is not None else dist.group.WORLD

    def _global_rank(self, group_rank: int) -> int:
        return group_rank if self._group is None else dist.get_global_rank(self._group, group_rank)

    def shift(self, send: torch.Tensor | None, recv: torch.Tensor | None, direction: int,
              tag: int) -> Transfer:
        """Start sending `send` one step along `direction` and receiving into `recv`.

        Sender and receiver always agree on a shard's size (the send of shard s from rank r
        and its receive on r's neighbour are sized by the same Split), so an empty message is
        skipped on both sides, and a rank with nothing to send or receive at a step makes no
        call. That is why `join` must run first: torch requires every rank of a group to take
        part in the group's first call when it is a batch_isend_irecv (NCCL creates the
        group's communicator there), and a rank whose shards of the first layer are empty
        would skip it. One batch lets NCCL pair the two calls without deadlock.
        """
        to, frm = (self._next, self._prev) if direction == FORWARD else (self._prev, self._next)
        ops = []
        if send is not None and send.numel() > 0:
            ops.append(dist.P2POp(dist.isend, send, to, self._group, tag))
        if recv is not None and recv.numel() > 0:
            ops.append(dist.P2POp(dist.irecv, recv, frm, self._group, tag))
        return Transfer(dist.batch_isend_irecv(ops) if ops else [])

    def join(self, device: torch.device, layer_sizes: list[int]) -> None:
        """A collective of every rank at wrap time, before any ring shift: the group's first call.

        Ring shifts may leave ranks out (see `shift`), and torch allows that only after a
        first call in which the whole group took part; with NCCL that call creates the
        group's communicator on `device` (the current device) for every rank at once.
        It doubles as a check that every rank planned the same rotating layers: a mismatch
        would otherwise deadlock or mix up shards at the first forward.
        """
        if self.size == 1:
            return
        mine = torch.tensor([len(layer_sizes), sum(layer_sizes), hash(tuple(layer_sizes)) % 2**62],
                            dtype=torch.int64, device=device)
        # One all-reduce finds both extremes: the max of each value and of its negation.
        both = torch.cat([mine, -mine])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self._group)
        n = mine.numel()
        if not torch.equal(both[:n], -both[n:]):
            raise RuntimeError("RotatedTensorParallel: the ranks of the group planned different layers "
                               f"(this rank: {len(layer_sizes)} rotating layers of {sum(layer_sizes)} elements); "
                               "every rank must wrap the same model")

    def broadcast_(self, tensor: torch.Tensor) -> None:
        """Overwrite `tensor` with group rank 0's copy."""
        dist.broadcast(tensor, src=self._root, group=self._group)

    def all_reduce_mean_(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group)
        tensor.div_(self.size)

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group)

    def all_reduce_max_(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group)

    def all_gather_flat(self, local: torch.Tensor, numels: list[int]) -> list[torch.Tensor]:
        """Every rank's 1-D `local` (sizes `numels`, uneven allowed), in group-rank order."""
        width = max(max(numels), 1)
        padded = local.new_zeros(width)
        padded[: local.numel()].copy_(local)
        out = [local.new_empty(width) for _ in range(self.size)]
        dist.all_gather(out, padded, group=self._group)
        return [o[:n] for o, n in zip(out, numels)]

    def barrier(self) -> None:
        dist.barrier(group=self._group)


class RingBuffers:
    """Allocates the flat buffers shards travel in, one layer call at a time, and accounts for them.

    A forward rotation leases two weight buffers, a backward one two weight buffers and
    two gradient accumulators, each sized for that layer's largest shard, and returns
    them when the call ends: between rotations no shard memory is held at all, and the
    high-water mark is set by the largest layer.
    """

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0

    @contextmanager
    def lease(self, count: int, numel: int, dtype: torch.dtype, device: torch.device) -> Iterator[list[torch.Tensor]]:
        bufs = [torch.empty(numel, dtype=dtype, device=device) for _ in range(count)]
        nbytes = count * numel * bufs[0].element_size() if count else 0
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        try:
            yield bufs
        finally:
            self.live_bytes -= nbytes
