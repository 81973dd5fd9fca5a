"""Peak memory per rank and step time of RTP vs DDP vs FSDP2, on CPU with gloo, in one run.

    python -m croupier.bench.rtp_memory --out bench/results/rtp_memory.md
    python -m croupier.bench.rtp_memory --device cuda --ranks 1 --out bench/results/rtp_nccl.md

With `--device cuda` the ranks use NCCL, rank r on cuda:r (`--share-gpu`: all on cuda:0),
and the peak is the GPU memory allocated instead of RSS.

For each world size N and each engine, N fresh processes (one per rank, env:// on a
loopback port, as torchrun would) build the same GPT-2-small-shaped model, wrap it
(DDP / `fully_shard` per block + root / `RotatedTensorParallel`), and train a few
AdamW steps on random tokens. Each rank reports:

- peak RSS during the training steps: the kernel's VmHWM, reset (clear_refs 5) after
  the model is wrapped, so building the full model before sharding does not count.
  glibc is told to return every allocation above 128 KiB to the OS on free
  (MALLOC_MMAP_THRESHOLD_), so RSS follows live tensors rather than the heap's history;
- the RSS of the bare process (torch + gloo, before the model) to subtract;
- model-state bytes: local parameters + gradients + optimizer state (a tensor count);
- median step time over the measured steps (forward, backward, optimizer step).

This is not a timed test: it is a measurement, committed with the command above.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .driver import drive
from .reporting import header_lines

ENGINES = ("ddp", "fsdp2", "rtp")
SETTINGS = ("steps", "warmup", "seq", "micro_batch", "layers", "device", "share_gpu")


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, is_causal=True, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT2(nn.Module):
    """GPT-2 small's shape: 50257 x 768 tied embedding/head, 1024 positions, 12 blocks of 12 heads."""

    def __init__(self, vocab: int = 50257, ctx: int = 1024, dim: int = 768, heads: int = 12, layers: int = 12):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).triu(1)
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _wrap(engine: str, model: nn.Module, world: int, device: torch.device) -> nn.Module:
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from croupier.client.rtp import RotatedTensorParallel
    return RotatedTensorParallel(model)


def worker(args: argparse.Namespace) -> None:
    from croupier.client.rtp import state_bytes

    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    base_kib = _status_kib("VmRSS")
    torch.manual_seed(0)
    model = GPT2(layers=args.layers).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    wrapped = _wrap(args.engine, model, world, device)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    _trim()
    wrapped_kib = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    g = torch.Generator().manual_seed(1000 + rank)
    times, state = [], None
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, 50257, (args.micro_batch, args.seq + 1), generator=g).to(device)
        dist.barrier()
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        logits = wrapped(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        del logits
        loss.backward()
        opt.step()
        if step == args.warmup + args.steps - 1:
            state = state_bytes(model, opt)
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    ring = wrapped.ring_buffer_bound() if args.engine == "rtp" else 0
    # On a GPU the peak is the caching allocator's high-water mark of allocated bytes (no
    # model existed before, so the bare process holds none).
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else _status_kib("VmHWM") / 1024
    mine = {"rank": rank, "base_mib": 0.0 if cuda else base_kib / 1024, "after_wrap_mib": wrapped_kib / 1024,
            "peak_mib": peak, "state_mib": state.model_state / 2**20,
            "ring_mib": ring / 2**20, "step_s": statistics.median(times), "loss": loss.item(),
            "n_params": n_params, "gpu": torch.cuda.get_device_name(device) if cuda else None}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(args.result).write_text(json.dumps(everyone))
    from croupier.client.rtp import destroy_process_group

    destroy_process_group()  # safe to exit after (client/rtp/teardown.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(engine: str, world: int, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    result = tmp / f"{engine}-{world}.json"
    port = str(_free_port())
    procs = []
    for r in range(world):
        local = "0" if args.share_gpu else str(r)
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": local, "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024),
               "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))}
        cmd = [sys.executable, "-m", "croupier.bench.rtp_memory", "--worker", "--engine", engine, "--result", str(result),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--seq", str(args.seq),
               "--micro-batch", str(args.micro_batch), "--layers", str(args.layers),
               "--device", args.device]
        procs.append(subprocess.Popen(cmd, env=env))
    deadline = time.monotonic() + args.timeout
    for p in procs:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{engine} N={world}: exit codes {[p.returncode for p in procs]}")
    return json.loads(result.read_text())


def report(rep: dict[str, Any], plots: Sequence[str] = ()) -> str:
    """The Markdown of a run (`rep`: its header, "settings" and "rows")."""
    rows, args = rep["rows"], argparse.Namespace(**{"device": "cpu", "share_gpu": False, **rep["settings"]})
    if args.device == "cuda":
        return _report_cuda(rep, rows, args)
    cores = rep.get("machine", {}).get("cores", os.cpu_count())
    n_params = rows[0]["ranks"][0]["n_params"]
    whole_mib = n_params * 16 / 2**20  # fp32 parameter + gradient + AdamW's two moments
    lines = [
        "# RTP memory and step time vs DDP and FSDP2 (CPU, gloo)",
        "",
        *header_lines(rep),
        f"Model: GPT-2-small shape ({n_params / 1e6:.1f} M parameters: 50257 x 768 tied embedding/head, "
        f"{args.layers} blocks of nn.MultiheadAttention with 12 heads, 4x MLP), fp32, AdamW; "
        f"{args.micro_batch} x {args.seq} tokens per rank per step; {args.warmup} warm-up + {args.steps} "
        f"measured steps (median). Machine: {cores} CPU cores shared by all ranks "
        "(threads per rank = cores // N), loopback gloo. Whole model state (parameters + gradients + "
        f"AdamW moments) = {whole_mib:.0f} MiB.",
        "",
        "Columns, per rank (the largest over ranks): *peak RSS* is the kernel's high-water mark during the "
        "training steps (reset after wrapping, so building the full model first does not count); "
        "*above bare* subtracts the RSS of the bare process (torch + gloo) before the model existed; "
        "*model state* counts local parameter, gradient and optimizer tensors; *ring buffers* is the most "
        "RTP's leased buffers can hold at once (two weight units and two gradient accumulators of the "
        "largest unit that rotates; layers above the default `chunk_bytes` of 16 MiB, here the 50257 x 768 "
        "embedding/head, rotate in slices), part of the RSS while a layer rotates.",
        "",
        "Other jobs shared these cores (the load average above), so step times carry that noise; memory "
        "figures do not depend on it.",
        "",
        "| N | engine | step time (s) | vs DDP | peak RSS (MiB) | above bare (MiB) | model state (MiB) "
        "| whole state / N (MiB) | ring buffers (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    worlds = list(dict.fromkeys(r["world"] for r in rows))
    for world in worlds:
        ddp = next(r for r in rows if r["engine"] == "ddp" and r["world"] == world)
        ddp_time = max(x["step_s"] for x in ddp["ranks"])
        for row in (r for r in rows if r["world"] == world):
            rk = row["ranks"]
            step = max(x["step_s"] for x in rk)
            lines.append(
                f"| {world} | {row['engine']} | {step:.2f} | {step / ddp_time:.2f}x | "
                f"{max(x['peak_mib'] for x in rk):.0f} | {max(x['peak_mib'] - x['base_mib'] for x in rk):.0f} | "
                f"{max(x['state_mib'] for x in rk):.0f} | {whole_mib / world:.0f} | {max(x['ring_mib'] for x in rk):.0f} |")
    lines += [""]
    for world in worlds:
        by = {r["engine"]: r for r in rows if r["world"] == world}
        if not {"rtp", "fsdp2"} <= by.keys():
            continue
        above = {e: max(x["peak_mib"] - x["base_mib"] for x in r["ranks"]) for e, r in by.items()}
        lines.append(f"- N={world}: RTP's peak above the bare process is {above['rtp']:.0f} MiB, "
                     f"{above['rtp'] / above['fsdp2']:.0%} of FSDP2's and {above['rtp'] / (whole_mib / world):.2f}x "
                     f"the whole model state / N ({whole_mib / world:.0f} MiB); the rest is activations, optimizer "
                     "temporaries and ring buffers.")
    for world in worlds:
        losses = {r["engine"]: [x["loss"] for x in r["ranks"]] for r in rows if r["world"] == world}
        if len(losses) > 1:
            spread = max(abs(a - b) for ls in zip(*losses.values()) for a in ls for b in ls)
            lines.append(f"- N={world}: after the last step every rank's loss agrees across "
                         f"{', '.join(losses)} to {spread:.1e} (same weights, same tokens; PyTorch's default "
                         "initialisation, not GPT-2's, hence losses near 175).")
    lines += ["", "NCCL / GPU figures were not recorded: no GPU was available where this was run.", ""]
    return "\n".join(lines)


def _report_cuda(rep: dict[str, Any], rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The Markdown of a run on GPUs (NCCL): peak GPU memory allocated instead of RSS."""
    n_params = rows[0]["ranks"][0]["n_params"]
    whole_mib = n_params * 16 / 2**20
    gpu = rows[0]["ranks"][0].get("gpu", "a CUDA GPU")
    placement = "every rank on cuda:0 (--share-gpu)" if args.share_gpu else "rank r on cuda:r"
    lines = [
        "# RTP memory and step time vs DDP and FSDP2 (GPU, NCCL)", "", *header_lines(rep),
        f"GPU: {gpu}; {placement}. Model: GPT-2-small shape ({n_params / 1e6:.1f} M parameters), fp32, AdamW; "
        f"{args.micro_batch} x {args.seq} tokens per rank per step; {args.warmup} warm-up + {args.steps} measured "
        f"steps (median, each timed between CUDA synchronisations). Whole model state = {whole_mib:.0f} MiB.",
        "", "*peak GPU memory* is `torch.cuda.max_memory_allocated` over the training steps, reset after "
        "wrapping; *model state* counts local parameter, gradient and optimizer tensors.", "",
        "| N | engine | step time (ms) | vs DDP | peak GPU memory (MiB) | model state (MiB) | whole state / N (MiB) "
        "| ring buffers (MiB) | loss after the last step |",
        "|---|---|---|---|---|---|---|---|---|"]
    for world in dict.fromkeys(r["world"] for r in rows):
        ddp = next((r for r in rows if r["engine"] == "ddp" and r["world"] == world), None)
        ddp_time = max(x["step_s"] for x in ddp["ranks"]) if ddp else None
        for row in (r for r in rows if r["world"] == world):
            rk = row["ranks"]
            step = max(x["step_s"] for x in rk)
            vs = f"{step / ddp_time:.2f}x" if ddp_time else ""
            lines.append(f"| {world} | {row['engine']} | {1000 * step:.1f} | {vs} | {max(x['peak_mib'] for x in rk):.0f} "
                         f"| {max(x['state_mib'] for x in rk):.0f} | {whole_mib / world:.0f} | "
                         f"{max(x['ring_mib'] for x in rk):.0f} | {rk[0]['loss']:.4f} |")
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m croupier.bench.rtp_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--timeout", type=float, default=900.0, help="per engine and N, seconds")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: NCCL, rank r on cuda:r, peak = GPU memory allocated (default cpu: gloo, RSS)")
    p.add_argument("--share-gpu", action="store_true",
                   help="with --device cuda: every rank on cuda:0 (what one GPU allows; NCCL may refuse it)")
    p.add_argument("--out", type=Path, default=Path("bench/results/rtp_memory.md"),
                   help="the Markdown report (its JSON beside it, named alike)")
    p.add_argument("--render", type=Path, help="rewrite --out from a JSON this script saved, without measuring")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.render:
        args.out.write_text(report(_saved(json.loads(args.render.read_text()))))
        return
    command = " ".join(["python -m croupier.bench.rtp_memory", *(sys.argv[1:] if argv is None else argv)])

    def measure(rep: dict[str, Any]) -> None:
        rep["settings"] = {k: getattr(args, k) for k in SETTINGS}
        tmp = args.out.parent / ".rtp_bench_tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        rep["rows"] = []
        for world in args.ranks:
            for engine in args.engines:
                t0 = time.monotonic()
                ranks = run_config(engine, world, args, tmp)
                rep["rows"].append({"engine": engine, "world": world, "ranks": ranks})
                print(f"{engine} N={world}: step {max(r['step_s'] for r in ranks):.3f} s, peak "
                      f"{max(r['peak_mib'] for r in ranks):.0f} MiB ({time.monotonic() - t0:.0f} s)", flush=True)
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()

    drive(args.out.stem, args.out.parent, command, measure, report)
    print(args.out.read_text())


def _saved(saved: dict[str, Any]) -> dict[str, Any]:
    """A JSON this script saved, as `report` reads it: files before the shared header kept the
    1-minute load average at the start and end as "load_average", and no settings where the run
    used the defaults."""
    if "load_average" in saved:
        start, end = saved.pop("load_average")
        saved["load"] = {"start": [start], "end": [end]}
    defaults = {"steps": 3, "warmup": 1, "seq": 128, "micro_batch": 2, "layers": 12}
    saved["settings"] = {**defaults, **saved.get("settings", {})}
    return saved


if __name__ == "__main__":
    main()
