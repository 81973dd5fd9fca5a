"""What every peer runner shares: its job, the JSON lines it prints, the kill for the resume test.

Runners run inside a peer's own virtual environment, where croupier is not installed: this
module imports nothing but the standard library. The protocol, one JSON object a line on
stdout (stderr is the library's own chatter):

    {"ev": "start", "t": ...}                     imports done, the loader is about to be built
    {"ev": "batch", "epoch": e, "t": ..., "ids": [...]}   a batch reached the trainer
    {"ev": "epoch_end", "epoch": e, "t": ...}
    {"ev": "epoch_start", "epoch": e, "t": ...}   every rank ended epoch e-1 (the barrier): e begins
    {"ev": "state", "after_batches": k, "path": ...}      a checkpoint was written
    {"ev": "end", "t": ..., "peak_rss_mb": ...}

`t` is time.perf_counter(): CLOCK_MONOTONIC, the same clock in every process of the machine,
so the harness lines up the ranks. `ids` are the source rows' ids (the dataset's storage order).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Job:
    system: str
    dataset: str  # "text" or "image"
    #: Where the peer's shards are: a folder (on the latency FS mount) or an s3:// URL.
    remote: str
    #: The peer's local cache folder (fresh per run: epoch 1 starts cold).
    local: str
    rank: int = 0
    world: int = 1
    batch: int = 64
    epochs: int = 2
    workers: int = 2
    #: "default" (the peer's documented default shuffle) or "strongest" (its best-quality option).
    shuffle: str = "default"
    #: Bytes; 0 = the peer's default (no limit, or its own default budget).
    cache_limit: int = 0
    #: After this many batches of the first epoch: write the state (rank 0), then SIGKILL itself.
    kill_after: int = 0
    state_path: str = ""
    #: Load the state at state_path before iterating (the resumed trainer).
    resume: bool = False
    seed: int = 0
    #: S3: the endpoint URL of the loopback server; "" on files.
    endpoint: str = ""
    #: torch.distributed rendezvous on loopback, for peers that need a process group.
    master_port: int = 0
    #: Stop the run this long into an epoch (0: never): the epoch is reported as cut, later ones are not run.
    max_epoch_s: float = 0.0
    #: A folder all ranks of the run share: they meet there at each epoch's end, as a synchronous
    #: (DDP) trainer's ranks do at every step's all-reduce ("": no barrier).
    barrier: str = ""
    #: System-specific extras (a croupier server address, a tf.data dispatcher, ...).
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> "Job":
        return cls(**json.loads(text))


def emit(ev: str, **kw: Any) -> None:
    sys.stdout.write(json.dumps({"ev": ev, **kw}) + "\n")
    sys.stdout.flush()


def now() -> float:
    return time.perf_counter()


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def ids_of(value: Any) -> list[int]:
    """A batch's ids (a tensor, an array or a list) as plain ints."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [int(v) for v in value]


def die_now() -> None:
    """The trainer is killed: no clean-up, no atexit, no flush of anything but what was printed."""
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def state_file(job: Job, rank: int) -> str:
    return f"{job.state_path}.rank{rank}"


def save_state(job: Job, state: Any, after: int) -> None:
    path = state_file(job, job.rank)
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)  # a checkpoint is written whole or not at all
    emit("state", after_batches=after, path=path)


def load_state(job: Job, rank: int | None = None) -> Any:
    """This rank's checkpoint, or rank `rank`'s (peers whose loader state is global: rank 0's)."""
    with open(state_file(job, job.rank if rank is None else rank)) as f:
        return json.load(f)


#: How long a rank waits at an epoch's barrier for the others before it gives up (an error).
BARRIER_TIMEOUT_S = 600.0


def epoch_barrier(job: Job, epoch: int) -> None:
    """Wait until every rank has ended `epoch`: each leaves a file in job.barrier and polls for
    the others'. Without it a rank that ended its epoch early starts the next while another is
    still in the last one, and the next epoch's clock takes in that tail (a synchronous trainer's
    ranks never drift apart so: each step's all-reduce waits for all of them)."""
    if not job.barrier or job.world < 2:
        return
    os.makedirs(job.barrier, exist_ok=True)
    open(os.path.join(job.barrier, f"epoch{epoch}.rank{job.rank}"), "w").close()
    names = [os.path.join(job.barrier, f"epoch{epoch}.rank{r}") for r in range(job.world)]
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while not all(os.path.exists(n) for n in names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {job.rank}: the other ranks did not end epoch {epoch} within "
                               f"{BARRIER_TIMEOUT_S:.0f} s (barrier folder {job.barrier})")
        time.sleep(0.001)


def run_epochs(job: Job, epochs_iter, state_fn=None) -> None:
    """Drive the loader: `epochs_iter(epoch)` yields batches as (ids, batch) for one epoch;
    `state_fn()` returns the checkpoint (rank 0) when the job asks for the kill."""
    first = 0  # the kill happens in the first epoch the job runs
    for epoch in range(job.epochs):
        n = 0
        began = now()
        for ids in epochs_iter(epoch):
            n += 1
            t = now()
            emit("batch", epoch=epoch, t=t, ids=ids)
            if job.max_epoch_s and t - began > job.max_epoch_s:
                emit("epoch_end", epoch=epoch, t=t, batches=n, cut=True)
                emit("end", t=now(), peak_rss_mb=peak_rss_mb())
                return
            if job.kill_after and epoch == first and n == job.kill_after:
                # A synchronous trainer checkpoints after step K on every rank, then is killed:
                # each rank has consumed exactly K batches.
                save_state(job, state_fn() if state_fn else None, n)
                die_now()
        emit("epoch_end", epoch=epoch, t=now(), batches=n)
        if epoch + 1 < job.epochs:
            epoch_barrier(job, epoch)
            emit("epoch_start", epoch=epoch + 1, t=now())
    emit("end", t=now(), peak_rss_mb=peak_rss_mb())


def run_loader_epochs(job: Job, loader) -> None:
    """run_epochs over a loader that yields dict batches with an "id" tensor, each pass over it its
    dataset's next epoch (Mosaic's, LitData's and torchdata's loaders), checkpointed by its own
    state_dict."""

    def epoch(_: int):
        for batch in loader:
            yield batch["id"].tolist()

    run_epochs(job, epoch, loader.state_dict)


def command_line(system: str, read, write=None) -> int:
    """A runner's command line: `read JOB_JSON` runs one rank; `write ARGS_JSON` prints what the
    peer's own writer wrote as one JSON line (a system without one reads the benchmark's own
    files: an error, exit status 2)."""
    cmd, arg = sys.argv[1], sys.argv[2]
    if cmd == "read":
        read(Job.parse(arg))
        return 0
    if cmd == "write" and write is not None:
        print(json.dumps(write(json.loads(arg))), flush=True)
        return 0
    why = "reads the benchmark's own files; there is nothing to write" if cmd == "write" else f"has no command {cmd!r}"
    print(json.dumps({"error": f"{system} {why}"}))
    return 2


# ---- the source rows every writer writes ----------------------------------------------------

def source_rows(dataset: str, source: str):
    """The benchmark's rows in id order, as plain Python: text from the JSON lines the harness
    exported (`text.jsonl`: id, label, text, tokens), images from its WebDataset tar shards
    (`key.jpg` + `key.cls`, key = the image's id): the same rows croupier serves."""
    if dataset == "text":
        with open(os.path.join(source, "text.jsonl")) as f:
            for line in f:
                yield json.loads(line)
        return
    import tarfile

    shards = sorted(n for n in os.listdir(source) if n.endswith(".tar"))
    for name in shards:
        pending: dict[str, dict[str, Any]] = {}
        with tarfile.open(os.path.join(source, name)) as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                data = tar.extractfile(member).read()
                row = pending.setdefault(key, {"id": int(key)})
                if ext == "jpg":
                    row["jpg"] = data
                elif ext == "cls":
                    row["label"] = int(data)
                if "jpg" in row and "label" in row:
                    yield pending.pop(key)


def decode_jpeg(data: bytes, numpy: bool = False):
    """uint8 CHW tensor, as croupier's client decodes (decode_images="tensor"); a NumPy array
    of the same with `numpy` (a venv without torch)."""
    import io

    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        hwc = np.asarray(img.convert("RGB")).copy()
    if numpy:
        return hwc.transpose(2, 0, 1)
    import torch

    return torch.from_numpy(hwc).permute(2, 0, 1)


def torchvision_or_placeholder() -> str:
    """Import torchvision, or put a placeholder in its place; returns a note for the results ("" if real).

    PyPI's Linux torchvision wheels are CUDA builds: beside the CPU torch 2.13.0 every venv here
    must use, their C extension does not load and `import torchvision` raises. Mosaic's
    `streaming/__init__` imports `streaming.vision` (its CIFAR/ImageNet datasets, which need
    torchvision's VisionDataset) even when they are not used; the benchmark uses none of them,
    so a placeholder module lets `import streaming` finish. Anything that really used
    torchvision would fail loudly on the placeholder."""
    import types

    try:
        import torchvision

        del torchvision
        return ""
    except (RuntimeError, ImportError, OSError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]

    def unavailable(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError(f"torchvision is unavailable in this venv ({reason})")

    class VisionDataset:  # only ever subclassed by streaming.vision's unused datasets
        def __init__(self, *_a: Any, **_k: Any) -> None:
            unavailable()

    tv = types.ModuleType("torchvision")
    datasets = types.ModuleType("torchvision.datasets")
    datasets.VisionDataset = VisionDataset
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")
    functional.to_tensor = unavailable
    tv.datasets, tv.transforms, transforms.functional = datasets, transforms, functional
    import importlib.machinery

    for m in (tv, datasets, transforms, functional):  # importlib.util.find_spec() asks for one
        m.__spec__ = importlib.machinery.ModuleSpec(m.__name__, None)
    sys.modules.update({"torchvision": tv, "torchvision.datasets": datasets, "torchvision.transforms": transforms,
                        "torchvision.transforms.functional": functional})
    return f"torchvision replaced by a placeholder for streaming.vision's unused datasets: {reason}"


def guarded(main) -> int:
    """Run `main`; an exception is also printed as {"ev": "error"} so the harness reports its message."""
    try:
        return main()
    except Exception as exc:
        emit("error", text=f"{type(exc).__name__}: {str(exc)[:600]}")
        raise
