"""The server image, built for real: docker/build-local.sh on a debootstrap base, run with podman.

No container registry is reachable here, so the script makes a Debian 12 base with
debootstrap (python3 3.11, as python:3.11-slim), builds docker/Dockerfile on it with
`--build-arg BASE_IMAGE=...`, runs the image on a generated dataset, and passes only when
the image's own HEALTHCHECK command passes, `croupier health` answers SERVING (in the
container and from here through the published port), one epoch read through it holds
every row once, and the native read pool was compiled into the image.

A cold build takes about 4 minutes (debootstrap 1.5, the image's pip installs from PyPI
1.5) and needs a Debian mirror and PyPI, so it is opt-in: CROUPIER_IMAGE_TESTS=1. The
debootstrap base is cached (CACHE, default ~/.cache/croupier/images), and a warm run takes
under a minute. The checks that the default base stays the official image always run.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "docker" / "build-local.sh"


def _from_lines(dockerfile: Path) -> tuple[dict[str, str], list[str]]:
    """The global ARG defaults and the FROM images of a Dockerfile."""
    args, froms = {}, []
    for line in dockerfile.read_text().splitlines():
        if m := re.match(r"ARG (\w+)(?:=(\S+))?$", line):
            if not froms:
                args[m.group(1)] = m.group(2)
        elif line.startswith("FROM "):
            froms.append(line.split()[1])
    return args, froms


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.trainer"])
def test_the_base_image_is_a_build_argument_that_defaults_to_the_official_one(name: str) -> None:
    args, froms = _from_lines(REPO / "docker" / name)
    assert args["BASE_IMAGE"] == "python:${PYTHON}-slim" and args["PYTHON"] == "3.11"
    assert froms and all(f == "${BASE_IMAGE}" for f in froms)


def _skip_reason() -> str | None:
    if os.environ.get("CROUPIER_IMAGE_TESTS") != "1":
        return ("builds an image (about 4 minutes cold, a Debian mirror and PyPI needed): set CROUPIER_IMAGE_TESTS=1 "
                "(and apt-get install podman buildah crun runc debootstrap)")
    missing = [tool for tool in ("podman", "debootstrap") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (apt-get install podman buildah crun runc debootstrap)"
    if os.geteuid() != 0:
        return "debootstrap and rootful podman need root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_server_image_built_on_a_debootstrap_base_serves_and_is_healthy() -> None:
    if (reason := _skip_reason()) is not None:
        pytest.skip(reason)
    port = _free_port()
    out = subprocess.run(["bash", str(SCRIPT), "server"], capture_output=True, text=True, timeout=840,
                         env={**os.environ, "PORT": str(port)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    lines = out.stdout.splitlines()
    assert "croupier health (in the container): SERVING" in lines
    assert f"croupier health 127.0.0.1:{port} (from the host): SERVING" in lines
    assert "one epoch read in the container: 1000 rows, each once" in lines
    assert "native read pool: built into the image" in lines
