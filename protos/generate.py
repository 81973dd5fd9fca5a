"""Regenerate the Python code for the wire contract: `python protos/generate.py`.

The generated modules sit beside the .proto files and are installed as the package
`croupier.v1`. They are never edited by hand; test_generated_code_matches_the_protos
in tests/test_packaging.py fails when they drift from the .proto files.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILES = ["croupier/v1/croupier.proto"]


def generate(out_dir: Path = PROTO_ROOT) -> None:
    """Run protoc (from grpcio-tools) on every proto file, writing into `out_dir`."""
    from grpc_tools import protoc  # dev dependency: only codegen needs it

    include = Path(protoc.__file__).resolve().parent / "_proto"
    for proto in PROTO_FILES:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(PROTO_ROOT / proto),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT)
