"""`croupier bench --suite peers` (issue 12): the harness's own arithmetic, and a real run.

The arithmetic (delivered order, Mosaic's neighbour entropy, resume accounting, the epoch
figures from the runners' JSON lines, the runners' kill protocol) needs nothing installed.
The end-to-end run needs the peers' venvs (made by the suite itself, minutes of pip the first
time: `python -m croupier.bench.peers --quick` makes them) and the latency file system; it
skips, saying which is missing, where they are not there. It runs croupier, Mosaic Streaming
and LitData on tiny text data in about a minute.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from croupier.bench.peers import quality
from croupier.bench.peers.case import dir_bytes, first_batch_s, per_epoch
from croupier.bench.peers.runners._common import Job

RUNNERS = Path(__file__).resolve().parents[1] / "bench" / "peers" / "runners"


# ---- the delivered order and its quality ------------------------------------------------------

def test_the_global_order_interleaves_the_ranks_batch_by_batch() -> None:
    ranks = [[[0, 1], [4, 5]], [[2, 3], [6]]]
    assert quality.global_order(ranks).tolist() == [0, 1, 2, 3, 4, 5, 6]


def test_neighbour_entropy_is_zero_for_storage_order_and_high_for_a_uniform_shuffle() -> None:
    n, shard = 4096, 64
    ordered = quality.neighbour_entropy(np.arange(n), shard)
    assert ordered["sample"] == 0.0  # every neighbouring difference is 1
    assert 0 < ordered["shard"] < 0.2  # 0 within a shard, 1 at each of the 63 boundaries
    shuffled = quality.neighbour_entropy(np.random.default_rng(0).permutation(n), shard)
    assert shuffled["sample"] > 10 and shuffled["shard"] > 6
    assert shuffled["harmonic"] == pytest.approx(
        2 * shuffled["sample"] * shuffled["shard"] / (shuffled["sample"] + shuffled["shard"]))


def test_the_figures_tell_a_block_shuffle_from_a_uniform_one() -> None:
    from croupier.shuffle_quality import block_order

    n = 6400
    uniform = quality.figures(np.random.default_rng(1).permutation(n), 64, 100, np.random.default_rng(2).permutation(n))
    block = quality.figures(block_order(n, 100, 1, 3), 64, 100)
    assert uniform["uniform"] and not block["uniform"]
    assert block["shards_per_batch"] < 3 < uniform["shards_per_batch"]
    assert block["mosaic_entropy"]["harmonic"] < uniform["mosaic_entropy"]["harmonic"]


def test_resume_counts_what_was_lost_and_what_was_repeated() -> None:
    expected = np.arange(10)
    exact = quality.resume_check(expected, np.arange(4), np.arange(4, 10))
    assert exact == {"expected": 10, "before_kill": 4, "after_resume": 6, "lost": 0, "repeated": 0, "exact": True}
    restarted = quality.resume_check(expected, np.arange(4), np.arange(2, 9))  # 2, 3 again; 9 never
    assert (restarted["lost"], restarted["repeated"], restarted["exact"]) == (1, 2, False)
    padded = quality.resume_check(np.array([0, 1, 2, 2]), np.array([2]), np.array([0, 1, 2]))  # a peer's padding
    assert (padded["lost"], padded["repeated"]) == (0, 0)


def test_epoch_coverage_counts_missed_and_repeated_ids() -> None:
    assert quality.epoch_coverage(np.array([0, 1, 1, 3]), 5) == {"delivered": 4, "distinct": 3, "missed": 2,
                                                                  "repeats": 1}


# ---- the figures from the runners' lines ---------------------------------------------------------

def _events(start: float, batches: list[tuple[int, float, list[int]]]) -> list[dict]:
    evs = [{"ev": "start", "t": start}]
    for epoch in sorted({e for e, _, _ in batches}):
        evs += [{"ev": "batch", "epoch": e, "t": t, "ids": ids} for e, t, ids in batches if e == epoch]
        evs.append({"ev": "epoch_end", "epoch": epoch, "t": max(t for e, t, _ in batches if e == epoch)})
    return evs


def test_epoch_rates_run_from_the_first_rank_starting_to_the_last_batch() -> None:
    r0 = _events(10.0, [(0, 11.0, [0, 1]), (0, 12.0, [4, 5]), (1, 13.0, [1, 0])])
    r1 = _events(10.5, [(0, 11.5, [2, 3]), (0, 14.0, [6, 7]), (1, 15.0, [3, 2])])
    e = per_epoch([r0, r1], 2)
    assert e[0]["samples"] == 8 and e[0]["wall_s"] == pytest.approx(4.0) and e[0]["samples_per_s"] == pytest.approx(2.0)
    assert e[1]["samples"] == 4 and e[1]["wall_s"] == pytest.approx(15.0 - 12.0)  # from rank 0's end of epoch 0
    assert e[0]["complete"] and e[1]["complete"]
    assert first_batch_s([r0, r1]) == pytest.approx(1.0)


def test_a_later_epochs_clock_starts_when_the_last_rank_passes_the_barrier() -> None:
    r0 = _events(10.0, [(0, 11.0, [0, 1]), (0, 12.0, [4, 5]), (1, 14.5, [1, 0])])
    r1 = _events(10.5, [(0, 11.5, [2, 3]), (0, 14.0, [6, 7]), (1, 15.0, [3, 2])])
    for evs in (r0, r1):  # both passed the barrier at 14.1, once rank 1 ended epoch 0
        evs.insert(next(i for i, e in enumerate(evs) if e["ev"] == "epoch_end") + 1,
                   {"ev": "epoch_start", "epoch": 1, "t": 14.1})
    e = per_epoch([r0, r1], 2)
    assert e[1]["wall_s"] == pytest.approx(15.0 - 14.1)  # not from rank 0's end of epoch 0 (12.0)
    assert e[1]["rank_spans_s"] == [[0.0, 0.4], [0.0, 0.9]]
    assert e[0]["rank_spans_s"] == [[0.0, 2.0], [0.5, 4.0]]


def test_ranks_meet_at_each_epochs_end(tmp_path: Path) -> None:
    """Two real rank processes: the fast one waits at the barrier for the slow one's end of epoch 0,
    and both say when they passed it."""
    script = tmp_path / "ranks.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(RUNNERS)!r})\n"
        "from _common import Job, run_epochs, emit, now\n"
        "job = Job.parse(sys.argv[1])\n"
        "emit('start', t=now())\n"
        "def epoch(e):\n"
        "    for i in range(3):\n"
        "        if job.rank == 1 and e == 0:\n"
        "            time.sleep(0.3)\n"
        "        yield [job.rank, i]\n"
        "run_epochs(job, epoch)\n")
    procs = [subprocess.Popen([sys.executable, str(script),
                               json.dumps(Job(system="fake", dataset="text", remote="", local="", rank=r, world=2,
                                              epochs=3, barrier=str(tmp_path / "barrier")).__dict__)],
                              stdout=subprocess.PIPE, text=True) for r in range(2)]
    out = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    ranks = [[json.loads(line) for line in o.splitlines()] for o in out]
    ended = max(e["t"] for evs in ranks for e in evs if e["ev"] == "epoch_end" and e["epoch"] == 0)
    for evs in ranks:
        passed = [e for e in evs if e["ev"] == "epoch_start"]
        assert [e["epoch"] for e in passed] == [1, 2]  # none before the first epoch, none after the last
        assert passed[0]["t"] >= ended  # the fast rank waited for the slow one
        assert all(e["t"] >= passed[0]["t"] for e in evs if e["ev"] == "batch" and e["epoch"] == 1)
    assert sorted(p.name for p in (tmp_path / "barrier").iterdir()) == [
        "epoch0.rank0", "epoch0.rank1", "epoch1.rank0", "epoch1.rank1"]


def test_local_disk_counts_the_blocks_of_every_file_below(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(b"1" * 10_000)
    (tmp_path / "y").write_bytes(b"2" * 5_000)
    assert 15_000 <= dir_bytes(tmp_path) <= 15_000 + 2 * 4096
    assert dir_bytes(tmp_path / "absent") == 0


def test_a_runner_killed_after_its_checkpoint_printed_exactly_those_batches(tmp_path: Path) -> None:
    """The kill protocol, with a stand-in loader: checkpoint after batch k on every rank, then SIGKILL."""
    script = tmp_path / "fake.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(RUNNERS)!r})\n"
        "from _common import Job, run_epochs, emit, now\n"
        "job = Job.parse(sys.argv[1])\n"
        "emit('start', t=now())\n"
        "run_epochs(job, lambda e: ([i, i + 1] for i in range(0, 20, 2)), lambda: {'next': 'x'})\n")
    job = Job(system="fake", dataset="text", remote="", local="", rank=1, world=2, epochs=2, kill_after=3,
              state_path=str(tmp_path / "state.json"))
    r = subprocess.run([sys.executable, str(script), json.dumps(job.__dict__)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == -9
    evs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [e["ids"] for e in evs if e["ev"] == "batch"] == [[0, 1], [2, 3], [4, 5]]
    assert evs[-1]["ev"] == "state" and json.loads(Path(evs[-1]["path"]).read_text()) == {"next": "x"}
    assert evs[-1]["path"].endswith(".rank1")


def test_a_killed_rank_takes_its_workers_with_it_and_its_output_is_drained(tmp_path: Path) -> None:
    """Grain's spawned workers outlive a SIGKILLed rank for seconds, holding its stdout: RankProc.wait kills
    the rank's process group, so the workers die with it and the rank's lines are read to the end."""
    import os
    import time

    from croupier.bench.peers.case import RankProc

    script = tmp_path / "rank.py"
    script.write_text(
        "import json, os, signal, subprocess, sys\n"
        "worker = subprocess.Popen(['sleep', '600'])  # inherits stdout, as a DataLoader worker does\n"
        "print(json.dumps({'ev': 'worker', 'pid': worker.pid}), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    rank = RankProc(sys.executable, str(script), {}, dict(os.environ), tmp_path / "log")
    try:
        assert rank.wait(time.monotonic() + 60) == -9
        assert not rank._reader.is_alive()  # the pipe reached its end: no process holds it any more
        (worker,) = [e["pid"] for e in rank.events if e["ev"] == "worker"]
        # A killed process closes its files before it becomes a zombie, so the pipe's end can be read while the
        # worker is still running its exit ('R'): wait, bounded, for it to be a zombie or reaped. A worker that
        # was never killed sleeps ('S') for 600 s and fails this.
        state = "S"
        for _ in range(200):
            try:
                with open(f"/proc/{worker}/stat") as f:
                    state = f.read().split(") ")[1][0]
            except FileNotFoundError:
                state = "gone"  # killed and reaped
            if state in ("Z", "X", "gone"):
                break
            time.sleep(0.05)
        assert state in ("Z", "X", "gone"), state
    finally:
        rank.kill()
        rank.close()


def test_a_runner_writes_with_its_peers_writer_and_one_without_a_writer_refuses(tmp_path: Path) -> None:
    """The runners' command line (_common.command_line): `write ARGS` prints what the writer wrote as one
    JSON line; a system that reads the benchmark's own files has nothing to write (exit status 2)."""
    script = tmp_path / "fake.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(RUNNERS)!r})\n"
        "from _common import command_line, guarded\n"
        "write = (lambda args: {'shards': args['n']}) if sys.argv[3] == 'writer' else None\n"
        "sys.exit(guarded(lambda: command_line('fake', print, write)))\n")

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=60)

    wrote = run("write", json.dumps({"n": 5}), "writer")
    assert wrote.returncode == 0 and json.loads(wrote.stdout) == {"shards": 5}
    refused = run("write", json.dumps({"n": 5}), "none")
    assert refused.returncode == 2
    assert json.loads(refused.stdout) == {"error": "fake reads the benchmark's own files; there is nothing to write"}


# ---- a real run --------------------------------------------------------------------------------

def _unavailable() -> str:
    from croupier.bench import latencyfs
    from croupier.bench.peers import venvs

    reasons = [f"{p}: {r}" for p in ("mosaic", "litdata") if (r := venvs.status(p))]
    fuse = latencyfs.check_available()
    if fuse:
        reasons.append(f"latencyfs: {fuse}")
    return "; ".join(reasons)


def test_croupier_mosaic_and_litdata_run_side_by_side_on_the_latency_fs(tmp_path: Path) -> None:
    reason = _unavailable()
    if reason:
        pytest.skip(f"peer venvs or latencyfs not available ({reason}); `python -m croupier.bench.peers --quick` "
                    "makes the venvs")
    from croupier.bench.datagen import DataSpec
    from croupier.bench.peers.suite import PeersSuite, run_peers
    from croupier.bench.real import latency_fs

    suite = PeersSuite(name="peers-test", data=DataSpec(text_rows=1_280, images=64, shard_size=64),
                       systems=("croupier", "mosaic", "litdata"), conditions=(latency_fs(2.0),), datasets=("text",),
                       epochs=2, workers=1, shards=20, variants=("default", "resume"), timeout_s=120)
    rep = run_peers(suite, tmp_path / "out", tmp_path / "data", "pytest", say=lambda s: None)
    assert rep["errors"] == []
    by = {(c["system"], c["variant"]): c for c in rep["cases"]}
    assert set(by) == {(s, v) for s in suite.systems for v in ("default", "resume")}
    for s in suite.systems:
        d = by[(s, "default")]
        assert [e["complete"] for e in d["epochs"]] == [True, True], s
        assert d["coverage"][0]["distinct"] >= 1_280 - suite.world, s  # LitData may drop up to one row per rank
        assert d["quality"]["mosaic_entropy"]["harmonic"] > 0, s
        assert d["epochs"][0]["samples_per_s"] > 0 and d["first_batch_s"] > 0, s
    assert by[("croupier", "default")]["coverage"][0] == {"delivered": 1_280, "distinct": 1_280, "missed": 0,
                                                          "repeats": 0}
    assert by[("croupier", "default")]["peak_local_disk_mb"] == 0
    assert by[("mosaic", "default")]["peak_local_disk_mb"] > 0  # whole shards in its cache
    assert by[("croupier", "resume")]["resume"]["exact"]
    for s in ("mosaic", "litdata"):
        assert "lost" in by[(s, "resume")]["resume"]
    assert set(rep["versions"]) == {"croupier", "mosaic", "litdata"}
    assert rep["versions"]["mosaic"]["mosaicml-streaming"] == "0.13.0"
    md = (tmp_path / "out" / "peers-test.md").read_text()
    assert "Mosaic Streaming" in md and "LitData" in md and "mid-epoch resume" in md


def test_croupier_mosaic_and_litdata_read_a_bucket_through_an_rclone_mount(tmp_path: Path) -> None:
    # Issue 21: the peers matrix gains the bucket mounts; every system reads the mount's paths
    # (mounted afresh before each run), and the S3 server counts what the mount asked of it.
    from croupier.bench import bucket_mount

    reason = _unavailable() or bucket_mount.rclone_unusable()
    if reason:
        pytest.skip(f"peer venvs, latencyfs or rclone not available ({reason})")
    from croupier.bench.datagen import DataSpec
    from croupier.bench.peers.suite import CACHE_CONDITIONS, PeersSuite, run_peers

    (cond,) = CACHE_CONDITIONS["rclone"]
    suite = PeersSuite(name="peers-test-rclone", data=DataSpec(text_rows=1_280, images=64, shard_size=64),
                       systems=("croupier", "mosaic", "litdata"), conditions=(cond,), datasets=("text",),
                       epochs=1, workers=1, shards=20, variants=("default",), timeout_s=180)
    rep = run_peers(suite, tmp_path / "out", tmp_path / "data", "pytest", say=lambda s: None)
    assert rep["errors"] == [] and rep["skipped"] == []
    by = {c["system"]: c for c in rep["cases"]}
    assert set(by) == set(suite.systems)
    for system, case in by.items():
        assert case["condition"]["key"] == "rclone", system
        assert case["epochs"][0]["complete"] and case["coverage"][0]["distinct"] >= 1_280 - suite.world, system
    assert by["croupier"]["coverage"][0]["missed"] == 0


def test_croupier_serves_the_images_from_tar_shards_as_a_row_of_its_own(tmp_path: Path) -> None:
    # The shards variant: the same JPEGs from datagen's WebDataset shards, each id mapped through
    # croupier's shard order; the offset index shipped beside the local shards, none through the mount.
    from croupier.bench import latencyfs

    if latencyfs.check_available():
        pytest.skip(f"latencyfs not available ({latencyfs.check_available()})")
    from croupier.bench.datagen import DataSpec
    from croupier.bench.peers.suite import PeersSuite, run_peers
    from croupier.bench.real import latency_fs

    suite = PeersSuite(name="peers-test-shards", data=DataSpec(text_rows=64, images=96, shard_size=32),
                       systems=("croupier",), conditions=(latency_fs(1.0),), datasets=("image",),
                       epochs=2, workers=1, shards=4, variants=("default", "shards"), timeout_s=120)
    rep = run_peers(suite, tmp_path / "out", tmp_path / "data", "pytest", say=lambda s: None)
    assert rep["errors"] == []
    by = {c["variant"]: c for c in rep["cases"]}
    assert set(by) == {"default", "shards"}
    for variant, case in by.items():
        assert [e["complete"] for e in case["epochs"]] == [True, True], variant
        assert case["coverage"] == [{"delivered": 96, "distinct": 96, "missed": 0, "repeats": 0}] * 2, variant
    shards = sorted((tmp_path / "data").rglob("shard-*.tar"))
    assert len(shards) == 3 and all(Path(f"{s}.idx.json").is_file() for s in shards)
    md = (tmp_path / "out" / "peers-test-shards.md").read_text()
    assert "images as WebDataset tar shards" in md


def test_the_goal_holds_croupiers_tar_shards_row_to_the_same_peers() -> None:
    from croupier.bench.peers import report

    def row(system, variant, rate):
        return {"system": system, "label": system, "variant": variant, "dataset": "image",
                "condition": {"name": "fs"}, "epochs": [{"samples_per_s": rate, "complete": True}],
                "quality": {"uniform": True}, "peak_local_disk_mb": 1.0}

    rep = {"cases": [row("croupier", "default", 100.0), row("croupier", "shards", 400.0),
                     row("mosaic", "default", 300.0)]}
    goals = [(x["against"], x["croupier_variant"], x["met"]) for x in report.goal(rep)]
    assert ("any peer", "default", False) in goals
    assert ("any peer", "images as WebDataset tar shards", True) in goals
    assert ("Mosaic's cold epoch", "images as WebDataset tar shards", True) in goals


def test_the_goal_compares_croupier_with_the_uniform_peers_any_peer_and_the_small_cache() -> None:
    from croupier.bench.peers import report

    def row(system, variant, rate, uniform):
        return {"system": system, "label": system, "variant": variant, "dataset": "text",
                "condition": {"name": "fs"}, "epochs": [{"samples_per_s": rate, "complete": True}],
                "quality": {"uniform": uniform}, "peak_local_disk_mb": 1.0}

    rep = {"cases": [row("croupier", "default", 100.0, True), row("mosaic", "default", 90.0, True),
                     row("litdata", "default", 150.0, False), row("mosaic", "cache10", 10.0, True),
                     row("croupier", "cache10", 25.0, True), row("litdata", "cache10", 9.0, False)]}
    g = {x["against"]: x for x in report.goal(rep)}
    assert (g["uniform peers"]["peer_rate"], g["uniform peers"]["met"]) == (90.0, True)
    assert (g["any peer"]["peer_rate"], g["any peer"]["met"], g["any peer"]["peer_uniform"]) == (150.0, False, False)
    assert (g["Mosaic's cold epoch"]["peer_rate"], g["Mosaic's cold epoch"]["met"]) == (90.0, True)
    # a 10% cache: croupier's own cache10 row (its server's --cache-memory), against 3x the peers' cache10 rows
    small = g["10% cache, any peer"]
    assert (small["croupier"], small["peer_rate"], small["target"]) == (25.0, 10.0, 3.0)
    assert small["ratio"] == pytest.approx(2.5) and not small["met"]
    assert g["10% cache, uniform peers"]["peer"] == "mosaic (cache = 10% of data)"


def test_a_later_epoch_is_held_to_every_peers_best_epoch_whichever_epoch_that_was() -> None:
    from croupier.bench.peers import report

    def row(system, variant, rates):
        return {"system": system, "label": system, "variant": variant, "dataset": "image",
                "condition": {"name": "fs"}, "epochs": [{"samples_per_s": x, "complete": True} for x in rates],
                "quality": {"uniform": True}, "peak_local_disk_mb": 1.0}

    rep = {"cases": [row("croupier", "default", [50.0, 200.0]), row("mosaic", "default", [300.0, 180.0]),
                     row("litdata", "cache10", [400.0, 400.0])]}  # a 10% cache row is not data that fits
    g = {(x["epoch"], x["against"]): x for x in report.goal(rep)}
    best = g[(2, "every peer's best epoch")]
    assert (best["peer_rate"], best["met"]) == (300.0, False)  # Mosaic's cold epoch, not its 180 of epoch 2
    assert (1, "every peer's best epoch") not in g and (2, "Mosaic's cold epoch") not in g
    assert "10% cache, any peer" not in {k for _, k in g}  # croupier ran no cache10 row


def test_croupiers_cache10_row_runs_its_server_with_a_cache_of_10_percent_of_the_data() -> None:
    from croupier.bench.peers import suite

    cache = suite.cache_targets()
    assert cache.name == "peers-cache"
    planned = {(c.max_background, ds, s, v) for c, ds, s, v in suite.planned(cache)}
    assert (0, "image", "croupier", "cache10") in planned  # the FUSE mount with the kernel's defaults
    assert {c.max_background for c in suite.cache_targets("both").conditions} == {0, None}
    job = Job(system="croupier", dataset="text", remote="", local="", world=2, batch=64, epochs=2, cache_limit=1234)
    assert suite.server_args(job)[:2] == ["--cache-memory", "1234"]
    assert "--cache-memory" not in suite.server_args(replace(job, cache_limit=0))  # default: the server's own


def test_the_reading_names_the_tests_that_rejected_an_order_as_not_uniform() -> None:
    from croupier.bench.peers import report

    pvalues = {"position_vs_index": 0.59, "displacement": 0.90, "gaps": 0.98, "serial": 0.76,
               "shards_per_batch": 0.25, "epochs": 0.00166}
    q = {"uniform": False, "pvalues": pvalues, "shards_per_batch": 36.2, "mosaic_entropy": {"harmonic": 8.74}}
    rep = {"cases": [{"system": "croupier", "label": "croupier", "variant": "default", "dataset": "text",
                      "condition": {"name": "fs"}, "epochs": [{"samples_per_s": 1.0, "complete": True}],
                      "quality": q, "peak_local_disk_mb": 0.0}],
           "uniform_reference": {"text": {"shards_per_batch": 36.3, "mosaic_entropy": {"harmonic": 8.75}}},
           "data": {"text_rows": 24_000, "images": 6_000}, "shards": 50}
    line = next(x for x in report.reading(rep).splitlines() if "is not uniform" in x)
    # The one test under the Bonferroni level (0.01 / 6) is named, with its p-value; the others are not.
    assert "rejected by epochs p = 0.00166, against a Bonferroni level of 0.00167" in line
    assert "shards_per_batch p" not in line and "displacement p" not in line


# ---- tf.data service on S3: tensorflow-io in its own venv, a relay out of the service's namespace ------

def test_tf_data_runs_on_s3_in_the_tensorflow_io_venv() -> None:
    from croupier.bench.peers import suite, venvs

    assert suite.venv_of("tfdata", "s3") == "tfdata-s3"
    assert suite.venv_of("tfdata", "fuse") == "tfdata" and suite.venv_of("mosaic", "s3") == "mosaic"
    assert suite.not_run("tfdata", "s3", "text") == "" and suite.not_run("tfdata", "s3", "image") == ""
    assert suite.not_run("torchdata", "s3", "text")  # still not run, and said why
    planned = {(c.key, ds, s, v) for c, ds, s, v in suite.planned(suite.full())}
    assert {("s3", ds, "tfdata", v) for ds in ("text", "image") for v in ("default", "strongest")} <= planned
    assert suite.needed_venvs(suite.full())[-1] == "tfdata-s3"  # beside tfdata's own (its writer runs there)
    assert "tfdata-s3" not in suite.needed_venvs(suite.quick())
    env = venvs.PEERS["tfdata-s3"]
    # tensorflow-io 0.37.1 is built for TensorFlow 2.16.x (its README's table; its extra pins >=2.16,<2.17).
    assert "tensorflow-io==0.37.1" in env.requirements and not env.needs_torch
    assert any(r.startswith("tensorflow-cpu==2.16.") for r in env.requirements)
    assert "tensorflow-io" in env.key_packages


def _run_tfdata_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_tfdata_under_test", RUNNERS / "run_tfdata.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tf_data_on_s3_is_configured_the_way_tensorflow_io_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import types
    from unittest import mock

    monkeypatch.syspath_prepend(str(RUNNERS))
    run_tfdata = _run_tfdata_module()
    imported = []
    fake_tfio = types.ModuleType("tensorflow_io")
    fake_tfio.__version__ = "0.37.1"
    monkeypatch.setitem(sys.modules, "tensorflow_io", fake_tfio)
    monkeypatch.setattr("builtins.__import__", _recording_import(imported))
    fake_tf = types.SimpleNamespace(__version__="2.16.2")
    with mock.patch.dict(os.environ, clear=False):
        for k in ("S3_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
            os.environ.pop(k, None)
        on_files = Job(system="tfdata", dataset="text", remote="/mnt/latencyfs/peers/tfdata-text", local="")
        assert run_tfdata.s3_setup(on_files, fake_tf) == "" and "S3_ENDPOINT" not in os.environ
        assert "tensorflow_io" not in imported and not run_tfdata._S3
        on_s3 = Job(system="tfdata", dataset="text", remote="s3://bench/peers/tfdata-text", local="",
                    endpoint="http://127.0.0.1:9123")
        note = run_tfdata.s3_setup(on_s3, fake_tf)
        assert os.environ["S3_ENDPOINT"] == "http://127.0.0.1:9123"  # the scheme makes it plain HTTP
        assert os.environ["AWS_ACCESS_KEY_ID"] and os.environ["AWS_SECRET_ACCESS_KEY"] and os.environ["AWS_REGION"]
        assert "tensorflow_io" in imported and run_tfdata._S3  # registers s3://; the runner then exits with os._exit
        assert "tensorflow-io 0.37.1" in note and "TensorFlow 2.16.2" in note and "relay" in note


def _recording_import(seen: list[str]):
    import builtins

    real = builtins.__import__

    def imp(name, *a, **k):
        seen.append(name)
        return real(name, *a, **k)

    return imp


def test_the_relay_takes_s3_requests_out_of_a_loopback_only_namespace(tmp_path: Path) -> None:
    """The way from the tf.data service's namespace to the S3 server: TCP on the namespace's loopback,
    the same port as the server's -> a Unix socket -> the server; every request reaches it (and waits its latency)."""
    import shutil
    import urllib.parse

    from croupier.bench import s3server
    from croupier.bench.peers.case import S3Relay

    sys.path.insert(0, str(RUNNERS))
    try:
        from _relay import tcp_to_unix
    finally:
        sys.path.remove(str(RUNNERS))
    body = bytes(range(256)) * 1000
    with s3server.running(tmp_path / "root", latency=5) as srv:
        srv.create_bucket("bench")
        srv.put("bench", "peers/x.tfrecord", body)
        port = urllib.parse.urlsplit(srv.endpoint).port
        with S3Relay(srv.endpoint, tmp_path / "relay.log") as relay:
            # In this namespace (a port of its own): ranged GETs and a HEAD, on one keep-alive connection.
            import http.client

            inner = tcp_to_unix("127.0.0.1", 0, relay.path)
            srv.reset_stats()
            try:
                c = http.client.HTTPConnection("127.0.0.1", inner.getsockname()[1], timeout=30)
                for a, b in ((0, 9), (1000, 200_999), (255_990, 255_999)):
                    c.request("GET", "/bench/peers/x.tfrecord", headers={"Range": f"bytes={a}-{b}"})
                    r = c.getresponse()
                    assert (r.status, r.read()) == (206, body[a:b + 1])
                c.request("HEAD", "/bench/peers/x.tfrecord")
                r = c.getresponse()
                r.read()
                assert (r.status, r.getheader("Content-Length")) == (200, str(len(body)))
                c.close()
            finally:
                inner.close()
            assert srv.stats()["requests"] == 4  # all reached the server, each delayed there
            # In a loopback-only network namespace, on the server's own port (what run_tfdata.py's group does).
            if shutil.which("unshare") is None or subprocess.run(["unshare", "--net", "true"]).returncode != 0:
                pytest.skip("no `unshare --net` here (needs root or user namespaces)")
            script = (
                "import http.client, subprocess, sys\n"
                f"sys.path.insert(0, {str(RUNNERS)!r})\n"
                "from _relay import tcp_to_unix\n"
                "subprocess.run(['ip', 'link', 'set', 'lo', 'up'], check=True)\n"
                f"tcp_to_unix('127.0.0.1', {port}, {relay.path!r})\n"
                f"c = http.client.HTTPConnection('127.0.0.1', {port}, timeout=30)\n"
                "c.request('GET', '/bench/peers/x.tfrecord', headers={'Range': 'bytes=5-14'})\n"
                "r = c.getresponse(); print(r.status, r.read().hex())\n")
            srv.reset_stats()
            out = subprocess.run(["unshare", "--net", sys.executable, "-c", script], capture_output=True, text=True,
                                 timeout=60)
            assert out.returncode == 0, out.stderr
            assert out.stdout.split() == ["206", body[5:15].hex()]
            assert srv.stats()["requests"] == 1


def test_tf_data_service_reads_s3_through_tensorflow_io(tmp_path: Path) -> None:
    import shutil

    from croupier.bench.peers import venvs

    reasons = [f"{p}: {r}" for p in ("tfdata", "tfdata-s3") if (r := venvs.status(p))]
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--net", "true"]).returncode != 0:
        reasons.append("no `unshare --net` here")
    if reasons:
        pytest.skip(f"tf.data venvs or network namespaces not available ({'; '.join(reasons)}); "
                    "`python -m croupier.bench.peers --systems tfdata --only S3` makes the venvs")
    from croupier.bench.datagen import DataSpec
    from croupier.bench.peers.suite import PeersSuite, run_peers
    from croupier.bench.real import s3

    suite = PeersSuite(name="peers-tfdata-s3-test", data=DataSpec(text_rows=640, images=64, shard_size=64),
                       systems=("tfdata",), conditions=(s3(5.0),), datasets=("text",), epochs=2, workers=1,
                       shards=10, variants=("default",), timeout_s=180)
    rep = run_peers(suite, tmp_path / "out", tmp_path / "data", "pytest", say=lambda s: None)
    assert rep["errors"] == [] and rep["skipped"] == []
    (case,) = rep["cases"]
    assert case["venv"] == "tfdata-s3" and rep["versions"]["tfdata-s3"]["tensorflow-io"] == "0.37.1"
    assert [e["complete"] for e in case["epochs"]] == [True, True]
    assert case["coverage"][0] == {"delivered": 640, "distinct": 640, "missed": 0, "repeats": 0}
    assert case["storage"]["requests"] > 0 and case["storage"]["bytes"] >= rep["written"]["tfdata text"]["bytes"]
    assert any("tensorflow-io" in n for n in case["notes"])


# ---- Lance, dataloader-rs, Grain + ArrayRecord (issue 21, item 6) ---------------------------------------

def test_lance_grain_and_dataloader_rs_are_wired_into_the_matrix() -> None:
    from croupier.bench.peers import report, suite, venvs

    full = suite.full()
    assert {"lance", "dataloader-rs", "grain"} <= set(full.systems)
    planned = {(c.key, ds, s, v) for c, ds, s, v in suite.planned(full)}
    for key in ("fuse", "s3"):  # Lance reads S3 natively (object_store): both storages, both of its loaders
        assert {(key, ds, "lance", v) for ds in ("text", "image") for v in ("default", "loader")} <= planned
    assert ("fuse", "text", "grain", "resume") in planned  # Grain's exact checkpoints are checked
    assert suite.not_run("grain", "s3", "image") and suite.not_run("grain", "fuse", "text") == ""
    assert suite.not_run("dataloader-rs", "s3", "text") and suite.not_run("dataloader-rs", "s3", "image") == ""
    assert "dataloader-rs" in suite.OWN_FILES  # the files the DataLoader baseline reads, no writer of its own
    assert {"lance", "dataloader-rs", "grain"} <= set(suite.needed_venvs(full))
    assert venvs.PEERS["lance"].requirements[0] == "pylance==14.0.2" and venvs.PEERS["lance"].needs_torch
    assert not venvs.PEERS["grain"].needs_torch
    assert {"grain==0.2.18", "array-record==0.8.6"} <= set(venvs.PEERS["grain"].requirements)
    assert venvs.PEERS["dataloader-rs"].requires_python == (3, 13)
    assert report.VARIANT_NAMES["loader"] and "lance" in report.NO_RESUME


def test_the_new_peers_run_on_the_storage_people_mount_each_epoch_cut_alike() -> None:
    from croupier.bench.peers import report, suite

    mounts = suite.on_mounts()
    assert mounts.name == "peers-mounts" and mounts.name in report.ISSUE_RUNS
    planned = {(c.name, ds, s, v) for c, ds, s, v in suite.planned(mounts)}
    names = [c.name for c in mounts.conditions]
    assert names == ["latency FS 5 ms, kernel defaults", "rclone mount of S3 20 ms", "s3fs mount of S3 20 ms"]
    for name in names:
        assert {(name, ds, s, "default") for ds in ("text", "image")
                for s in ("croupier", "lance", "grain", "dataloader-rs")} <= planned
        assert (name, "image", "lance", "loader") in planned and (name, "image", "croupier", "shards") in planned
    # every system's epoch is cut at the same 30 s (a cache10 row keeps its own cut)
    assert {suite.epoch_cut(mounts, v) for v in ("default", "loader", "shards")} == {30.0}
    assert suite.epoch_cut(suite.full(), "default") == 0.0 and suite.epoch_cut(suite.full(), "cache10") == 60.0


def test_a_peer_that_needs_a_newer_python_is_recorded_and_no_venv_is_made(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from croupier.bench.peers import venvs

    monkeypatch.setattr(venvs, "ROOT", tmp_path)
    env = venvs.PeerEnv("future-peer", ("future-peer==1.0",), requires_python=(99, 0))
    monkeypatch.setitem(venvs.PEERS, env.name, env)
    with pytest.raises(venvs.VenvError, match=r"future-peer==1.0 requires Python >= 99.0 \(its Requires-Python\); "
                                              r"this machine's python is 3\."):
        venvs.ensure(env, say=lambda s: None)
    assert not env.path.exists()  # nothing installed, not even torch
    assert "requires Python >= 99.0" in venvs.status(env.name)
    assert venvs._python_too_old(venvs.PeerEnv("old-enough", ("x",), requires_python=(3, 0))) == ""


def test_a_peer_that_needs_a_newer_python_gets_one_found_on_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    # dataloader-rs needs Python >= 3.13: its venv is made with a newer Python the machine has
    # ($CROUPIER_PEER_PYTHON, pythonX.Y on the PATH, pyenv's), each checked by running it.
    import sys

    from croupier.bench.peers import venvs

    mine = sys.version_info[:2]
    monkeypatch.setenv(venvs.NEWER_PYTHON_ENV, sys.executable)
    assert venvs.newer_python(mine) == sys.executable
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(venvs.Path, "home", staticmethod(lambda: Path("/nonexistent")))
    assert venvs.newer_python((mine[0], mine[1] + 1)) is None  # ours is too old, and nothing else is found
    assert venvs.base_python(venvs.PeerEnv("old-enough", ("x",))) == sys.executable
    assert not venvs.PEERS["dataloader-rs"].needs_torch  # torch's 3.13 wheels on the index are CUDA builds


def test_the_shared_memory_a_killed_peer_leaves_is_removed_but_not_what_a_live_process_maps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Grain's spawned workers, SIGKILLed with the rank in the resume case, leave their psm_ segments and
    sem.mp- semaphores in /dev/shm; the harness removes those the case made, unless a process still maps one."""
    import os

    from croupier.bench.peers import suite

    shm = tmp_path / "shm"
    shm.mkdir()
    names = ["psm_0a1b2c3d", "sem.mp-x1y2z3", "psm_ffff0000", "other_file", "psm_old00001"]
    for n in names:
        (shm / n).write_bytes(b"")
    real_listdir, real_unlink = os.listdir, os.unlink
    monkeypatch.setattr(suite.os, "listdir", lambda p: real_listdir(shm) if p == "/dev/shm" else real_listdir(p))
    monkeypatch.setattr(suite.os, "unlink", lambda p: real_unlink(str(p).replace("/dev/shm", str(shm))))
    monkeypatch.setattr(suite, "_mapped_shm", lambda: {"psm_ffff0000"})
    rec = {"problems": []}
    suite._shm_cleanup(rec, "grain", before={"psm_old00001"})
    assert sorted(real_listdir(shm)) == ["other_file", "psm_ffff0000", "psm_old00001"] and rec["problems"] == []
    suite._shm_cleanup(rec, "lance", before=set())  # a system that leaves none: nothing touched
    assert len(real_listdir(shm)) == 3


def _skip_without(peers: tuple[str, ...], how: str) -> None:
    """Skip unless the peers' venvs and latencyfs are here, saying the command that makes them."""
    from croupier.bench import latencyfs
    from croupier.bench.peers import venvs

    reasons = [f"{p}: {r}" for p in peers if (r := venvs.status(p))]
    if latencyfs.check_available():
        reasons.append(f"latencyfs: {latencyfs.check_available()}")
    if reasons:
        pytest.skip(f"peer venvs or latencyfs not available ({'; '.join(reasons)}); `python -m croupier.bench.peers "
                    f"--systems {','.join(peers)} --text-rows 640 --images 64 --out /tmp/peers-new` {how}")


def test_lance_and_grain_run_beside_each_other_on_the_latency_fs_and_lance_on_s3(tmp_path: Path) -> None:
    _skip_without(("lance", "grain"), "makes the venvs")
    from croupier.bench.datagen import DataSpec
    from croupier.bench.peers.suite import PeersSuite, not_run, run_peers
    from croupier.bench.real import latency_fs, s3

    suite = PeersSuite(name="peers-lance-grain-test", data=DataSpec(text_rows=640, images=64, shard_size=64),
                       systems=("lance", "grain"), conditions=(latency_fs(2.0), s3(5.0)), datasets=("text", "image"),
                       epochs=2, workers=1, shards=10, variants=("default", "loader", "resume"), timeout_s=120)
    rep = run_peers(suite, tmp_path / "out", tmp_path / "data", "pytest", say=lambda s: None)
    assert rep["errors"] == []
    by = {(c["system"], c["variant"], c["dataset"], c["condition"]["key"]): c for c in rep["cases"]}
    want = {(s, v, ds, key) for ds in ("text", "image") for s, v, key in
            (("lance", "default", "fuse"), ("lance", "loader", "fuse"), ("lance", "default", "s3"),
             ("lance", "loader", "s3"), ("grain", "default", "fuse"), ("grain", "resume", "fuse"))}
    assert set(by) == want
    assert sorted(rep["skipped"]) == sorted(f"{ds} | S3 5 ms | Grain + ArrayRecord | {v}: {not_run('grain', 's3', ds)}"
                                            for ds in ("text", "image") for v in ("default", "resume"))
    for (system, variant, ds, key), c in by.items():
        if variant == "resume":
            continue
        rows = 640 if ds == "text" else 64
        assert [e["complete"] for e in c["epochs"]] == [True, True], (system, variant, ds, key)
        for cov in c["coverage"]:  # every row once per epoch, all ranks together
            assert cov == {"delivered": rows, "distinct": rows, "missed": 0, "repeats": 0}, (system, variant, ds, key)
        assert c["storage"]["requests"] > 0, (system, variant, ds, key)  # read through the mount / from the bucket
    for ds in ("text", "image"):
        assert by[("grain", "resume", ds, "fuse")]["resume"]["exact"], ds  # Grain's exact checkpoints
    assert rep["versions"]["lance"]["pylance"] == "14.0.2"
    assert (rep["versions"]["grain"]["grain"], rep["versions"]["grain"]["array-record"]) == ("0.2.18", "0.8.6")
    assert rep["written"]["lance text"]["shards"] == 10 and rep["written"]["grain image"]["shards"] == 10
    md = (tmp_path / "out" / "peers-lance-grain-test.md").read_text()
    assert "Grain + ArrayRecord" in md and "its torch loader" in md and "| Lance |" in md


def test_dataloader_rs_reads_every_row_once_an_epoch_through_the_latency_fs_and_images_from_s3(tmp_path: Path) -> None:
    _skip_without(("dataloader-rs",), "makes the venv (with a Python >= 3.13 on the machine)")
    from croupier.bench.datagen import DataSpec
    from croupier.bench.peers.suite import PeersSuite, not_run, run_peers
    from croupier.bench.real import latency_fs, s3

    suite = PeersSuite(name="peers-dataloader-rs-test", data=DataSpec(text_rows=640, images=64, shard_size=64),
                       systems=("dataloader-rs",), conditions=(latency_fs(2.0), s3(5.0)), datasets=("text", "image"),
                       epochs=2, workers=1, shards=10, variants=("default",), timeout_s=120)
    rep = run_peers(suite, tmp_path / "out", tmp_path / "data", "pytest", say=lambda s: None)
    assert rep["errors"] == []
    by = {(c["dataset"], c["condition"]["key"]): c for c in rep["cases"]}
    assert set(by) == {("text", "fuse"), ("image", "fuse"), ("image", "s3")}
    assert rep["skipped"] == [f"text | S3 5 ms | dataloader-rs | default: {not_run('dataloader-rs', 's3', 'text')}"]
    for (ds, key), c in by.items():
        rows = 640 if ds == "text" else 64
        assert [e["complete"] for e in c["epochs"]] == [True, True], (ds, key)
        for cov in c["coverage"]:  # every row once per epoch, all ranks together
            assert cov == {"delivered": rows, "distinct": rows, "missed": 0, "repeats": 0}, (ds, key)
    assert by[("text", "fuse")]["quality"]["mean_displacement"] > 0.2  # a global shuffle, not storage order
    assert rep["versions"]["dataloader-rs"]["dataloader-rs"] == "0.2.0"
    assert rep["versions"]["dataloader-rs"]["python"].startswith("3.13")
