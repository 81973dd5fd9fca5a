"""Batches to a device: the ordering of pinned, non-blocking side-stream copies (client/device_copy.py).

CUDA does not run on this machine, so the stream operations are recorded by `RecordingStreams`
(the one seam, `Streams`); everything else is the real Loader against a real server on
loopback. The same path runs on a GPU in `python -m croupier.bench.gpu_pipeline`.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import pytest
import torch

from croupier.client import Loader, NoCudaError
from croupier.client.device_copy import DeviceCopier, InFlight


class RecordingStreams:
    """`Streams` that log each operation with its thread; a copy is a clone, tagged by id."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int, str]] = []  # (operation, batch tag, thread name)
        self.inside = False
        self.events = 0
        self.lock = threading.Lock()

    def _note(self, op: str, tag: int) -> None:
        with self.lock:
            self.log.append((op, tag, threading.current_thread().name))

    @contextlib.contextmanager
    def copying(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        assert self.inside, "a copy was issued outside the side stream"
        out = tensor.clone()
        self._note("copy", int(tensor.flatten()[0]))
        return out

    def record(self):
        assert self.inside, "the event was recorded outside the side stream"
        self.events += 1
        self._note("record", self.events)
        return self.events

    def wait(self, event):
        self._note("wait", event)
        return f"consumer-stream-{threading.current_thread().name}"

    def keep_for(self, tensor: torch.Tensor, stream) -> None:
        assert stream == f"consumer-stream-{threading.current_thread().name}"
        self._note("keep", int(tensor.flatten()[0]))


def test_device_cuda_without_cuda_is_refused_at_construction_with_what_is_missing() -> None:
    with pytest.raises(NoCudaError, match=r"device='cuda'.*CPU build, without CUDA.*leave device unset"):
        Loader("rows", batch_size=4, device="cuda")
    with pytest.raises(NoCudaError, match=r"device='cuda:1'"):
        Loader("rows", batch_size=4, device=torch.device("cuda", 1))


def test_pin_memory_without_cuda_warns_at_the_users_line_and_keeps_host_batches(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=["rows=synthetic:40"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = Loader("rows", servers=srv.address, batch_size=8, pin_memory=True)
    assert [str(w.message) for w in caught] == ["pin_memory=True but no CUDA device is available: batches are not pinned"]
    assert caught[0].filename == __file__
    assert loader.pin_memory is False
    batches = list(loader)
    assert sorted(i for b in batches for i in b["index"].tolist()) == list(range(40))
    loader.close()


def test_copies_are_issued_on_the_side_stream_and_awaited_on_the_consumers_thread(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=["rows=synthetic:64"])
    loader = Loader("rows", servers=srv.address, batch_size=8, seed=5, buffer_batches=3)
    streams = RecordingStreams()
    loader._copier = DeviceCopier.on_streams(streams, "cpu")
    consumer = threading.current_thread().name
    seen = []
    for batch in loader.batches():
        assert not isinstance(batch.data, InFlight)
        first = int(batch.data["index"][0])
        # The consumer's stream waited for this batch's event, and kept every tensor of it
        # (index, and value = index / 2; the payload column is a list of bytes), before the
        # user got it.
        mine = [(op, tag) for op, tag, thread in streams.log if thread == consumer]
        assert mine[-3:] == [("wait", len(seen) + 1), ("keep", first), ("keep", int(first * 0.5))], mine[-3:]
        seen.append(batch.indices.tolist())
    copies = [(op, tag, thread) for op, tag, thread in streams.log if op in ("copy", "record")]
    # Two tensors per batch, then the event, all on the Loader's network thread.
    assert len(copies) == 3 * len(seen) == 24
    assert {thread for _, _, thread in copies} == {"croupier-loader"}
    assert [op for op, _, _ in copies] == ["copy", "copy", "record"] * 8
    assert sorted(i for b in seen for i in b) == list(range(64))
    loader.close()


def test_the_next_batchs_copy_is_issued_while_the_user_still_holds_this_one(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=["rows=synthetic:64"])
    loader = Loader("rows", servers=srv.address, batch_size=8, buffer_batches=2)
    streams = RecordingStreams()
    loader._copier = DeviceCopier.on_streams(streams, "cpu")

    def recorded() -> int:
        with streams.lock:
            return sum(op == "record" for op, _, _ in streams.log)

    it = loader.batches()
    next(it)
    # The user is "computing" on batch 0; the network thread goes on to copy batch 1 (and 2).
    ahead = threading.Event()

    def watch() -> None:
        while recorded() < 2:
            threading.Event().wait(0.01)
        ahead.set()

    threading.Thread(target=watch, daemon=True).start()
    assert ahead.wait(30), f"only {recorded()} batch copies issued while the user held batch 0"
    rest = list(it)
    assert len(rest) == 7
    loader.close()


def test_a_plain_device_moves_every_tensor_and_keeps_other_leaves() -> None:
    copier = DeviceCopier("cpu", pin_memory=False)
    data = {"x": torch.arange(4), "nested": [torch.ones(2), torch.zeros(1)], "text": ["a", "b"]}
    out = copier.receive(copier.send(data))
    assert out["text"] == ["a", "b"]
    assert torch.equal(out["x"], data["x"]) and torch.equal(out["nested"][0], torch.ones(2))
    assert DeviceCopier(None, pin_memory=False).active is False
