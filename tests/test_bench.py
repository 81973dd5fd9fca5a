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


def test_the_real_suites_smoke_run_reads_through_fuse_and_s3(tmp_path: Path) -> None:
    """`croupier bench --suite real --quick`: every kind of system through the latency FS and the
    loopback S3 server, the storage's own counters in every case, the report's sections."""
    from croupier.bench import latencyfs

    reason = latencyfs.check_available()
    if reason:
        pytest.skip(f"latencyfs is unusable here: {reason}")
    out = tmp_path / "results"
    assert main(["bench", "--suite", "real", "--quick", "--out", str(out), "--data-dir", str(tmp_path / "data")]) == 0
    rep = json.loads((out / "real-quick.json").read_text())
    failed = [e for e in rep["errors"] if "the code changed during the run" not in e]  # a shared checkout may move
    assert failed == [] and rep["skipped"] == []
    seen = {(c["case"]["dataset"], c["condition"]["key"], c["case"]["system"]["kind"], c["role"]) for c in rep["cases"]}
    assert seen == {("text", "local", "croupier", "cpu ceiling"),
                    ("text", "fuse", "croupier", "measure"), ("text", "fuse", "hf", "measure"),
                    ("imagefolder", "fuse", "dataloader", "measure"), ("shards", "fuse", "webdataset", "measure"),
                    ("text", "s3", "croupier", "measure"), ("text", "s3", "dataloader", "measure"),
                    ("text", "s3", "hf", "measure"), ("imagefolder", "s3", "dataloader", "measure")}
    assert set(rep["conditions"]) == {"page cache (local files)", "latency FS 5 ms", "S3 20 ms"}
    assert "evict" in rep["conditions"]["latency FS 5 ms"]["eviction"]
    for c in rep["cases"]:
        assert c["samples"] > 0 and c["samples_per_s"] > 0 and c["first_batch_s"] > 0 and c["cpu_s_per_1k"] > 0
        assert c["trainer_peak_rss_mb"] > 0
        s = c["storage"]
        if c["condition"]["key"] == "local":
            assert s == {"counted": False}
            continue
        # counted at the storage: every system reads something there, at most as much at once as it can
        assert s["counted"] and s["requests"] > 0 and s["bytes"] > 0 and s["max_in_flight"] >= 1
        assert s["reads_per_sample"] > 0 and s["bytes_per_sample"] > 0 and s["polls"] >= 2
        assert s["cpu_s_per_1k"] is not None and s["c_over_l_reads_per_s"] > 0
        if c["case"]["system"]["kind"] == "croupier":
            assert c["server_peak_rss_mb"] > 0 and c["server_cpu_s_per_1k"] > 0
            assert c["extra"]["croupier_metrics"]["croupier_storage_reads"] > 0
            assert c["extra"]["server_threads_cpu_s"]
            assert c["ceiling_cpu"] > 0 and c["fraction_of_ceiling"] > 0 and c["ceiling_binding"] in ("C/L", "CPU")
    dl = next(c for c in rep["cases"] if c["case"]["dataset"] == "text" and c["condition"]["key"] == "s3"
              and c["case"]["system"]["kind"] == "dataloader")
    assert dl["storage"]["bytes_per_sample"] > 100_000  # one GET of the whole record batch per row
    assert rep["revision"] and rep["load"]["start"] and rep["load"]["end"] and rep["decode_rates"]["imagefolder"] > 0
    assert any(t["target"].startswith("text, S3") for t in rep["targets"])
    md = (out / "real-quick.md").read_text()
    for text in ("## Storage", "## Targets", "## At a glance", "## text rows", "## CPU ceiling", "reads / sample",
                 "| latency FS 5 ms | croupier unordered |", "| S3 20 ms | DataLoader + DistributedSampler, 2 workers |",
                 "Load average", "revision", "## Where the CPU goes, case by case"):
        assert text in md, text
    for name in ("throughput", "amplification"):
        assert (out / f"real-quick-{name}.png").stat().st_size > 1000


def test_the_cpu_budget_splits_a_case_by_process_and_thread_and_prices_70_percent_of_its_ceiling() -> None:
    from croupier.bench.realreport import cpu_budget_table

    case = {"role": "measure", "label": "croupier unordered", "case": {"dataset": "text"},
            "condition": {"name": "latency FS 5 ms"}, "samples": 2000, "samples_per_s": 10_000.0, "ceiling": 20_000.0,
            "cpu_s_per_1k": 0.130, "server_cpu_s_per_1k": 0.100, "storage": {"cpu_s_per_1k": 0.050},
            "extra": {"server_threads_cpu_s": {"main thread (event loop)": {"cpu": 0.12},
                                               "native read threads (blocking preads)": {"cpu": 0.06},
                                               "jemalloc_bg_thd": {"cpu": 0.0}}}}
    other = dict(case, label="DataLoader + DistributedSampler, 8 workers")
    rows = cpu_budget_table([case, other]).splitlines()[2:]
    # loop 0.06, reads 0.03, other 0.01 per 1,000; 0.18 s per 1,000 in all: 1.80 cores at 10,000/s, 2.52 at 14,000/s
    assert rows == ["| text | latency FS 5 ms | 10,000 | 0.060 | 0.030 | 0.010 | 0.030 | 0.050 | 1.80 | 14,000 | 2.52 |"]


def test_the_real_suite_plans_every_system_on_both_slow_storages() -> None:
    from croupier.bench.real import CROUPIER as C, real

    suite = real()
    assert suite.data.text_rows >= 1_000_000 and suite.data.images >= 20_000 and suite.world == 2 and suite.batch == 64
    plan = suite.plan()
    names = [cond.name for cond, _ in plan]
    assert names == ["page cache (local files)", "latency FS 5 ms", "latency FS 5 ms, kernel defaults",
                     "latency FS 5 ms, cache dropped every 0.5 s",
                     "latency FS 5 ms, kernel defaults, larger than memory (pages dropped every 0.5 s, croupier's cache "
                     "10% of the data)", "S3 20 ms", "rclone mount of S3 20 ms", "s3fs mount of S3 20 ms",
                     "page cache (local files)"]
    larger = plan[4][0]  # data larger than memory: the kernel's pages dropped, croupier's cache a tenth
    assert larger.max_background == 0 and larger.evict_every_s > 0 and larger.cache_share == 0.1
    assert {c.system.label for c in plan[4][1]} >= {C.label, "DataLoader + DistributedSampler, 8 workers"}
    for cond, group in (plan[6], plan[7]):  # a bucket through the FUSE clients users mount it with
        assert cond.key in ("rclone", "s3fs") and cond.median_ms == 20.0
        kinds = {(c.dataset, c.system.label) for c in group}
        for ds in ("text", "imagefolder"):
            assert {(ds, C.label), (ds, "DataLoader + DistributedSampler, 8 workers")} <= kinds
    assert plan[2][0].max_background == 0  # the kernel's cap on background FUSE requests, left as it is
    for cond, group in (plan[1], plan[2], plan[5]):
        kinds = {(c.dataset, c.system.label) for c in group if c.role == "measure"}
        for ds in ("text", "imagefolder"):
            assert {(ds, f"DataLoader + DistributedSampler, {w} workers") for w in (0, 2, 8)} <= kinds
            assert (ds, C.label) in kinds and (ds, "croupier ordered") in kinds
        assert ("text", "HF datasets .shuffle() + DataLoader, 2 workers") in kinds
        assert ("shards", "WebDataset, 2 workers") in kinds
    assert sum(c.role == "profile" for c in suite.cases()) == 1


def test_storage_deltas_are_taken_over_the_steady_window() -> None:
    from croupier.bench.real import Poller, steady_window

    # Two ranks whose loaders were built at t0 = 100 and 100.5 (perf_counter), 10 batches of 8 each.
    ranks = [{"t0": 100.0, "arrivals_s": [1.0 + 0.1 * k for k in range(10)], "batch_samples": [8] * 10},
             {"t0": 100.5, "arrivals_s": [1.0 + 0.1 * k for k in range(10)], "batch_samples": [8] * 10}]
    a, b, samples = steady_window(ranks, warmup=2)
    assert a == pytest.approx(101.1) and b == pytest.approx(102.4)
    assert samples == 8 * 8 + 8 * 10  # rank 0: its batches after the window opens (2..9); rank 1: all ten
    p = Poller(lambda: None)
    p.points = [(100.0, 0, 0), (101.0, 1000, 4096_000), (103.0, 3000, 12_288_000)]
    reads, nbytes = p.delta(a, b)
    assert reads == pytest.approx(1000 * (102.4 - 101.1)) and nbytes == pytest.approx(4096 * reads)


def test_the_real_suite_reads_a_bucket_through_rclone_and_s3fs_mounts(tmp_path: Path) -> None:
    """Issue 21's bucket mounts: every system given the mount's paths, the requests counted at the
    S3 server behind the mount, a fresh mount per case, and the targets against the DataLoader
    through the same mount (croupier on s3:// from the S3 condition beside it)."""
    from croupier.bench import bucket_mount
    from croupier.bench.datagen import DataSpec
    from croupier.bench.real import CROUPIER as C, RealSuite, bucket_mount as mount_condition, dataloader, run_real, s3

    why = bucket_mount.rclone_unusable() or bucket_mount.s3fs_unusable()
    if why:
        pytest.skip(f"bucket mounts unusable here: {why}")
    systems = {"text": (C, dataloader(0)), "imagefolder": (C, dataloader(0))}
    suite = RealSuite(name="real-mounts", data=DataSpec(text_rows=2_000, images=200, shard_size=100),
                      matrix=((s3(20.0), {"text": (C,), "imagefolder": (C,)}),
                              (mount_condition("rclone"), systems), (mount_condition("s3fs"), systems)),
                      ceilings=(), ceilings_again=False, world=1, batch=8, max_batches=8, max_seconds=0.3,
                      hard_seconds=4.0, steady_batches=2, steady_per_warmup=1, profile=False, decode_seconds=0.2)
    out = tmp_path / "results"
    rep = run_real(suite, out, tmp_path / "data", "test", say=lambda _: None)
    assert [e for e in rep["errors"] if "the code changed during the run" not in e] == [] and rep["skipped"] == []
    mounted = [c for c in rep["cases"] if c["condition"]["key"] in ("rclone", "s3fs")]
    assert {(c["case"]["dataset"], c["condition"]["key"], c["case"]["system"]["kind"]) for c in mounted} == {
        (ds, key, kind) for ds in ("text", "imagefolder") for key in ("rclone", "s3fs") for kind in ("croupier", "dataloader")}
    for c in mounted:
        assert c["samples"] > 0 and c["storage"]["counted"] and c["storage"]["requests"] > 0  # at the bucket
    assert "mounted again before each case" in rep["conditions"]["rclone mount of S3 20 ms"]["eviction"]
    names = {t["target"] for t in rep["targets"]}
    for key in ("rclone", "s3fs"):
        for ds in ("text", "imagefolder"):
            for how, want in (("given the mount path", 2), ("given s3://", 10)):
                assert (f"{ds}, {key} mount of S3 20 ms: croupier unordered {how} >= {want}x the best DataLoader "
                        "through the mount") in names
    md = (out / "real-mounts.md").read_text()
    assert "**rclone mount of S3 20 ms**" in md and "`rclone mount` with its defaults" in md


def test_the_real_suites_targets_hold_each_fuse_condition_to_its_own_bar() -> None:
    # Issue 21: 10x the best DataLoader for text on the raised mount, 3x on the kernel-default
    # one and on data larger than memory; each condition's rows are found by its name.
    from dataclasses import asdict

    from croupier.bench import real

    def row(cond, label: str, kind: str, rate: float) -> dict:
        return {"role": "measure", "label": label, "condition": asdict(cond), "samples_per_s": rate,
                "case": {"dataset": "text", "system": {"kind": kind}}, "storage": {"reads_per_sample": 1.0}}

    conds = (real.latency_fs(5.0), real.latency_fs_kernel_defaults(5.0), real.latency_fs_larger_than_memory())
    results = []
    for cond, (cr, dl) in zip(conds, ((8000.0, 1000.0), (7000.0, 2000.0), (4000.0, 1000.0))):
        results += [row(cond, real.CROUPIER.label, "croupier", cr),
                    row(cond, "DataLoader + DistributedSampler, 8 workers", "dataloader", dl),
                    row(cond, "DataLoader + DistributedSampler, 2 workers", "dataloader", dl / 2)]
    got = {t["target"]: t for t in real.check_targets(results)}
    raised = got["text, latency FS 5 ms: croupier unordered >= 10x the best DataLoader"]
    kernel = got["text, latency FS 5 ms, kernel defaults: croupier unordered >= 3x the best DataLoader"]
    larger = got[f"text, {conds[2].name}: croupier unordered >= 3x the best DataLoader"]
    assert raised["measured"] == pytest.approx(0.8) and not raised["met"]
    assert kernel["measured"] == pytest.approx(7000 / 6000) and kernel["met"]
    assert larger["measured"] == pytest.approx(4000 / 3000) and larger["met"]
