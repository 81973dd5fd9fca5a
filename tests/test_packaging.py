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
