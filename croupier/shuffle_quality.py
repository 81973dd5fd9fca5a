"""How well a shuffle mixes: croupier's epoch plan against a uniform shuffle and the
buffer and block shuffles that streaming loaders use instead.

Every shuffle here is an *order*: `order[p]` is the dataset index served at position
p of the epoch. The reference shuffles are pure functions of their arguments:

* `uniform_order`: numpy's `permutation`, the ideal full shuffle.
* `buffer_order`: WebDataset's `.shuffle(k)` / tf.data's `shuffle(k)`: stream the rows
  in storage order through a buffer of k, emit a random buffered row for each new one.
  An index can move forward by at most about k, so the order stays close to storage order.
* `block_order`: MosaicML Streaming's py1s/py1b family: shuffle the order of shards of
  S consecutive rows, then shuffle the rows within blocks of K shards. A batch draws
  from only a few shards.

`measure` computes the figures of the report; `uniformity_tests` runs the statistical
tests that decide whether an order is distinguishable from a uniform shuffle. With fixed
seeds every figure and verdict is deterministic.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

GAP_BINS = 64


# ---- orders -----------------------------------------------------------------------
def plan_order(n: int, seed: int = 0, epoch: int = 0) -> np.ndarray:
    """croupier's epoch order: the permutation P that global batches are cut from."""
    from croupier.protocol.epoch_plan import Permutation

    return Permutation(n, seed, epoch)(np.arange(n, dtype=np.uint64)).astype(np.int64)


def uniform_order(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n)


def buffer_order(n: int, buffer_size: int, seed: int = 0) -> np.ndarray:
    """Rows in storage order through a shuffle buffer of `buffer_size`."""
    rng = np.random.default_rng(seed)
    slots = rng.integers(0, buffer_size, size=n).tolist()
    buf: list[int] = []
    out: list[int] = []
    for i in range(n):
        if len(buf) < buffer_size:
            buf.append(i)
            continue
        k = slots[i]
        out.append(buf[k])
        buf[k] = i
    out.extend(np.asarray(buf)[rng.permutation(len(buf))].tolist())
    return np.asarray(out, dtype=np.int64)


def block_order(n: int, shard_size: int, block_shards: int = 1, seed: int = 0) -> np.ndarray:
    """Shards of `shard_size` rows in random order, rows shuffled within blocks of shards."""
    rng = np.random.default_rng(seed)
    shards = np.arange(math.ceil(n / shard_size))
    rows = np.concatenate([np.arange(s * shard_size, min((s + 1) * shard_size, n)) for s in rng.permutation(shards)])
    block = shard_size * block_shards
    for lo in range(0, n, block):
        rows[lo : lo + block] = rng.permutation(rows[lo : lo + block])
    return rows


# ---- figures ----------------------------------------------------------------------
@dataclass(frozen=True)
class ShuffleFigures:
    """What the report shows for one order (n rows, batches of `batch_size`)."""

    name: str
    n: int
    kendall_tau: float
    spearman: float
    #: mean |order[p] - p| / n: 1/3 for a uniform shuffle, 0 for none.
    mean_displacement: float
    #: distinct shards (of `shard_size` rows) in a batch, averaged over batches.
    shards_per_batch: float
    #: Shannon entropy (bits) of consecutive index gaps in GAP_BINS bins over [-n, n].
    gap_entropy_bits: float

    def as_dict(self) -> dict:
        return asdict(self)


def distinct_shards_per_batch(order: np.ndarray, batch_size: int, shard_size: int) -> np.ndarray:
    usable = len(order) // batch_size * batch_size
    shards = np.sort((order[:usable] // shard_size).reshape(-1, batch_size), axis=1)
    return 1 + (np.diff(shards, axis=1) != 0).sum(axis=1)


def expected_shards_per_batch(n: int, batch_size: int, shard_size: int) -> float:
    """For a uniform shuffle: each shard is missed by a batch with hypergeometric odds."""
    full, rest = divmod(n, shard_size)
    miss = [math.exp(_log_comb(n - s, batch_size) - _log_comb(n, batch_size)) for s in (shard_size, rest) if s]
    return full * (1 - miss[0]) + (1 - miss[1] if rest else 0.0)


def _log_comb(n: int, k: int) -> float:
    if k > n:
        return -math.inf
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def gap_entropy_bits(order: np.ndarray) -> float:
    n = len(order)
    counts, _ = np.histogram(np.diff(order) / n, bins=GAP_BINS, range=(-1, 1))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def measure(name: str, order: np.ndarray, batch_size: int, shard_size: int) -> ShuffleFigures:
    n = len(order)
    position = np.arange(n)
    return ShuffleFigures(
        name=name,
        n=n,
        kendall_tau=float(stats.kendalltau(position, order).statistic),
        spearman=float(stats.spearmanr(position, order).statistic),
        mean_displacement=float(np.abs(order - position).mean() / n),
        shards_per_batch=float(distinct_shards_per_batch(order, batch_size, shard_size).mean()),
        gap_entropy_bits=gap_entropy_bits(order),
    )


# ---- tests against the uniform shuffle ----------------------------------------------
def _triangular_cdf(d: np.ndarray) -> np.ndarray:
    """CDF of |U1 - U2| for independent uniforms: the limit of |order[p] - p| / n."""
    return 1 - (1 - d) ** 2


def _difference_cdf(x: np.ndarray) -> np.ndarray:
    """CDF of U1 - U2 on [-1, 1]: the limit of a consecutive gap / n."""
    return np.where(x < 0, (1 + x) ** 2 / 2, 1 - (1 - x) ** 2 / 2)


def uniformity_tests(
    order: np.ndarray,
    *,
    batch_size: int,
    shard_size: int,
    next_epoch: np.ndarray | None = None,
    grid: int = 16,
    reference_seed: int = 12345,
) -> dict[str, float]:
    """p-values of tests whose null hypothesis is "order is a uniform random permutation".

    * position_vs_index: chi-square independence of (position bin, index bin) on a
      grid x grid table; a permutation fixes its margins, which is the test's model.
    * displacement: Kolmogorov-Smirnov of |order[p] - p| / n against its uniform limit.
    * gaps: KS of consecutive gaps / n against theirs (catches local structure).
    * serial: Spearman correlation of order[p] with order[p + 1].
    * shards_per_batch: Mann-Whitney U of distinct shards per batch against a numpy
      uniform shuffle with `reference_seed` (catches shard-local batches).
    * epochs (with `next_epoch`): Spearman correlation between two epochs' orders.
    """
    n = len(order)
    position = np.arange(n)
    pos_bin = position * grid // n
    idx_bin = order * grid // n
    table = np.zeros((grid, grid), dtype=np.int64)
    np.add.at(table, (pos_bin, idx_bin), 1)
    out = {
        "position_vs_index": float(stats.chi2_contingency(table, correction=False).pvalue),
        "displacement": float(stats.kstest(np.abs(order - position) / n, _triangular_cdf).pvalue),
        "gaps": float(stats.kstest(np.diff(order) / n, _difference_cdf).pvalue),
        "serial": float(stats.spearmanr(order[:-1], order[1:]).pvalue),
        "shards_per_batch": float(
            stats.mannwhitneyu(
                distinct_shards_per_batch(order, batch_size, shard_size),
                distinct_shards_per_batch(uniform_order(n, reference_seed), batch_size, shard_size),
            ).pvalue
        ),
    }
    if next_epoch is not None:
        out["epochs"] = float(stats.spearmanr(order, next_epoch).pvalue)
    return out


def looks_uniform(pvalues: dict[str, float], alpha: float = 0.01) -> bool:
    """No test rejects at family-wise level `alpha` (Bonferroni over the tests run)."""
    return not rejecting(pvalues, alpha)


def bonferroni_level(pvalues: dict[str, float], alpha: float = 0.01) -> float:
    """The p-value at or under which one of these tests rejects, at family-wise level `alpha`."""
    return alpha / len(pvalues)


def rejecting(pvalues: dict[str, float], alpha: float = 0.01) -> dict[str, float]:
    """The tests that reject uniformity at family-wise level `alpha`: {test: p-value}."""
    level = bonferroni_level(pvalues, alpha)
    return {k: v for k, v in pvalues.items() if v <= level}


# ---- the report -------------------------------------------------------------------
@dataclass(frozen=True)
class QualityRow:
    figures: ShuffleFigures
    pvalues: dict[str, float]
    uniform: bool


def report_rows(
    n: int = 100_000, batch_size: int = 64, shard_size: int = 1_000, seed: int = 0
) -> tuple[list[QualityRow], dict[str, float]]:
    """croupier's plan and the reference shuffles, measured and tested on n rows.

    Returns the rows and the figures a uniform shuffle is expected to have.
    """
    orders = {
        "croupier plan (seed, epoch 0)": (plan_order(n, seed, 0), plan_order(n, seed, 1)),
        "numpy uniform permutation": (uniform_order(n, seed + 1), uniform_order(n, seed + 2)),
        f"buffer shuffle, buffer {n // 100}": (buffer_order(n, n // 100, seed), buffer_order(n, n // 100, seed + 1)),
        f"buffer shuffle, buffer {n // 10}": (buffer_order(n, n // 10, seed), buffer_order(n, n // 10, seed + 1)),
        f"block shuffle, shards of {shard_size}, 1 shard/block": (
            block_order(n, shard_size, 1, seed),
            block_order(n, shard_size, 1, seed + 1),
        ),
        f"block shuffle, shards of {shard_size}, 8 shards/block": (
            block_order(n, shard_size, 8, seed),
            block_order(n, shard_size, 8, seed + 1),
        ),
    }
    rows = []
    for name, (order, nxt) in orders.items():
        pvalues = uniformity_tests(order, batch_size=batch_size, shard_size=shard_size, next_epoch=nxt)
        rows.append(QualityRow(measure(name, order, batch_size, shard_size), pvalues, looks_uniform(pvalues)))
    expected = {
        "mean_displacement": (n * n - 1) / (3 * n * n),
        "shards_per_batch": expected_shards_per_batch(n, batch_size, shard_size),
    }
    return rows, expected


def markdown_table(rows: list[QualityRow], expected: dict[str, float]) -> str:
    head = (
        "| shuffle | Kendall tau | Spearman | mean displacement | shards per batch | gap entropy (bits) "
        "| smallest p | uniform? |\n|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        f = r.figures
        worst = min(r.pvalues, key=r.pvalues.get)
        lines.append(
            f"| {f.name} | {f.kendall_tau:+.4f} | {f.spearman:+.4f} | {f.mean_displacement:.4f} "
            f"| {f.shards_per_batch:.1f} | {f.gap_entropy_bits:.3f} | {r.pvalues[worst]:.2g} ({worst}) "
            f"| {'yes' if r.uniform else 'no'} |"
        )
    lines.append(
        f"\nExpected for a uniform shuffle: mean displacement {expected['mean_displacement']:.4f}, "
        f"shards per batch {expected['shards_per_batch']:.1f}; tau and Spearman near 0."
    )
    return "\n".join(lines)
