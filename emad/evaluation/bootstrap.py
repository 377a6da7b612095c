"""The verdict's bootstrap over blocks of units: per-block sums, the statistics on them, and BCa bounds at several
levels from one set of resamples — shared by the intervals of the run files and the verdict
(:mod:`emad.evaluation.intervals`) and by the coverage simulation (``benchmarks/bench_coverage.py``), so that the
simulation measures exactly the interval the verdict computes.

Units that share a source are resampled together: the split keeps blocks of :data:`emad.evaluation.units.BLOCK`
consecutive units (neighbouring windows of one text, prompts cut next to each other) on one side, and the bootstrap
draws whole blocks. Every statistic is a ratio of sums — a mean is Σ value / Σ 1, a pair metric Σ numerator /
Σ denominator (perplexity its exponential) — so a block is summarised by its sums and a resample of blocks gives
exactly the statistic over the units of the blocks drawn. With one unit a block this is the ordinary bootstrap over
units; with blocks of perfectly correlated units it is the bootstrap over block means.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

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


def ratio_of_sums(num: np.ndarray, den: np.ndarray, axis: int = -1) -> np.ndarray:
    """Σ num / Σ den over ``axis`` (a zero denominator reads as 1)."""
    d = den.sum(axis=axis)
    return num.sum(axis=axis) / np.where(d == 0, 1.0, d)


def statistic_of_sums(exponential: bool) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """The statistic of block sums: Σ num / Σ den, or its exponential (perplexity)."""
    if exponential:
        return lambda num, den, axis=-1: np.exp(ratio_of_sums(num, den, axis))
    return ratio_of_sums


def change_function(relative: bool) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """The change of a point's statistic against full depth's: the relative rise ``s_p / s_f − 1`` (a
    lower-better metric) or the absolute drop ``s_f − s_p`` (a higher-better one)."""
    if relative:
        return lambda point, full: point / np.where(full == 0, np.nan, full) - 1.0
    return lambda point, full: full - point


def paired_change_statistic(exponential: bool, relative: bool) -> Callable[..., np.ndarray]:
    """``f(point_num, point_den, full_num, full_den, axis)`` of block sums: the change of the statistic."""
    stat, change = statistic_of_sums(exponential), change_function(relative)

    def statistic(pn, pd, fn, fd, axis=-1):
        return change(stat(pn, pd, axis), stat(fn, fd, axis))

    return statistic


def bootstrap_bounds(columns: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray], levels: Sequence[float],
                     resamples: int = RESAMPLES, rng: np.random.Generator | None = None
                     ) -> tuple[dict[float, tuple[np.ndarray, np.ndarray, np.ndarray]], np.ndarray]:
    """Paired BCa bounds of ``statistic`` over the last axis of ``columns`` (each ``[..., m]``: blocks, with any
    leading batch dimensions) at each of ``levels``, all from one set of ``resamples`` resamples (drawn from
    ``rng``, default ``default_rng(SEED)``): ``{level: (lo, hi, bca)}`` — ``bca`` False where BCa is undefined and
    the percentile interval of the same resamples stands in — and the bootstrap distribution ``[..., resamples]``.
    """
    from scipy import stats  # imported on use: a stage that only checks params does not pay for it

    rng = np.random.default_rng(SEED) if rng is None else rng
    out, res = {}, None
    with warnings.catch_warnings():  # degenerate or tiny samples: BCa warns and returns NaN; handled below
        warnings.simplefilter("ignore")
        for level in levels:
            res = stats.bootstrap(columns, statistic, n_resamples=resamples if res is None else 0,
                                  bootstrap_result=res, vectorized=True, paired=True, axis=-1,
                                  confidence_level=level, method="BCa", rng=rng)
            lo = np.array(res.confidence_interval.low, dtype=np.float64, ndmin=1)
            hi = np.array(res.confidence_interval.high, dtype=np.float64, ndmin=1)
            bca = np.isfinite(lo) & np.isfinite(hi)
            if not bca.all():
                dist = np.asarray(res.bootstrap_distribution).reshape(len(bca), -1)[~bca]
                tail = (1 - level) / 2
                lo[~bca], hi[~bca] = np.quantile(dist, tail, axis=-1), np.quantile(dist, 1 - tail, axis=-1)
            shape = np.shape(res.confidence_interval.low)
            out[level] = (lo.reshape(shape), hi.reshape(shape), bca.reshape(shape))
    return out, np.asarray(res.bootstrap_distribution)
