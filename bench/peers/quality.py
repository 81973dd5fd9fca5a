"""The shuffle quality of the order a system actually delivered, and what a resume lost or repeated.

* `global_order`: the ranks' batches interleaved step by step (rank 0's k-th batch, rank 1's
  k-th, ...): the order a synchronous data-parallel trainer consumes, the one croupier's
  global batches are cut from.
* `neighbour_entropy`: MosaicML Streaming's shuffle-quality estimate, from its documented
  definition: the Shannon entropy (bits) of the distribution of differences between
  neighbouring sample indices, the same of the shard each sample is in, and their harmonic
  mean. Written here from that definition; it depends on n, so the report gives a numpy
  uniform permutation's value beside it.
* `figures`: croupier.shuffle_quality's figures and uniformity tests on the same order.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np


def global_order(ranks: list[list[list[int]]]) -> np.ndarray:
    """ranks[r][k] = rank r's k-th batch (ids) -> one order, step by step, rank by rank."""
    out: list[int] = []
    for k in range(max((len(b) for b in ranks), default=0)):
        for batches in ranks:
            if k < len(batches):
                out += batches[k]
    return np.asarray(out, dtype=np.int64)


def _entropy_bits(values: np.ndarray) -> float:
    if len(values) == 0:
        return 0.0
    _, counts = np.unique(values, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def neighbour_entropy(order: np.ndarray, shard_rows: int) -> dict[str, float]:
    """{"sample", "shard", "harmonic"}: entropy of neighbouring differences of the sample ids and
    of their shards (`shard_rows` consecutive ids a shard), and the harmonic mean of the two."""
    order = np.asarray(order, dtype=np.int64)
    sample = _entropy_bits(np.diff(order))
    shard = _entropy_bits(np.diff(order // shard_rows))
    harmonic = 2 * sample * shard / (sample + shard) if sample + shard > 0 else 0.0
    return {"sample": sample, "shard": shard, "harmonic": harmonic}


def figures(order: np.ndarray, batch: int, shard_rows: int, next_epoch: np.ndarray | None = None) -> dict[str, Any]:
    """croupier.shuffle_quality's figures and p-values, Mosaic's entropy; on ids 0..n-1 (an order
    with repeats or holes, a peer's padded or dropped epoch, is ranked first so the figures apply)."""
    from croupier.shuffle_quality import looks_uniform, measure, uniformity_tests

    ranked = _dense(order)
    nxt = _dense(next_epoch) if next_epoch is not None and len(next_epoch) == len(order) else None
    f = measure("delivered", ranked, batch, shard_rows).as_dict()
    f.pop("name")
    p = uniformity_tests(ranked, batch_size=batch, shard_size=shard_rows, next_epoch=nxt)
    return {**f, "pvalues": p, "uniform": looks_uniform(p), "mosaic_entropy": neighbour_entropy(order, shard_rows)}


def _dense(order: np.ndarray) -> np.ndarray:
    """Ranks of the ids (ties broken by position): a permutation of 0..n-1 in the same relative order."""
    order = np.asarray(order, dtype=np.int64)
    r = np.empty(len(order), dtype=np.int64)
    r[np.argsort(order, kind="stable")] = np.arange(len(order))
    return r


def uniform_reference(n: int, batch: int, shard_rows: int, seed: int = 12345) -> dict[str, Any]:
    """The same figures for a numpy uniform permutation of n ids: what 'uniform' reads as at this n."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    return figures(order, batch, shard_rows, rng.permutation(n))


def resume_check(expected: np.ndarray, before: np.ndarray, after: np.ndarray) -> dict[str, int]:
    """Against the ids an uninterrupted epoch delivers (a multiset: a peer may pad), the ids
    delivered before the kill and after the resume: lost = still owed, repeated = delivered
    more often than in the uninterrupted epoch."""
    want = Counter(np.asarray(expected).tolist())
    got = Counter(np.asarray(before).tolist()) + Counter(np.asarray(after).tolist())
    lost = sum(max(0, c - got.get(k, 0)) for k, c in want.items())
    repeated = sum(max(0, c - want.get(k, 0)) for k, c in got.items())
    return {"expected": int(sum(want.values())), "before_kill": int(len(before)), "after_resume": int(len(after)),
            "lost": int(lost), "repeated": int(repeated), "exact": bool(lost == 0 and repeated == 0)}


def epoch_coverage(order: np.ndarray, n: int) -> dict[str, int]:
    """Of the dataset's n ids: how many an epoch delivered, missed, and delivered twice or more."""
    c = Counter(np.asarray(order).tolist())
    return {"delivered": int(len(order)), "distinct": len(c), "missed": int(n - sum(1 for k in c if 0 <= k < n)),
            "repeats": int(sum(v - 1 for v in c.values() if v > 1))}


