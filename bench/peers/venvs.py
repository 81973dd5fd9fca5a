"""One virtual environment per peer loader, under ~/.cache/croupier/peer-venvs/<peer>.

Pins conflict between the peers (mosaicml-streaming and datasets 5.x cannot share one), so
each gets its own, made with the machine's python (or, for a peer whose releases need a newer
one, a newer Python found on the machine: `newer_python`) and filled from the package index pip is
configured with. A peer that needs torch gets `torch==2.13.0` installed first, then the peer
with the same pin on the command line: an unpinned torch would pull the CUDA builds, and a
peer whose requirements refuse 2.13.0 fails to install, which is recorded, not worked around.
The venv is reused while its stamp (the requirement list) matches; `versions()` is what
`pip freeze` says of the key packages, written into the results.

A peer can have a second venv for a storage that needs other packages (suite.STORAGE_VENVS):
`tfdata-s3`, tf.data on S3. TensorFlow has had no s3:// file system of its own since 2.6;
tensorflow-io provides it, and its newest release, 0.37.1, is built for TensorFlow 2.16.x (its
README's compatibility table; its `tensorflow-cpu` extra pins >=2.16,<2.17), so a TensorFlow user
reading S3 installs tensorflow-cpu 2.16.2 with it. The latency FS keeps the newest TensorFlow
(`tfdata`, 2.21.0, which also writes the TFRecord files both read): moving tf.data to 2.16 there
would run an older TensorFlow than its users on files would, for a plug-in that path does not use.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TORCH = "torch==2.13.0"
ROOT = Path(os.environ.get("CROUPIER_PEER_VENVS", Path.home() / ".cache" / "croupier" / "peer-venvs"))


@dataclass(frozen=True)
class PeerEnv:
    name: str
    #: Requirements after torch (exact versions: the ones the package index offers today).
    requirements: tuple[str, ...]
    needs_torch: bool = True
    #: Distributions whose versions the results record.
    key_packages: tuple[str, ...] = ()
    #: The oldest Python the peer's releases install on (their Requires-Python), where it is above ours.
    requires_python: tuple[int, int] = (3, 0)

    @property
    def path(self) -> Path:
        return ROOT / self.name

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def stamp(self) -> str:
        return json.dumps({"torch": TORCH if self.needs_torch else None, "requirements": self.requirements})


PEERS: dict[str, PeerEnv] = {
    "mosaic": PeerEnv("mosaic", ("mosaicml-streaming==0.13.0", "pillow"),
                      key_packages=("mosaicml-streaming", "torch", "numpy", "boto3", "pillow")),
    "litdata": PeerEnv("litdata", ("litdata==0.2.76", "pillow", "boto3"),
                       key_packages=("litdata", "torch", "numpy", "boto3", "obstore", "pillow")),
    "tfdata": PeerEnv("tfdata", ("tensorflow-cpu==2.21.0", "pillow"), needs_torch=False,
                      key_packages=("tensorflow-cpu", "tensorflow", "numpy", "pillow")),
    # tf.data on S3: TensorFlow's own s3:// file system left it in 2.6; tensorflow-io provides it, and its
    # newest release (0.37.1) is built against TensorFlow 2.16.x (its README's compatibility table; its
    # `tensorflow-cpu` extra pins >=2.16,<2.17). A TensorFlow user reading S3 installs that pair.
    "tfdata-s3": PeerEnv("tfdata-s3", ("tensorflow-cpu==2.16.2", "tensorflow-io==0.37.1", "pillow"),
                         needs_torch=False,
                         key_packages=("tensorflow-cpu", "tensorflow", "tensorflow-io",
                                       "tensorflow-io-gcs-filesystem", "numpy", "pillow")),
    "torchdata": PeerEnv("torchdata", ("torchdata==0.11.0", "numpy", "pillow", "pyarrow", "boto3"),
                         key_packages=("torchdata", "torch", "numpy", "pyarrow", "boto3", "pillow")),
    # Lance: its writer, its native take, and lance.torch.data's loader (torch: the PyTorch user's venv).
    "lance": PeerEnv("lance", ("pylance==14.0.2", "pillow"),
                     key_packages=("pylance", "torch", "numpy", "pyarrow", "pillow")),
    # dataloader-rs: every release on the package index says Requires-Python >=3.13 (its wheels are for
    # 3.13 to 3.15): its venv is made with a Python 3.13 found on the machine (`newer_python`), and where
    # there is none it is recorded as not installable. No torch: the index's only torch 2.13.0 wheels for
    # 3.13 are CUDA builds (several GB of nvidia packages); its runner needs none (NumPy samples).
    "dataloader-rs": PeerEnv("dataloader-rs", ("dataloader-rs==0.2.0", "numpy", "pillow", "pyarrow", "boto3"),
                             needs_torch=False,
                             key_packages=("dataloader-rs", "numpy", "pyarrow", "boto3", "pillow"),
                             requires_python=(3, 13)),
    # Grain with ArrayRecord: the JAX world's loader; no torch, and no JAX needed to read (numpy batches).
    "grain": PeerEnv("grain", ("grain==0.2.18", "array-record==0.8.6", "pillow"), needs_torch=False,
                     key_packages=("grain", "array-record", "numpy", "pillow")),
}


class VenvError(RuntimeError):
    pass


def _pip(env: PeerEnv, *args: str, log: Path, timeout: float) -> None:
    cmd = [str(env.python), "-m", "pip", "install", "-q", *args]
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if r.returncode != 0:
        tail = log.read_text()[-1500:]
        raise VenvError(f"{env.name}: `pip install {' '.join(args)}` failed ({r.returncode}); see {log}:\n{tail}")


def ensure(env: PeerEnv, say=print, timeout: float = 1800) -> Path:
    """The peer's python, creating or repairing its venv first if needed."""
    stamp_file = env.path / "croupier-peer.json"
    if env.python.exists() and stamp_file.is_file() and stamp_file.read_text() == env.stamp():
        return env.python
    base = base_python(env)
    if base is None:
        raise VenvError(_python_too_old(env))
    t0 = time.perf_counter()
    say(f"creating the {env.name} venv at {env.path} with {base} (pip, a few minutes the first time)")
    env.path.parent.mkdir(parents=True, exist_ok=True)
    if not env.python.exists():
        subprocess.run([base, "-m", "venv", str(env.path)], check=True, timeout=300)
    log = env.path / "install.log"
    if env.needs_torch:
        _pip(env, TORCH, log=log, timeout=timeout)
        _pip(env, TORCH, *env.requirements, log=log, timeout=timeout)  # the pin again: refuse any other torch
    else:
        _pip(env, *env.requirements, log=log, timeout=timeout)
    stamp_file.write_text(env.stamp())
    say(f"  {env.name} venv ready in {time.perf_counter() - t0:.0f} s")
    return env.python


#: A Python for peers that need a newer one than ours (its path; else one is looked for).
NEWER_PYTHON_ENV = "CROUPIER_PEER_PYTHON"


def _version_of(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=60).stdout.split()
        return (int(out[0]), int(out[1])) if len(out) == 2 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def newer_python(want: tuple[int, int]) -> str | None:
    """A Python of at least `want` on this machine: $CROUPIER_PEER_PYTHON, else `pythonX.Y` on the
    PATH, else pyenv's (~/.pyenv/versions/X.Y*); None when there is none."""
    import glob
    import shutil

    name = f"python{want[0]}.{want[1]}"
    candidates = [os.environ.get(NEWER_PYTHON_ENV, ""), shutil.which(name) or ""]
    candidates += sorted(glob.glob(str(Path.home() / ".pyenv" / "versions" / f"{want[0]}.{want[1]}*" / "bin" / name)),
                         reverse=True)
    for python in filter(None, candidates):
        version = _version_of(python)
        if version is not None and version >= want:
            return python
    return None


def base_python(env: PeerEnv) -> str | None:
    """The Python the peer's venv is made with: ours, or a newer one its Requires-Python needs."""
    if sys.version_info[:2] >= env.requires_python:
        return sys.executable
    return newer_python(env.requires_python)


def _python_too_old(env: PeerEnv) -> str:
    """Why the peer cannot be installed here ("" when it can): pip would only say that no version
    matches."""
    if base_python(env) is not None:
        return ""
    want = ".".join(map(str, env.requires_python))
    return (f"{', '.join(env.requirements[:1])} requires Python >= {want} (its Requires-Python); "
            f"this machine's python is {platform.python_version()} ({sys.executable}), and no Python {want} "
            f"was found (python{want} on the PATH, pyenv's, or ${NEWER_PYTHON_ENV})")


def versions(env: PeerEnv) -> dict[str, str]:
    """`pip freeze` of the venv, the key packages' lines (name -> version)."""
    out = subprocess.run([str(env.python), "-m", "pip", "freeze", "--all"], capture_output=True, text=True,
                         timeout=120).stdout
    found: dict[str, str] = {}
    want = {k.lower().replace("_", "-") for k in env.key_packages}
    for line in out.splitlines():
        name, sep, version = line.partition("==")
        key = name.strip().lower().replace("_", "-")
        if sep and key in want:
            found[key] = version.strip()
    found["python"] = subprocess.run([str(env.python), "-c", "import platform; print(platform.python_version())"],
                                     capture_output=True, text=True, timeout=60).stdout.strip()
    return found


def status(name: str) -> str:
    """"" when the peer's venv is ready, else why not (for tests that skip)."""
    env = PEERS[name]
    stamp_file = env.path / "croupier-peer.json"
    too_old = _python_too_old(env)
    if too_old:
        return too_old
    if not env.python.exists():
        return f"no venv at {env.path}"
    if not stamp_file.is_file() or stamp_file.read_text() != env.stamp():
        return f"the venv at {env.path} is incomplete or for other requirements"
    return ""
