"""`croupier loadtest` counts what the server counted, and stays bounded."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest

from croupier.cli import main
from croupier.loadtest import LoadOptions, render_request, run_load


def _metrics(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def _value(text: str, name: str, labels: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _wait_for(port: int, name: str, labels: str, want: float, seconds: float = 10.0) -> float:
    # A stream's outcome is counted as its handler exits, just after the client saw the end.
    deadline = time.monotonic() + seconds
    got = _value(_metrics(port), name, labels)
    while got != want and time.monotonic() < deadline:
        time.sleep(0.05)
        got = _value(_metrics(port), name, labels)
    return got


def test_counts_match_the_server_metrics(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=["rows=synthetic:4000:32"], metrics_port=0)
    data = '{"dataset": "rows", "batch_size": 16, "world_size": 4, "rank": {{.WorkerID}}, "end_batch": 5}'
    report = run_load(LoadOptions(target=srv.address, data=data, concurrency=4, connections=2, total=12))
    port = srv.running.metrics_port
    assert report["calls"] == report["ok"] == 12
    assert report["status_codes"] == {"OK": 12}
    assert report["samples"] == 12 * 5 * 16
    assert report["batches"] == report["batch_latency"]["count"] == 12 * 5
    assert _wait_for(port, "croupier_streams_total", 'code="OK"', 12) == 12
    assert _value(_metrics(port), "croupier_samples_served_total", 'dataset="rows"') == report["samples"]
    assert _value(_metrics(port), "croupier_batches_completed_total", 'dataset="rows"') == report["batches"]
    assert set(report["time_to_first_sample"]["percentiles"]) == {"p50", "p90", "p99", "p99.9"}


def test_errors_are_counted_by_status_code_like_the_server(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=["rows=synthetic:100"], metrics_port=0)
    report = run_load(LoadOptions(target=srv.address, data='{"dataset": "missing", "batch_size": 8}',
                                  concurrency=3, total=7))
    assert report["status_codes"] == {"NOT_FOUND": 7} and report["ok"] == 0
    assert _wait_for(srv.running.metrics_port, "croupier_streams_total", 'code="NOT_FOUND"', 7) == 7


def test_a_duration_run_stops_and_reports_warmup_apart(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=["rows=synthetic:2000:8"], metrics_port=0)
    report = run_load(LoadOptions(target=srv.address, data='{"dataset": "rows", "batch_size": 10, "end_batch": 2}',
                                  concurrency=2, total=None, duration_s=0.3, warmup_s=0.2))
    assert report["warmup"]["calls"] >= 1 and report["calls"] >= 1
    assert report["ok"] == report["calls"]
    total = report["calls"] + report["warmup"]["calls"]
    assert _wait_for(srv.running.metrics_port, "croupier_streams_total", 'code="OK"', total) == total


def test_the_command_writes_json(serve_inprocess, tmp_path: Path) -> None:
    srv = serve_inprocess(datasets=["rows=synthetic:500:8"])
    out = tmp_path / "report.json"
    rc = main(["loadtest", srv.address, "-c", "2", "-n", "4", "--format", "json", "--output", str(out),
               "-d", '{"dataset": "rows", "batch_size": 50, "end_batch": 3}'])
    report = json.loads(out.read_text())
    assert rc == 0 and report["ok"] == 4 and report["samples"] == 4 * 150


def test_templates_and_bad_requests() -> None:
    req = render_request('{"dataset": "r", "batchSize": 8, "rank": {{.WorkerID}}, "seed": {{.RequestNumber}}}', 9, 3)
    assert (req.rank, req.seed, req.batch_size) == (3, 9, 8)
    with pytest.raises(ValueError, match="StreamEpochRequest"):
        render_request('{"no_such_field": 1}', 0, 0)
    with pytest.raises(ValueError, match="bounded"):
        LoadOptions(total=None, duration_s=None)
