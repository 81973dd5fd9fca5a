"""Batches to an accelerator: pinned host memory, non-blocking copies on a side stream.

The Loader collates batch n+1 in its network thread while the trainer computes on batch n.
`DeviceCopier.send` runs there too: it pins the batch's tensors and issues their host-to-
device copies on a CUDA stream of its own, then records an event on that stream. Nothing
waits: the copy runs on the GPU's copy engine while the trainer's kernels run on theirs.
`DeviceCopier.receive` runs on the trainer's thread as the batch is handed out: the
trainer's current stream waits for the event (on the GPU, not the CPU), and each tensor is
`record_stream`-ed on it, so the caching allocator does not hand the memory the side stream
allocated to another tensor while the trainer's kernels still read it. This is the
ordering DataLoader + `pin_memory` + `.to(non_blocking=True)` leaves to the user, and what
NVIDIA's data prefetchers do.

Only the stream operations touch CUDA, behind `Streams`, so the ordering is tested on a
machine without a GPU (tests/test_device_copy.py) and measured on one
(`python -m croupier.bench.gpu_pipeline`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ContextManager, Protocol

if TYPE_CHECKING:
    import torch


class NoCudaError(RuntimeError):
    """device="cuda" was asked for where this torch has no CUDA or sees no GPU."""


class Streams(Protocol):
    """The CUDA stream operations a copy needs (one implementation per backend)."""

    def copying(self) -> ContextManager[Any]:
        """Makes the side stream current for the copies issued inside."""

    def copy(self, tensor: "torch.Tensor") -> "torch.Tensor":
        """`tensor` pinned (if it is not) and its non-blocking copy to the device issued."""

    def record(self) -> Any:
        """An event recorded on the side stream after the copies issued so far."""

    def wait(self, event: Any) -> Any:
        """The consumer's current stream waits for `event` (on the device); returns that stream."""

    def keep_for(self, tensor: "torch.Tensor", stream: Any) -> None:
        """`tensor`'s memory is not reused before `stream`'s work queued so far is done."""


class CudaStreams:
    """`Streams` on a CUDA device: one side stream per Loader."""

    def __init__(self, device: "torch.device"):
        import torch

        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copying(self) -> ContextManager[Any]:
        import torch

        return torch.cuda.stream(self.stream)

    def copy(self, tensor: "torch.Tensor") -> "torch.Tensor":
        # From pageable memory a "non-blocking" copy is a synchronous one: pin first.
        pinned = tensor if tensor.is_pinned() else tensor.pin_memory()
        return pinned.to(self.device, non_blocking=True)

    def record(self) -> Any:
        return self.stream.record_event()

    def wait(self, event: Any) -> Any:
        import torch

        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        return current

    def keep_for(self, tensor: "torch.Tensor", stream: Any) -> None:
        tensor.record_stream(stream)


@dataclass
class InFlight:
    """A batch whose copies were issued but may not have landed: `receive` makes it usable."""

    data: Any
    event: Any = None


def resolve_device(device: "str | torch.device | None") -> "torch.device | None":
    """`device` as a torch.device; a CUDA device where CUDA cannot run is refused here, at
    construction, with what is missing, instead of at the first batch's copy."""
    import torch

    if device is None:
        return None
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.backends.cuda.is_built():
            raise NoCudaError(f"device={str(device)!r}: this torch ({torch.__version__}) is a CPU build, without "
                              "CUDA; install a CUDA build of torch, or leave device unset (batches stay in host memory)")
        if not torch.cuda.is_available():
            raise NoCudaError(f"device={str(device)!r}: torch {torch.__version__} has CUDA but sees no GPU "
                              "(check the driver with nvidia-smi, and CUDA_VISIBLE_DEVICES); leave device unset "
                              "to keep batches in host memory")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise NoCudaError(f"device={str(device)!r}: this process sees {torch.cuda.device_count()} CUDA "
                              f"device(s), numbered from 0")
    return dev


class DeviceCopier:
    """Pins and moves batches (nested dicts, lists and tuples of tensors) for one Loader.

    device None: batches stay in host memory, pinned if `pin_memory` (for the user's own
    non-blocking copy). A CUDA device: pinned, then copied on a side stream (pinning is
    implied: a non-blocking copy from pageable memory is a synchronous one). Any other
    device (say "cpu", "mps"): a plain `.to(device)`.
    """

    def __init__(self, device: "str | torch.device | None", pin_memory: bool,
                 streams: "Callable[[torch.device], Streams]" = CudaStreams):
        import torch

        self.device = resolve_device(device)
        cuda = self.device is not None and self.device.type == "cuda"
        if pin_memory and not cuda and not torch.cuda.is_available():
            # DataLoader's behaviour: pinning needs a CUDA context; say so once and go on.
            warnings.warn("pin_memory=True but no CUDA device is available: batches are not pinned",
                          stacklevel=4)  # the line that made the Loader
            pin_memory = False
        self.pin_memory = pin_memory or cuda
        self._streams: Streams | None = streams(self.device) if cuda else None

    @classmethod
    def on_streams(cls, streams: Streams, device: "str | torch.device") -> "DeviceCopier":
        """A copier that issues its copies through `streams` to `device`, checked by no
        CUDA query (another backend's streams, or a test's recording ones)."""
        import torch

        copier = cls.__new__(cls)
        copier.device, copier.pin_memory, copier._streams = torch.device(device), True, streams
        return copier

    @property
    def active(self) -> bool:
        """Whether batches need any work here at all."""
        return self.device is not None or self.pin_memory

    def send(self, data: Any) -> InFlight:
        """Pin and issue the copies of `data` (the producer's thread); returns at once."""
        if self._streams is None:
            return InFlight(_map(data, self._to_host_or_device))
        with self._streams.copying():
            moved = _map(data, self._streams.copy)
            event = self._streams.record()
        return InFlight(moved, event)

    def receive(self, batch: InFlight) -> Any:
        """The batch's data, safe to use on the consumer's current stream (its thread)."""
        if batch.event is None or self._streams is None:
            return batch.data
        stream = self._streams.wait(batch.event)
        for t in _tensors(batch.data):
            self._streams.keep_for(t, stream)
        return batch.data

    def _to_host_or_device(self, t: "torch.Tensor") -> "torch.Tensor":
        if self.pin_memory and not t.is_pinned():
            t = t.pin_memory()
        return t.to(self.device) if self.device is not None else t


def _tensors(obj: Any) -> "list[torch.Tensor]":
    """Every tensor of a batch, found by `_map`'s own walk (so the two never disagree)."""
    found: list[Any] = []
    _map(obj, lambda t: found.append(t) or t)
    return found


def _map(obj: Any, fn: Callable[["torch.Tensor"], "torch.Tensor"]) -> Any:
    """`fn` applied to every tensor of a batch; other leaves (strings, ints) kept."""
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], (torch.Tensor, dict, list, tuple)):
        return type(obj)(_map(v, fn) for v in obj)
    return obj
