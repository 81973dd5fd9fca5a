"""The distribution: generated code matches the protos; the wheel installs and imports."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GENERATED = ["croupier_pb2.py", "croupier_pb2.pyi", "croupier_pb2_grpc.py"]


def test_generated_code_matches_the_protos(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "protos"))
    try:
        from generate import generate
    finally:
        sys.path.pop(0)
    generate(tmp_path)
    for name in GENERATED:
        committed = (REPO / "protos/croupier/v1" / name).read_text()
        fresh = (tmp_path / "croupier/v1" / name).read_text()
        assert committed == fresh, f"protos/croupier/v1/{name} drifted: run `python protos/generate.py`"


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_imports(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(REPO)],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("croupier-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "croupier/v1/croupier.proto" in names
    assert not any(n.startswith(("server/", "client/")) for n in names), "bare server/client packages leaked"
    assert not [n for n in names if n.startswith(("croupier/bench/", "bench/"))], "the harness is not the product"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin/python"
    # Dependencies come from this environment (a .pth file), so the test needs no index
    # and proves the wheel itself: its packages, package data and entry point.
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([py, "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = (
        "import croupier, croupier.server.app, croupier.client, croupier.client.rtp, croupier.v1.croupier_pb2_grpc;"
        "import croupier.server, os; print(os.path.dirname(croupier.server.__file__))"
    )
    out = subprocess.run([py, "-c", probe], check=True, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert str(venv) in out.stdout, "imported the checkout, not the installed wheel"
    help_out = subprocess.run([venv / "bin/croupier", "serve", "--help"], check=True, capture_output=True,
                              text=True, cwd=tmp_path, env=env)
    assert "--max-reads" in help_out.stdout
    # without the harness, `croupier bench` says how to get it instead of "invalid choice"
    bench = subprocess.run([venv / "bin/croupier", "bench", "--suite", "real"], capture_output=True, text=True,
                           cwd=tmp_path, env=env)
    assert bench.returncode == 2
    assert "pip install -e ./bench" in bench.stderr


@pytest.mark.slow
def test_the_harness_is_a_distribution_of_its_own(tmp_path: Path) -> None:
    """bench/ builds as croupier-bench: the harness's modules and the C sources it compiles."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
         str(REPO / "bench")],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("croupier_bench-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"croupier/bench/__init__.py", "croupier/bench/s3server.py", "croupier/bench/latencyfs.py",
            "croupier/bench/peers/suite.py", "croupier/bench/native/latencyfs.c",
            "croupier/bench/native/rawreads.c"} <= names
    # it adds the harness to the croupier package and nothing else: no copy of the product
    assert not [n for n in names if n.startswith("croupier/") and not n.startswith("croupier/bench/")]
    assert not [n for n in names if n.startswith("croupier/bench/results/")], "results stay in the checkout"


def test_the_base_install_is_the_server_and_the_rest_are_extras() -> None:
    """`pip install croupier` is what `croupier serve` needs; the trainer side, the demo and
    the shuffle report are extras, and every declared dependency is imported somewhere."""
    import re
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in reqs}

    base = names(project["dependencies"])
    extras = {k: names(v) for k, v in project["optional-dependencies"].items()}
    assert not base & {"torch", "simplejpeg", "scikit-learn", "scipy", "matplotlib", "datasets"}
    assert {"torch", "simplejpeg"} <= extras["client"]
    assert "scikit-learn" in extras["demo"] and "scipy" in extras["report"]
    # declared means used: each base dependency is imported by the product's code
    import_names = {"grpcio": "grpc", "grpcio-health-checking": "grpc_health", "grpcio-reflection": "grpc_reflection",
                    "protobuf": "google.protobuf", "pillow": "PIL", "prometheus-client": "prometheus_client",
                    "pyyaml": "yaml"}
    sources = "\n".join(p.read_text() for d in ("server", "client", "croupier", "protos")
                        for p in (REPO / d).rglob("*.py"))
    unused = [d for d in sorted(base)
              if not re.search(rf"^\s*(from|import) {re.escape(import_names.get(d, d))}\b", sources, re.M)]
    assert unused == [], "declared but never imported"
