"""The epoch plan shuffles like a uniform permutation; the tests that say so can fail."""

from __future__ import annotations

import numpy as np
import pytest

from croupier.shuffle_quality import (
    block_order,
    buffer_order,
    expected_shards_per_batch,
    looks_uniform,
    markdown_table,
    measure,
    plan_order,
    report_rows,
    uniform_order,
    uniformity_tests,
)

N, BATCH, SHARD = 50_000, 64, 1_000


def _tests(order: np.ndarray, nxt: np.ndarray | None = None) -> dict[str, float]:
    return uniformity_tests(order, batch_size=BATCH, shard_size=SHARD, next_epoch=nxt)


@pytest.mark.parametrize("seed", [0, 7])
def test_the_plan_is_statistically_indistinguishable_from_a_uniform_shuffle(seed: int) -> None:
    pvalues = _tests(plan_order(N, seed, 0), plan_order(N, seed, 1))
    assert looks_uniform(pvalues), pvalues


def test_a_numpy_uniform_shuffle_passes_the_same_tests() -> None:
    pvalues = _tests(uniform_order(N, 3), uniform_order(N, 4))
    assert looks_uniform(pvalues), pvalues


@pytest.mark.parametrize("buffer_size", [N // 100, N // 10])
def test_a_buffer_shuffle_is_flagged_as_non_uniform(buffer_size: int) -> None:
    pvalues = _tests(buffer_order(N, buffer_size, 0))
    assert not looks_uniform(pvalues)
    assert pvalues["displacement"] < 1e-6


@pytest.mark.parametrize("block_shards", [1, 8])
def test_a_block_shuffle_is_flagged_as_non_uniform(block_shards: int) -> None:
    pvalues = _tests(block_order(N, SHARD, block_shards, 0))
    assert not looks_uniform(pvalues)
    assert pvalues["shards_per_batch"] < 1e-6


def test_reference_shuffles_are_permutations() -> None:
    for order in (buffer_order(N, 100, 1), block_order(N + 7, SHARD, 3, 1), uniform_order(N, 1), plan_order(N, 1)):
        assert np.array_equal(np.sort(order), np.arange(len(order)))


def test_the_plan_figures_match_a_uniform_shuffle() -> None:
    f = measure("plan", plan_order(N, 0), BATCH, SHARD)
    u = measure("numpy", uniform_order(N, 0), BATCH, SHARD)
    assert abs(f.mean_displacement - 1 / 3) < 0.01
    assert abs(f.kendall_tau) < 0.01 and abs(f.spearman) < 0.015
    assert abs(f.shards_per_batch - expected_shards_per_batch(N, BATCH, SHARD)) < 0.5
    assert abs(f.gap_entropy_bits - u.gap_entropy_bits) < 0.02


def test_the_report_marks_only_the_plan_and_numpy_as_uniform() -> None:
    rows, expected = report_rows(n=20_000, shard_size=500)
    uniform = [r.figures.name for r in rows if r.uniform]
    assert uniform == ["croupier plan (seed, epoch 0)", "numpy uniform permutation"]
    assert len(rows) == 6
    assert "| croupier plan" in markdown_table(rows, expected)
