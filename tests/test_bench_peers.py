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
from pathlib import Path

import numpy as np
import pytest

from croupier.bench.peers import quality
from croupier.bench.peers.case import dir_bytes, first_batch_s, per_epoch
from croupier.bench.peers.runners._common import Job

RUNNERS = Path(__file__).resolve().parents[1] / "croupier" / "bench" / "peers" / "runners"


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


def test_the_goal_compares_croupier_with_the_uniform_peers_any_peer_and_the_small_cache() -> None:
    from croupier.bench.peers import report

    def row(system, variant, rate, uniform):
        return {"system": system, "label": system, "variant": variant, "dataset": "text",
                "condition": {"name": "fs"}, "epochs": [{"samples_per_s": rate, "complete": True}],
                "quality": {"uniform": uniform}, "peak_local_disk_mb": 1.0}

    rep = {"cases": [row("croupier", "default", 100.0, True), row("mosaic", "default", 90.0, True),
                     row("litdata", "default", 150.0, False), row("mosaic", "cache10", 10.0, True)]}
    g = {x["against"]: x for x in report.goal(rep)}
    assert (g["uniform peers"]["peer_rate"], g["uniform peers"]["met"]) == (90.0, True)
    assert (g["any peer"]["peer_rate"], g["any peer"]["met"], g["any peer"]["peer_uniform"]) == (150.0, False, False)
    assert g["10% cache"]["ratio"] == pytest.approx(10.0)
