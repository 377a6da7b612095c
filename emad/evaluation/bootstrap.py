"""The verdict's bootstrap over blocks of units: per-block sums, the statistics on them, and BCa bounds at several
levels from one set of resamples — shared by the intervals of the run files and the verdict
(:mod:`emad.evaluation.intervals`) and by the coverage simulation (``benchmarks/bench_coverage.py``), so that the
simulation measures exactly the interval the verdict computes.

Units that share a source are resampled together: the split keeps blocks of :data:`emad.evaluation.units.BLOCK`
consecutive units (neighbouring windows of one text, prompts cut next to each other) on one side, and the bootstrap
draws whole blocks. Every statistic is a ratio of totals — a mean is Σ value / Σ 1, a pair metric Σ numerator /
Σ denominator (perplexity its exponential) — so a block is summarised by its sums, and a resample's totals are its
draw counts times the block sums: the statistic over the units of the blocks drawn. With one unit a block this is
the ordinary bootstrap over units (the same draws as scipy's, so the same bounds); with blocks of perfectly
correlated units it is the bootstrap over block means.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import numpy as np

RESAMPLES = 4999
SEED = 0


def block_ids(n: int, block: int) -> np.ndarray:
    """Block ids of ``n`` consecutive units in blocks of ``block``: ``[0, 0, 0, 0, 1, ...]``."""
    return np.arange(n) // block


def block_sums(x: np.ndarray, blocks: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """Per-unit columns ``[k, n]`` (k = 1: numbers, k = 2: ``[numerator, denominator]`` pairs) → per-block sums
    ``[2, m]`` in ratio form: ``(Σ numerator, Σ denominator)``, a number's denominator being 1. ``blocks``: one id
    per unit (units of one id form a block, in order of first appearance); None: every unit its own block."""
    num, den = (x[0], np.ones_like(x[0])) if x.shape[0] == 1 else (x[0], x[1])  # [n], [n]
    if blocks is None:
        return np.stack([num, den])
    _, first, inverse = np.unique(np.asarray(blocks), return_index=True, return_inverse=True)
    order = np.argsort(np.argsort(first))  # block ids renumbered by first appearance
    m = len(first)
    sums = np.zeros((2, m))
    np.add.at(sums[0], order[inverse], num)
    np.add.at(sums[1], order[inverse], den)
    return sums


def ratio_of_totals(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Σ num / Σ den from the totals (a zero denominator reads as 1)."""
    return num / np.where(den == 0, 1.0, den)


def change_function(relative: bool) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """The change of a point's statistic against full depth's: the relative rise ``s_p / s_f − 1`` (a
    lower-better metric) or the absolute drop ``s_f − s_p`` (a higher-better one)."""
    if relative:
        return lambda point, full: point / np.where(full == 0, np.nan, full) - 1.0
    return lambda point, full: full - point


def statistic_of_totals(exponential: bool) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """A metric from its totals (Σ num, Σ den): their ratio, or its exponential (perplexity)."""
    if exponential:
        return lambda num, den: np.exp(ratio_of_totals(num, den))
    return ratio_of_totals


def paired_change_of_totals(exponential: bool, relative: bool) -> Callable[..., np.ndarray]:
    """``f(point_num, point_den, full_num, full_den)`` of totals: the change of the metric."""
    stat, change = statistic_of_totals(exponential), change_function(relative)
    return lambda pn, pd, fn, fd: change(stat(pn, pd), stat(fn, fd))


def resample_counts(m: int, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """How often each of ``m`` blocks is drawn in each of ``resamples`` resamples ``[resamples, m]``: the draws of
    ``rng.integers(0, m, (resamples, m))``, as scipy's bootstrap draws its indices."""
    idx = rng.integers(0, m, (resamples, m))
    offsets = (idx + m * np.arange(resamples)[:, None]).ravel()
    return np.bincount(offsets, minlength=resamples * m).reshape(resamples, m).astype(np.float64)


def bootstrap_bounds(columns: tuple[np.ndarray, ...], of_totals: Callable[..., np.ndarray], levels: Sequence[float],
                     resamples: int = RESAMPLES, rng: np.random.Generator | None = None
                     ) -> tuple[dict[float, tuple[np.ndarray, np.ndarray, np.ndarray]], np.ndarray]:
    """Paired BCa bounds of a statistic of block totals, ``of_totals(*totals)``, over the blocks of ``columns``
    (each ``[..., m]``: block sums, with any leading batch dimensions) at each of ``levels``, all from one set of
    ``resamples`` resamples of the blocks (drawn from ``rng``, default ``default_rng(SEED)``, as scipy's bootstrap
    draws them, shared by the batch): ``{level: (lo, hi, bca)}`` — ``bca`` False where BCa is undefined and the
    percentile interval of the same resamples stands in — and the bootstrap distribution ``[..., resamples]``.

    A resample's totals are its draw counts times the block sums (one matrix product), and scipy's BCa reads that
    distribution (``bootstrap_result``) with its own jackknife over the blocks.
    """
    from scipy import stats  # imported on use: a stage that only checks params does not pay for it

    rng = np.random.default_rng(SEED) if rng is None else rng
    counts = resample_counts(columns[0].shape[-1], resamples, rng)  # [B, m]
    dist = np.asarray(of_totals(*(c @ counts.T for c in columns)), dtype=np.float64)  # [..., B]

    def statistic(*cols, axis=-1):
        return of_totals(*(c.sum(axis=axis) for c in cols))

    given = SimpleNamespace(bootstrap_distribution=dist)
    out = {}
    with warnings.catch_warnings():  # degenerate or tiny samples: BCa warns and returns NaN; handled below
        warnings.simplefilter("ignore")
        for level in levels:
            res = stats.bootstrap(columns, statistic, n_resamples=0, bootstrap_result=given, vectorized=True,
                                  paired=True, axis=-1, confidence_level=level, method="BCa", rng=rng)
            lo = np.array(res.confidence_interval.low, dtype=np.float64, ndmin=1)
            hi = np.array(res.confidence_interval.high, dtype=np.float64, ndmin=1)
            bca = np.isfinite(lo) & np.isfinite(hi)
            if not bca.all():
                flat = dist.reshape(len(bca), -1)[~bca]
                tail = (1 - level) / 2
                lo[~bca], hi[~bca] = np.quantile(flat, tail, axis=-1), np.quantile(flat, 1 - tail, axis=-1)
            shape = np.shape(res.confidence_interval.low)
            out[level] = (lo.reshape(shape), hi.reshape(shape), bca.reshape(shape))
    return out, dist
