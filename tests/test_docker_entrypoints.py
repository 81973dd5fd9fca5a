"""The container recipe works: the exact commands of docker/ run together outside containers.

No container engine runs here, so the test reads the ENTRYPOINT/CMD/ENV/HEALTHCHECK of
each Dockerfile and the services of compose.yaml, and runs what each container would
run, with only what a container provides translated: service host names become
127.0.0.1, the volume's /data becomes a temporary folder, ports become free ones. The
server runs where torch cannot be imported, as in its image.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"


@dataclass
class Image:
    """What the last stage of a Dockerfile leaves for `docker run`."""

    env: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    healthcheck: list[str] = field(default_factory=list)
    user: str = "root"


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())  # join continuation lines
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def parse_dockerfile(path: Path) -> Image:
    image = Image()
    for keyword, rest in _instructions(path):
        if keyword == "FROM":
            image = Image()  # only the last stage ends up in the image
        elif keyword == "ENV":
            image.env.update(tok.split("=", 1) for tok in shlex.split(rest))
        elif keyword == "ENTRYPOINT":
            image.entrypoint = json.loads(rest)
        elif keyword == "CMD":
            image.cmd = json.loads(rest)
        elif keyword == "USER":
            image.user = rest
        elif keyword == "HEALTHCHECK":
            image.healthcheck = json.loads(rest[rest.index(" CMD ") + 5 :])
    return image


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def service_images(spec: dict) -> dict[str, Image]:
    """Image name -> parsed Dockerfile, for every image a service builds."""
    images = {}
    for svc in spec["services"].values():
        if "build" in svc:
            images[svc["image"]] = parse_dockerfile(DOCKER / svc["build"]["context"] / svc["build"]["dockerfile"])
    return images


def container_argv(svc: dict, image: Image) -> list[str]:
    """Docker's rule: a service's entrypoint replaces the image's and drops the image's CMD."""
    if "entrypoint" in svc:
        return list(svc["entrypoint"]) + list(svc.get("command", []))
    return image.entrypoint + list(svc.get("command", image.cmd))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Localizer:
    """Translates what a container sees (DNS names, volumes, ports) to this machine."""

    def __init__(self, spec: dict, data_dir: Path, torchless: Path):
        self.data_dir = data_dir
        self.torchless = torchless
        self.server_port = free_port()
        self.master_port = free_port()
        self.hosts = set(spec["services"])

    def value(self, key: str, value: str) -> str:
        if key == "CROUPIER_HOST":
            return "127.0.0.1"
        if key == "CROUPIER_PORT":
            return str(self.server_port)
        if key == "CROUPIER_METRICS_PORT":
            return "0"
        if key == "MASTER_PORT":
            return str(self.master_port)
        if key == "MASTER_ADDR" and value in self.hosts:
            return "127.0.0.1"
        if key == "CROUPIER_SERVERS":
            return ",".join(f"127.0.0.1:{self.server_port}" for _ in value.split(","))
        return re.sub(r"(?<![\w/])/data(?=/|\b|$)", str(self.data_dir), value)

    def env(self, image: Image, svc: dict, torch_free: bool = False) -> dict[str, str]:
        merged = {**image.env, **{k: str(v) for k, v in (svc.get("environment") or {}).items()}}
        env = {**os.environ, **{k: self.value(k, v) for k, v in merged.items()}}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        if torch_free:  # the server image installs no torch
            env["PYTHONPATH"] = str(self.torchless)
        return env


@pytest.fixture
def torchless(tmp_path: Path) -> Path:
    stub = tmp_path / "torchless" / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('torch is not installed in the server image')\n")
    return stub.parent


def _health(argv: list[str], env: dict[str, str]) -> int:
    return subprocess.run(argv, env=env, capture_output=True, timeout=30).returncode


def test_images_run_as_an_unprivileged_user_with_a_healthcheck() -> None:
    for name in ("Dockerfile", "Dockerfile.trainer"):
        image = parse_dockerfile(DOCKER / name)
        assert image.user not in ("root", "0", ""), f"{name} runs as root"
        assert image.entrypoint, f"{name} has no ENTRYPOINT"
    assert "grpc_health" in " ".join(parse_dockerfile(DOCKER / "Dockerfile").healthcheck)


def test_dockerignore_keeps_the_build_context_small() -> None:
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".git", ".venv", "tests", "**/__pycache__"} <= ignored


@pytest.mark.slow
def test_compose_services_train_end_to_end(tmp_path: Path, torchless: Path) -> None:
    spec = compose()
    images = service_images(spec)
    services = spec["services"]
    data = tmp_path / "data"
    data.mkdir()
    local = Localizer(spec, data, torchless)

    def image_of(name: str) -> Image:
        return images[services[name]["image"]]

    prep = services["prepare"]
    done = subprocess.run(container_argv(prep, image_of("prepare")), env=local.env(image_of("prepare"), prep),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr

    srv = services["server"]
    server_env = local.env(image_of("server"), srv, torch_free=True)
    server = subprocess.Popen(container_argv(srv, image_of("server")), env=server_env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    trainers: list[subprocess.Popen] = []
    try:
        health = image_of("server").healthcheck
        deadline = time.monotonic() + 60
        while _health(health, server_env) != 0:
            assert server.poll() is None, server.communicate()[0]
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(0.5)
        names = [n for n in services if n.startswith("trainer")]
        assert len(names) == 2
        for name in names:
            trainers.append(subprocess.Popen(container_argv(services[name], image_of(name)),
                                             env=local.env(image_of(name), services[name]),
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [t.communicate(timeout=400)[0] for t in trainers]
        assert [t.returncode for t in trainers] == [0, 0], "\n".join(outputs)
        match = re.search(r"held-out accuracy: ([0-9.]+)", outputs[0])
        assert match, outputs[0]
        assert float(match.group(1)) >= 0.95, outputs[0]
    finally:
        for t in trainers:
            if t.poll() is None:
                t.kill()
        server.terminate()
        server_out = server.communicate(timeout=60)[0]
    assert server.returncode == 0, server_out
    assert _health(health, server_env) != 0, "the healthcheck passes with the server gone"
