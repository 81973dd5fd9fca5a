"""The container recipe works: the exact commands of docker/ run together outside containers.

No container engine runs here, so the test reads the ENTRYPOINT/CMD/ENV/HEALTHCHECK of
each Dockerfile and the services of compose.yaml, and runs what each container would
run, with only what a container provides translated: service host names become
127.0.0.1, the volume's /data becomes a temporary folder, ports become free ones.

The images' dependencies are checked too. The server image installs croupier with
--no-deps plus docker/requirements-server.txt, so the server runs from a virtual
environment holding only those packages and what they depend on (linked from this
one's, no download): no torch, scikit-learn or scipy. The trainer image's pip extras
must exist and, with the package's dependencies, provide everything the demo trainer,
the client and the examples import.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import sysconfig
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
SERVER_REQUIREMENTS = DOCKER / "requirements-server.txt"
TRAINER_SIDE = {"torch", "scikit-learn", "scipy", "tqdm"}  # never in the server image


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


def run_commands(path: Path) -> list[str]:
    """The RUN instructions of a Dockerfile's last stage."""
    runs: list[str] = []
    for keyword, rest in _instructions(path):
        if keyword == "FROM":
            runs = []
        elif keyword == "RUN":
            runs.append(rest)
    return runs


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def server_requirements() -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in SERVER_REQUIREMENTS.read_text().splitlines())
    return [line for line in lines if line]


# Where this environment installs packages (not the repository's stray croupier.egg-info).
SITE_PACKAGES = list(dict.fromkeys(sysconfig.get_path(k) for k in ("purelib", "platlib")))


def installed(name: str) -> md.Distribution:
    found = next(iter(md.distributions(name=name, path=SITE_PACKAGES)), None)
    assert found is not None, f"{name} is not installed in {SITE_PACKAGES}"
    return found


def installed_closure(requirements: list[str]) -> dict[str, md.Distribution]:
    """The installed distributions that `requirements` need, transitively (markers evaluated here)."""
    found: dict[str, md.Distribution] = {}
    done: set[tuple[str, str]] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        for extra in sorted(req.extras) or [""]:
            if (name, extra) in done:
                continue
            done.add((name, extra))
            dist = found.setdefault(name, installed(req.name))
            for dep in map(Requirement, dist.requires or []):
                if dep.marker is None or dep.marker.evaluate({"extra": extra}):
                    todo.append(dep)
    return found


def third_party_imports(paths: list[Path], local: set[str] = frozenset()) -> dict[str, Path]:
    """Top-level modules imported anywhere in `paths` (functions included) that are neither
    the standard library, croupier, nor `local`: module -> first file importing it."""
    out: dict[str, Path] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in (n.split(".")[0] for n in names):
                if top not in sys.stdlib_module_names and top not in {"__future__", "croupier", *local}:
                    out.setdefault(top, path)
    return out


def missing_providers(imports: dict[str, Path], provided: set[str]) -> list[str]:
    by_module = md.packages_distributions()
    return [f"{module} (imported by {path.relative_to(REPO)})" for module, path in sorted(imports.items())
            if not {canonicalize_name(d) for d in by_module.get(module, [module])} & provided]


# What `croupier serve` runs: the server, the wire code, and the CLI with the commands it registers.
SERVER_SOURCES = [*(REPO / "server").rglob("*.py"), *(REPO / "protos" / "croupier" / "v1").glob("*.py"),
                  *(REPO / "croupier" / "protocol").glob("*.py"),
                  *(REPO / "croupier" / m for m in ("__init__.py", "cli.py", "logs.py", "loadtest.py", "healthcheck.py"))]
TRAINER_SOURCES = [*(REPO / "client").rglob("*.py"), *(REPO / "examples").glob("*.py"),
                   *(REPO / "croupier" / "demo").glob("*.py"), REPO / "croupier" / "shuffle_quality.py"]


def make_server_venv(root: Path) -> Path:
    """A virtual environment with croupier and only the server image's packages, linked from this
    environment's site-packages (no index needed). Returns the environment's bin folder."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    bin_dir = root / "bin"
    site = Path(subprocess.run([str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    dists = installed_closure(server_requirements())
    croupier = installed("croupier")  # editable or not: its files, but none of its dependencies
    for dist in [*dists.values(), croupier]:
        assert dist.files is not None, f"{dist.metadata['Name']} has no RECORD to link from"
        for top in {f.parts[0] for f in dist.files if f.parts[0] not in ("..", "__pycache__")}:
            target = Path(dist.locate_file(top))
            if target.exists() and not (site / top).exists():
                (site / top).symlink_to(target)
    for ep in croupier.entry_points.select(group="console_scripts"):
        module, _, attr = ep.value.partition(":")
        script = bin_dir / ep.name
        script.write_text(f"#!{bin_dir / 'python'}\nimport sys\nfrom {module} import {attr}\nsys.exit({attr}())\n")
        script.chmod(0o755)
    return bin_dir


def venv_env(bin_dir: Path, env: dict[str, str]) -> dict[str, str]:
    """`env` with `bin_dir` first on PATH and nothing else leaking into its interpreter's imports."""
    out = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    out.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(bin_dir.parent), PYTHONNOUSERSITE="1")
    return out


@pytest.fixture(scope="module")
def server_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_server_venv(tmp_path_factory.mktemp("server-image") / "venv")


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

    def __init__(self, spec: dict, data_dir: Path, server_venv: Path):
        self.data_dir = data_dir
        self.server_venv = server_venv
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

    def env(self, image: Image, svc: dict, server_image: bool = False) -> dict[str, str]:
        merged = {**image.env, **{k: str(v) for k, v in (svc.get("environment") or {}).items()}}
        env = {**os.environ, **{k: self.value(k, v) for k, v in merged.items()}}
        if server_image:  # only what the server image installs
            return venv_env(self.server_venv, env)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        return env


def _health(argv: list[str], env: dict[str, str]) -> int:
    return subprocess.run(argv, env=env, capture_output=True, timeout=30).returncode


def test_images_run_as_an_unprivileged_user_with_a_healthcheck() -> None:
    for name in ("Dockerfile", "Dockerfile.trainer"):
        image = parse_dockerfile(DOCKER / name)
        assert image.user not in ("root", "0", ""), f"{name} runs as root"
        assert image.entrypoint, f"{name} has no ENTRYPOINT"
    # The probe connects as a client does (TLS and token from the environment), with grpc_health.
    assert parse_dockerfile(DOCKER / "Dockerfile").healthcheck[-1] == "croupier.healthcheck"
    assert "grpc_health" in (REPO / "croupier" / "healthcheck.py").read_text()


def test_dockerignore_keeps_the_build_context_small() -> None:
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".git", ".venv", "tests", "bench", "**/__pycache__"} <= ignored


def test_server_requirements_are_pyproject_dependencies_without_the_trainer_side() -> None:
    deps = pyproject()["dependencies"]
    reqs = server_requirements()
    assert reqs and len(set(reqs)) == len(reqs)
    # Verbatim, so that a version change in pyproject.toml cannot leave the image behind unnoticed.
    assert [r for r in reqs if r not in deps] == [], "not (or no longer) in pyproject.toml's dependencies"
    closure = installed_closure(reqs)
    assert TRAINER_SIDE.isdisjoint(closure), TRAINER_SIDE & set(closure)
    # Everything the server's code imports, even lazily (images decoded on the server), is provided.
    assert missing_providers(third_party_imports(SERVER_SOURCES), set(closure)) == []


def test_server_image_installs_only_the_server_requirements() -> None:
    runs = " && ".join(run_commands(DOCKER / "Dockerfile"))
    installs = [cmd.strip() for cmd in runs.split("&&") if "pip install" in cmd]
    assert len(installs) == 2, installs
    assert installs[0].endswith(" -r /tmp/install/requirements-server.txt"), installs
    assert " --no-deps " in installs[1] and installs[1].endswith(".whl"), installs
    assert any(k == "COPY" and rest.split()[0] == "docker/requirements-server.txt"
               for k, rest in _instructions(DOCKER / "Dockerfile"))
    # the file is inside the build context although docker/ is not
    ignore = (REPO / ".dockerignore").read_text().split()
    assert ignore.index("!docker/requirements-server.txt") > ignore.index("docker")


def test_trainer_image_extras_exist_and_provide_what_trainers_and_examples_import() -> None:
    project = pyproject()
    installs = [m.group(1) for cmd in run_commands(DOCKER / "Dockerfile.trainer")
                for m in re.finditer(r'pip install [^"]*"\.(?:\[([^\]]*)\])?"', cmd)]
    assert len(installs) == 1, run_commands(DOCKER / "Dockerfile.trainer")
    extras = [e.strip() for e in (installs[0] or "").split(",") if e.strip()]
    assert "hf" in extras  # examples/make_text_dataset.py needs `datasets`
    unknown = set(extras) - set(project["optional-dependencies"])
    assert not unknown, f"pip would only warn: croupier does not provide the extra(s) {sorted(unknown)}"
    wanted = [*project["dependencies"], *(d for e in extras for d in project["optional-dependencies"][e])]
    local = {p.stem for p in (REPO / "examples").glob("*.py")}
    assert missing_providers(third_party_imports(TRAINER_SOURCES, local), set(installed_closure(wanted))) == []


def test_croupier_serve_runs_with_only_the_server_image_packages(server_venv: Path, tmp_path: Path) -> None:
    python = server_venv / "python"
    for module in ("torch", "sklearn", "scipy", "tqdm"):
        probe = subprocess.run([python, "-c", f"import {module}"], env=venv_env(server_venv, dict(os.environ)),
                               capture_output=True, timeout=60)
        assert probe.returncode != 0, f"{module} is importable in the server's environment"
    image = parse_dockerfile(DOCKER / "Dockerfile")
    local = Localizer({"services": {}}, tmp_path, server_venv)
    env = local.env(image, {"environment": {"CROUPIER_DATASETS": "synth=synthetic:1000"}}, server_image=True)
    server = subprocess.Popen(container_argv({}, image), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while _health(image.healthcheck, env) != 0:
            assert server.poll() is None, server.communicate()[0]
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(0.3)
    finally:
        server.terminate()
        out = server.communicate(timeout=60)[0]
    assert server.returncode == 0, out


@pytest.mark.slow
def test_compose_services_train_end_to_end(tmp_path: Path, server_venv: Path) -> None:
    spec = compose()
    images = service_images(spec)
    services = spec["services"]
    data = tmp_path / "data"
    data.mkdir()
    local = Localizer(spec, data, server_venv)

    def image_of(name: str) -> Image:
        return images[services[name]["image"]]

    prep = services["prepare"]
    done = subprocess.run(container_argv(prep, image_of("prepare")), env=local.env(image_of("prepare"), prep),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr

    srv = services["server"]
    server_env = local.env(image_of("server"), srv, server_image=True)
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
