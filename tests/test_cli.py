"""The `croupier serve` command line: help, config file merging, clear refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from croupier.cli import build_server_config, make_parser


def _serve_args(*argv: str):
    return make_parser().parse_args(["serve", *argv])


def test_help_explains_the_knobs() -> None:
    out = subprocess.run([sys.executable, "-m", "croupier.cli", "serve", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for flag in ("--port", "--data-root", "--max-reads", "--max-reads-per-stream", "--prefetch",
                 "--max-prefetch", "--max-buffered-mb", "--chunk-kb", "--latency-ms", "--metrics-port",
                 "--grace", "--config"):
        assert flag in out
    assert "(default 1024," in " ".join(out.split())  # --chunk-kb: under grpc's default 4 MiB receive limit
    assert "synthetic:ROWS" in out


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "server.yaml"
    cfg.write_text(
        "datasets: [a=synthetic:10]\nport: 6000\nmax_reads: 100\nchunk_samples: 16\n"
        "latency: {median_ms: 5, distribution: fixed}\n"
    )
    config = build_server_config(_serve_args("--config", str(cfg), "--port", "7000", "--latency-ms", "2",
                                             "--max-prefetch", "32"))
    assert config.datasets == ("a=synthetic:10",)
    assert config.port == 7000 and config.max_reads == 100
    assert config.limits.chunk_samples == 16 and config.limits.max_prefetch == 32
    assert config.latency is not None
    assert (config.latency.median_ms, config.latency.distribution) == (2, "fixed")


def test_serve_without_data_is_refused_with_a_hint() -> None:
    proc = subprocess.run([sys.executable, "-m", "croupier.cli", "serve"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "DATASET" in proc.stderr


def test_serve_names_a_dataset_it_cannot_open(tmp_path: Path) -> None:
    missing = tmp_path / "missing.arrow"
    proc = subprocess.run([sys.executable, "-m", "croupier.cli", "serve", str(missing), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "missing.arrow" in proc.stderr


def test_json_logs_are_one_object_a_line(serve_process) -> None:
    import json

    srv = serve_process(["rows=synthetic:10", "--log-format", "json"])
    srv.terminate()
    lines = [line for line in srv.output().splitlines() if line.startswith("{")]
    assert lines, srv.output()
    records = [json.loads(line) for line in lines]
    assert any("listening" in r["msg"] for r in records)
    assert all({"ts", "level", "logger", "msg"} <= r.keys() for r in records)
