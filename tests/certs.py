"""Certificates for the security tests, made by the openssl command (Debian's `openssl`).

A throwaway CA signs a server certificate (for localhost and 127.0.0.1) and client
certificates; a second, unrelated CA signs a client certificate no server trusts.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

OPENSSL = shutil.which("openssl")
needs_openssl = pytest.mark.skipif(OPENSSL is None, reason="the openssl command is not installed")


def _run(*args: str, cwd: Path) -> None:
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _key_and_csr(name: str, cn: str, cwd: Path) -> None:
    _run("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=cwd)


def _ca(name: str, cwd: Path) -> None:
    _run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
         "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN={name}", cwd=cwd)


def _sign(name: str, ca: str, extensions: str, cwd: Path) -> None:
    (cwd / f"{name}.ext").write_text(extensions)
    _run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
         "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=cwd)


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path  # CN "trainer-1", signed by `ca`
    client_key: Path
    rogue_cert: Path  # signed by another CA
    rogue_key: Path


def make_certs(root: Path) -> Certs:
    root.mkdir(parents=True, exist_ok=True)
    _ca("ca", root)
    _ca("rogue-ca", root)
    _key_and_csr("server", "localhost", root)
    _sign("server", "ca", "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
          "extendedKeyUsage=serverAuth\n", root)
    for name, ca in (("client", "ca"), ("rogue", "rogue-ca")):
        _key_and_csr(name, "trainer-1", root)
        _sign(name, ca, "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n", root)
    return Certs(root / "ca.pem", root / "server.pem", root / "server.key", root / "client.pem",
                 root / "client.key", root / "rogue.pem", root / "rogue.key")
