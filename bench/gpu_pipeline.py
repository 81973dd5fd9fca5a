"""How much of the host-to-device copy the Loader hides, and how long the GPU waits for data.

    python -m croupier.bench.gpu_pipeline --out bench/results/gpu_pipeline.md

Needs a CUDA GPU. A real `croupier serve` process on loopback serves a generated Arrow
file of fixed-size uint8 rows (an image-sized `x` and an int64 `y`); one trainer process
iterates it with `Loader` and runs a fixed GPU step on each batch. Side by side, in one run:

- `croupier device="cuda"`: the Loader pins each batch and issues its copy on a side
  stream from its network thread; the trainer's stream waits on the copy's event
  (client/device_copy.py).
- `user .to(cuda, non_blocking) from pin_memory`: the DataLoader idiom, the Loader pinning,
  the copy issued by the training loop on the trainer's stream.
- `user .to(cuda), pageable`: the plain loop, a synchronous copy from unpinned memory.
- `resident`: the same steps on a batch already on the GPU: the floor.

The step is calibrated once to take about `--compute-ratio` times the interval at which
the Loader alone delivers batches to the GPU, so a perfect pipeline keeps the GPU busy.
Measured with CUDA events, per mode: *copy* is the GPU time of the copies; *exposed* is
the time the trainer's stream stood waiting for a copy (for the side stream: events just
before and after the wait on the copy's event; on the trainer's own stream every copy is
exposed); *hidden* is 1 - exposed/copy; *GPU idle* is 1 - (time in the steps' kernels)/(wall).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .driver import drive
from .reporting import header_lines

SETTINGS = ("rows", "row_bytes", "batch", "dim", "compute_ratio", "repeats")
MODES = ("croupier_side_stream", "user_pinned_non_blocking", "user_pageable", "resident")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_data(path: Path, rows: int, row_bytes: int) -> None:
    import pyarrow as pa
    import pyarrow.ipc as ipc

    rng = np.random.default_rng(0)
    schema = pa.schema([("x", pa.list_(pa.uint8(), row_bytes)), ("y", pa.int64())])
    with ipc.new_file(str(path), schema) as w:
        for start in range(0, rows, 1024):
            n = min(1024, rows - start)
            x = rng.integers(0, 255, (n, row_bytes), dtype=np.uint8)
            w.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), row_bytes),
                                    "y": pa.array(np.arange(start, start + n))}, schema=schema))


@contextlib.contextmanager
def serve(path: Path, work: Path):
    port, ready = _free_port(), work / "ready"
    log = open(work / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "croupier.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--ready-file", str(ready), f"pix={path}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {(work / 'server.log').read_text()[-2000:]}")
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


class TimedStreams:
    """The Loader's CUDA streams with events around each copy and each wait (the real path, timed)."""

    def __init__(self, device):
        from croupier.client.device_copy import CudaStreams

        self.inner = CudaStreams(device)
        self.copies: list[tuple[Any, Any]] = []
        self.waits: list[tuple[Any, Any]] = []

    def copying(self):
        return self.inner.copying()

    def copy(self, tensor):
        import torch

        # Pinned first, so the events time the transfer alone, not the host-side pinning.
        pinned = tensor if tensor.is_pinned() else tensor.pin_memory()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self.inner.stream)
        out = self.inner.copy(pinned)
        end.record(self.inner.stream)
        self.copies.append((start, end))
        return out

    def record(self):
        return self.inner.record()

    def wait(self, event):
        import torch

        current = torch.cuda.current_stream(self.inner.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(current)
        current.wait_event(event)
        after.record(current)
        self.waits.append((before, after))
        return current

    def keep_for(self, tensor, stream) -> None:
        self.inner.keep_for(tensor, stream)


class Step:
    """A fixed GPU step: the batch projected (x (B, D) uint8 -> bf16 @ (D, dim)), then
    `repeats` dim x dim bf16 matmuls, few and large so the step is GPU time, not launches."""

    def __init__(self, row_bytes: int, dim: int, device):
        import torch

        g = torch.Generator(device=device).manual_seed(0)
        self.proj = torch.randn(row_bytes, dim, device=device, dtype=torch.bfloat16, generator=g) / row_bytes
        self.w = torch.randn(dim, dim, device=device, dtype=torch.bfloat16, generator=g) / dim**0.5
        self.repeats = 1
        self.sink = torch.zeros((), device=device, dtype=torch.float32)

    def __call__(self, x) -> None:
        h = x.to(dtype=self.proj.dtype) @ self.proj
        z = self.w
        for _ in range(self.repeats):
            z = z @ self.w
        self.sink += h.float().mean() + z[0, 0].float()


def _loader(address: str, batch: int, mode: str, device, streams: TimedStreams | None):
    from croupier.client import Loader
    from croupier.client.device_copy import DeviceCopier

    if mode == "croupier_side_stream":
        loader = Loader("pix", servers=address, batch_size=batch, seed=1)
        loader._copier = DeviceCopier.on_streams(streams, device)  # the real path, with timing events
        return loader
    return Loader("pix", servers=address, batch_size=batch, seed=1, pin_memory=(mode == "user_pinned_non_blocking"))


def run_mode(mode: str, address: str, args: argparse.Namespace, step: Step, device) -> dict[str, Any]:
    """One epoch in `mode` (after one warm-up epoch); CUDA events give GPU-side times."""
    import torch

    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    resident = torch.randint(0, 255, (args.batch, args.row_bytes), dtype=torch.uint8, device=device)
    streams = TimedStreams(device) if mode == "croupier_side_stream" else None
    loader = None if mode == "resident" else _loader(address, args.batch, mode, device, streams)
    n_batches = -(-args.rows // args.batch)
    for epoch in range(2):  # the first warms the server, the page cache and the allocators
        steps, copies = [], []
        if streams is not None:
            streams.copies.clear()
            streams.waits.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        source = iter(loader) if loader is not None else (None for _ in range(n_batches))
        for data in source:
            if mode == "resident":
                x = resident
            elif mode == "croupier_side_stream":
                x = data["x"]
            else:
                c0, c1 = ev(), ev()
                c0.record()
                x = data["x"].to(device, non_blocking=(mode == "user_pinned_non_blocking"))
                c1.record()
                copies.append((c0, c1))
            s0, s1 = ev(), ev()
            s0.record()
            step(x)
            s1.record()
            steps.append((s0, s1))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    if loader is not None:
        loader.close()
    ms = lambda pairs: [a.elapsed_time(b) for a, b in pairs if a is not None]  # noqa: E731
    step_ms = ms(steps)
    if streams is not None:
        copy_ms, exposed_ms = ms(streams.copies), ms(streams.waits)
    else:
        copy_ms = ms(copies)
        exposed_ms = copy_ms  # a copy on the trainer's own stream: the step waits for all of it
    busy = sum(step_ms) / 1000
    return {"mode": mode, "batches": len(step_ms), "wall_s": wall, "samples_per_s": len(step_ms) * args.batch / wall,
            "step_ms_median": statistics.median(step_ms), "copy_ms_total": sum(copy_ms),
            "copy_ms_median": statistics.median(copy_ms) if copy_ms else 0.0, "exposed_ms_total": sum(exposed_ms),
            "hidden": (1 - sum(exposed_ms) / sum(copy_ms)) if copy_ms and sum(copy_ms) > 0 else None,
            "gpu_idle": max(0.0, 1 - busy / wall)}


def calibrate(address: str, args: argparse.Namespace, step: Step, device) -> dict[str, float]:
    """The Loader's own delivery interval to the GPU, and step repeats to take ratio x that."""
    import torch

    from croupier.client import Loader

    loader = Loader("pix", servers=address, batch_size=args.batch, seed=0, device=device)
    for _ in range(2):
        t0 = time.perf_counter()
        n = 0
        for data in loader:
            data["x"].sum()
            n += 1
        torch.cuda.synchronize()
        interval = (time.perf_counter() - t0) / n
    loader.close()
    x = torch.randint(0, 255, (args.batch, args.row_bytes), dtype=torch.uint8, device=device)

    def step_s(repeats: int) -> float:
        step.repeats = repeats
        for _ in range(3):
            step(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            step(x)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 10

    per_repeat = max(1e-6, (step_s(41) - step_s(1)) / 40)
    step.repeats = max(1, round((args.compute_ratio * interval - step_s(1)) / per_repeat))
    return {"loader_interval_ms": interval * 1000, "loader_samples_per_s": args.batch / interval,
            "step_repeats": step.repeats, "step_ms": step_s(step.repeats) * 1000}


def measure(args: argparse.Namespace, rep: dict[str, Any]) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_pipeline: no CUDA device here (torch.cuda.is_available() is False)")
    device = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(device)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        make_data(work / "pix.arrow", args.rows, args.row_bytes)
        with serve(work / "pix.arrow", work) as address:
            step = Step(args.row_bytes, args.dim, device)
            cal = calibrate(address, args, step, device)
            # Modes interleaved, repeat after repeat, so a slow moment of the machine falls on all of them.
            rows = [run_mode(m, address, args, step, device) | {"repeat": r} for r in range(args.repeats) for m in MODES]
    rep.update(gpu=props.name, settings={k: getattr(args, k) for k in SETTINGS}, calibration=cal, rows=rows)


def report(rep: dict[str, Any], plots: Sequence[str] = ()) -> str:
    s, cal = rep["settings"], rep["calibration"]
    batch_mb = s["batch"] * s["row_bytes"] / 1e6
    lines = ["# The Loader's copies to the GPU: hidden copy time and GPU idle", "", *header_lines(rep),
             f"GPU: {rep['gpu']}. Data: {s['rows']} rows of {s['row_bytes']} "
             f"uint8 bytes (`x`) + an int64 `y`, one Arrow file served by `croupier serve` on loopback; batch "
             f"{s['batch']} ({batch_mb:.1f} MB); one trainer process; each measured epoch follows a warm-up epoch of its own Loader.",
             f"The Loader alone delivered a batch to the GPU every {cal['loader_interval_ms']:.2f} ms "
             f"({cal['loader_samples_per_s']:,.0f} samples/s); the step (a bf16 projection and "
             f"{cal['step_repeats']} {s['dim']}x{s['dim']} matmuls) was calibrated to {cal['step_ms']:.2f} ms, "
             f"{s['compute_ratio']}x that interval.", "",
             f"Each figure is the median over {s.get('repeats', 1)} measured epochs per mode (samples/s: with the "
             "lowest and highest); copy and exposed times are per epoch.", "",
             "| mode | samples/s (min-max) | step ms | copy ms | exposed ms | copy hidden | GPU idle (min-max) |",
             "|---|---|---|---|---|---|---|"]
    for mode in dict.fromkeys(r["mode"] for r in rep["rows"]):
        rs = [r for r in rep["rows"] if r["mode"] == mode]
        med = lambda key: statistics.median(r[key] for r in rs)  # noqa: E731
        rate, idle = [r["samples_per_s"] for r in rs], [100 * r["gpu_idle"] for r in rs]
        hiddens = [r["hidden"] for r in rs if r["hidden"] is not None]
        hidden = f"{100 * statistics.median(hiddens):.1f}%" if hiddens else ""
        lines.append(f"| {mode} | {med('samples_per_s'):,.0f} ({min(rate):,.0f}-{max(rate):,.0f}) | "
                     f"{med('step_ms_median'):.2f} | {med('copy_ms_total'):.1f} | {med('exposed_ms_total'):.1f} | "
                     f"{hidden} | {statistics.median(idle):.1f}% ({min(idle):.1f}-{max(idle):.1f}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m croupier.bench.gpu_pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--row-bytes", type=int, default=3 * 96 * 96)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--dim", type=int, default=8192)
    p.add_argument("--compute-ratio", type=float, default=1.5)
    p.add_argument("--repeats", type=int, default=3, help="epochs measured per mode (modes interleaved); medians reported")
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu_pipeline.md"))
    p.add_argument("--render", type=Path, help="rewrite --out from a JSON this script saved, without measuring")
    args = p.parse_args(argv)
    if args.render:
        args.out.write_text(report(json.loads(args.render.read_text())))
    else:
        command = " ".join(["python -m croupier.bench.gpu_pipeline", *(sys.argv[1:] if argv is None else argv)])
        drive(args.out.stem, args.out.parent, command, lambda rep: measure(args, rep), report)
    print(args.out.read_text())


if __name__ == "__main__":
    main()
