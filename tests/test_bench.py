"""`croupier bench`: the smoke suite writes its outputs; the figures are computed as documented."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from croupier.bench import baselines, report
from croupier.bench.cases import (
    CROUPIER,
    CROUPIER_ORDERED,
    NO_WAIT,
    PAGE_CACHE,
    Case,
    aggregate,
    dataloader,
    latency,
)
from croupier.cli import main


@pytest.mark.slow
def test_the_quick_suite_writes_json_markdown_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "results"
    assert main(["bench", "--quick", "--out", str(out), "--data-dir", str(tmp_path / "data")]) == 0
    rep = json.loads((out / "quick.json").read_text())
    assert rep["errors"] == []
    systems = {(c["case"]["dataset"], c["case"]["storage"]["name"], c["case"]["system"]["kind"]) for c in rep["cases"]}
    assert systems == {("text", "page cache", "croupier"), ("text", "page cache", "dataloader"),
                       ("text", "5 ms lognormal", "croupier"), ("text", "5 ms lognormal", "dataloader"),
                       ("shards", "5 ms lognormal", "webdataset")}
    for c in rep["cases"]:
        assert c["samples"] > 0 and c["samples_per_s"] > 0 and c["batches"] >= 2 * c["case"]["world"]
        assert c["cpu_s_per_1k"] > 0 and c["trainer_peak_rss_mb"] > 0 and c["fraction_of_ceiling"] > 0
        assert (c["server_peak_rss_mb"] is not None) == (c["case"]["system"]["kind"] == "croupier")
    curves = rep["curves"]
    assert [p["reads_in_flight"] for p in curves["reads_in_flight"]] == [64]
    assert [p["streams"] for p in curves["streams"]] == [1, 4] and all(p["errors"] == 0 for p in curves["streams"])
    assert curves["planner"][-1]["rows"] == 10**9 and curves["planner"][-1]["numpy_peak_mb"] is None
    assert [r["uniform"] for r in rep["shuffle_quality"]["rows"]][:2] == [True, True]
    assert {t["target"].split(":")[1].strip() for t in rep["targets"]} >= {"unordered >= 10x best DataLoader"}
    md = (out / "quick.md").read_text()
    assert "## Targets" in md and "| 5 ms lognormal | croupier unordered |" in md and "## Shuffle quality" in md
    for name in ("throughput", "in-flight", "streams", "planner"):
        assert (out / f"quick-{name}.png").stat().st_size > 1000


def test_the_baselines_sleep_the_servers_latency_distribution(monkeypatch) -> None:
    from croupier.server.readers.latency import LatencySampler

    slept: list[float] = []
    monkeypatch.setattr(baselines.time, "sleep", slept.append)
    lat = baselines.Latency(median_ms=5.0, sigma=0.5, seed=3)
    ds = baselines.LatencyDataset(list(range(100)), lat, rank=1)
    assert [ds[i] for i in range(50)] == list(range(50))
    expected = LatencySampler("lognormal", 5.0, 0.5, 3 * 1_000_003 + 1000)
    assert slept == [expected() for _ in range(50)]
    assert 0.004 < float(np.median(slept)) < 0.006


def _rank(arrivals: list[float], batch: int = 10) -> dict:
    return {"arrivals_s": arrivals, "batch_samples": [batch] * len(arrivals), "samples": batch * len(arrivals),
            "bytes": 100 * batch * len(arrivals), "cpu_s": 1.0, "peak_rss_mb": 50.0, "workers_private_rss_mb": 0.0}


def test_steady_throughput_leaves_out_the_warmup_burst_and_sums_ranks() -> None:
    # 40 batches: a burst of 10 at t=5 (read ahead while the first was awaited), then one every 0.1 s.
    arrivals = [5.0] * 10 + [5.0 + 0.1 * k for k in range(1, 31)]
    system = CROUPIER_ORDERED  # warm-up of 2 batches: the burst is longer, so 10% (4) of 40 is left out
    r = aggregate(Case("text", PAGE_CACHE, system), [_rank(arrivals), _rank(arrivals)], reads_in_flight=1)
    assert r.samples_per_s == pytest.approx(2 * 36 * 10 / 3.0)
    warm = CROUPIER.warmup_batches()
    assert warm >= 9  # the server's window of batches plus the Loader's buffer
    r = aggregate(Case("text", PAGE_CACHE, CROUPIER), [_rank(arrivals), _rank(arrivals)], reads_in_flight=1)
    assert r.samples_per_s == pytest.approx(2 * (40 - warm) * 10 / (arrivals[-1] - arrivals[warm - 1]))
    assert r.first_batch_s == 5.0 and r.samples == 800 and r.batches == 80
    assert r.cpu_s_per_1k == pytest.approx(1000 * 2.0 / 800)


def _result(system, storage, rate: float, reads: int = 4) -> dict:
    r = aggregate(Case("text", storage, system), [_rank([0.0, 1.0, 2.0])], reads_in_flight=reads).as_dict()
    r["samples_per_s"] = rate
    return report.derive(r, {"text": 1e6}, cores=2)


def test_targets_compare_with_the_best_dataloader_and_the_ceiling() -> None:
    five = latency(5)
    results = [
        _result(CROUPIER, five, 5_000, reads=640),
        _result(dataloader(2), five, 600),
        _result(dataloader(8), five, 1_000),
        _result(CROUPIER, PAGE_CACHE, 50_000),
        _result(dataloader(2), PAGE_CACHE, 10_000),
    ]
    report.finish(results)
    assert results[0]["vs_best_baseline"] == pytest.approx(5.0)
    assert results[0]["ceiling_binding"] == "CPU" and results[0]["ceiling"] == 50_000
    targets = {t["target"]: t for t in report.check_targets("full", results)}
    assert not targets["text, 5 ms lognormal: unordered >= 10x best DataLoader"]["met"]
    assert not targets["text, 5 ms lognormal: unordered >= 0.7 of ceiling"]["met"]
    assert targets["text, page cache: unordered not slower than best DataLoader"]["met"]
    assert "| 5 ms lognormal | croupier unordered |" in report.results_table(results, "text")


def test_the_cpu_ceiling_is_the_better_of_the_no_wait_runs() -> None:
    # Measured at the start and at the end of a suite: a run that other jobs slowed down
    # must not make croupier look faster than its ceiling.
    five = latency(5)
    results = [_result(CROUPIER, NO_WAIT, 38_000), _result(CROUPIER, five, 40_000, reads=512),
               _result(CROUPIER, NO_WAIT, 60_000)]
    report.finish(results)
    assert results[1]["ceiling_cpu"] == 60_000 and results[1]["fraction_of_ceiling"] == pytest.approx(40 / 60)
