"""95% intervals of quality metrics from per-unit samples, and of their change against full depth (DESIGN.md §4).

A task's result may carry ``"samples": {metric: [one value per unit]}``, a unit being what the task draws
independently: a perplexity window, a prompt, a problem, a multiple-choice item. A unit's value is

- a number: the metric is the mean over units. When every value is 0 or 1 (an accuracy), the interval is the
  exact binomial one (Clopper–Pearson); otherwise a BCa bootstrap over units.
- a pair ``[numerator, denominator]`` (a window's summed NLL and token count; a prompt's agreeing and compared
  tokens): the metric is Σnumerator / Σdenominator — or its exponential for the keys in :data:`EXP_KEYS`
  (perplexity = exp(Σnll / Σtokens)); a BCa bootstrap over units.

The change of a point against the full-depth run on the same units — the relative rise ``s_p / s_f − 1`` of a
lower-better metric, the absolute drop ``s_f − s_p`` of a higher-better one — gets a paired interval:

- a paired BCa bootstrap: one resample of unit indices is applied to both runs, so what the units share (a hard
  window is hard at every depth) cancels. Runs with different unit counts cannot be paired; they are resampled
  independently and the method says ``unpaired``.
- accuracies (0/1 in both runs): exact, from the discordant units. With ``b`` units right at full depth and wrong
  at the point, ``c`` the reverse, the drop is ``(b − c) / n``; 97.5% Clopper–Pearson intervals of ``b / n`` and
  ``c / n`` give ``[lo_b − hi_c, hi_b − lo_c]``, which covers the drop with probability ≥ 95% (Bonferroni). The
  bootstrap would collapse to zero width when no unit differs; this interval does not.

When every paired unit is equal — up to the float noise of two runs that compute the same thing in another order,
a tolerance per metric (:attr:`emad.evaluation.metrics.QualityMetric.noise`) — no resample can size the
uncertainty, and the change is not shown to be zero: the data rule out only a share of differing units above the
exact 95% upper bound for 0 differing of ``N``, ``1 − 0.025^(1/N)`` (:func:`share_bound`), ``N`` counted in the
metric's own unit (its prompts, items, problems; a token-level metric's prompts), which the caller names
(:meth:`emad.evaluation.metrics.QualityMetric.bound_units`).
For a score in [0, 1] that bounds the change: the interval is ± that bound, and a check is met only when ``N`` is
large enough for the tolerance (368 units for one point). A relative change (perplexity) has no such bound: the
interval is undefined. Otherwise an interval is undefined (``lo = hi = None``; the report prints "n/a") with fewer than 2 units,
or when every bootstrap resample gives the same value — never a zero-width interval. A tolerance check on a change is :data:`MET` when the whole interval lies within
the tolerance, :data:`VIOLATED` when it lies wholly beyond, :data:`UNRESOLVED` otherwise or when undefined.

Every bootstrap draws from ``numpy.random.default_rng(SEED)`` afresh: the same samples give the same bounds.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

import numpy as np

from emad.evaluation.bootstrap import (
    RESAMPLES,
    SEED,
    block_sums,
    bootstrap_bounds,
    paired_change_of_totals,
    statistic_of_totals,
)
from emad.evaluation.states import MET, UNRESOLVED, VIOLATED, State

LEVEL = 0.95
EPS = 1e-9
EXP_KEYS = frozenset({"perplexity"})  # pair samples whose metric is exp(Σnumerator / Σdenominator)
EQUAL_UNBOUNDED = "every paired unit equal, and a share of differing units bounds no relative change"


@dataclass(frozen=True)
class Interval:
    """A point value with its 95% interval over ``n`` units.

    Attributes:
        value: the statistic on all units (None without units).
        lo, hi: the bounds, or None when undefined.
        n: units behind it (the smaller count for an unpaired change).
        method: how the bounds were computed (``clopper-pearson``, ``bootstrap-bca`` ...), or
            ``undefined: <why>``.
        all_equal: every paired unit was equal: the bounds are the exact bound on the share of units that differ.
        blocks: the blocks a bootstrap resampled (None: not a bootstrap).
        changed: paired units that differ beyond the float noise (None: not a paired change).
        level: the two-sided level of the bounds.
    """

    value: float | None
    lo: float | None
    hi: float | None
    n: int
    method: str
    all_equal: bool = False
    blocks: int | None = None
    changed: int | None = None
    level: float = 0.95

    @property
    def defined(self) -> bool:
        return self.lo is not None and self.hi is not None

    def to_dict(self) -> dict:
        return asdict(self)


def _undefined(value: float | None, n: int, why: str) -> Interval:
    return Interval(value, None, None, n, f"undefined: {why}")


# --- per-unit values and their statistics ---------------------------------------------------------------------

def _mean(x: np.ndarray) -> np.ndarray:
    return x[0].mean(axis=-1)


def _ratio(x: np.ndarray) -> np.ndarray:
    den = x[1].sum(axis=-1)
    return x[0].sum(axis=-1) / np.where(den == 0, 1.0, den)


def _exp_ratio(x: np.ndarray) -> np.ndarray:
    return np.exp(_ratio(x))


# statistic name → function of per-unit columns [k, ..., n] → [...]
STATISTICS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"mean": _mean, "ratio": _ratio,
                                                             "exp_ratio": _exp_ratio}


def statistic_name(key: str, columns: int) -> str:
    """The statistic of a metric: ``mean`` of numbers; ``ratio`` of pair sums, ``exp_ratio`` for :data:`EXP_KEYS`."""
    if columns == 1:
        return "mean"
    return "exp_ratio" if key in EXP_KEYS else "ratio"


def unit_columns(samples: Sequence, key: str) -> np.ndarray:
    """Per-unit values as float columns ``[k, n]`` (k = 1 for numbers, 2 for pairs).

    Raises:
        ValueError: values that are neither all numbers nor all ``[numerator, denominator]`` pairs (names ``key``).
    """
    try:
        x = np.asarray(samples, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"samples of {key!r} must be all numbers or all [numerator, denominator] pairs") from None
    if x.ndim == 1:
        return x[None, :]  # [1, n]
    if x.ndim == 2 and x.shape[1] == 2:
        return x.T  # [2, n]
    raise ValueError(f"samples of {key!r} must be all numbers or all [numerator, denominator] pairs, "
                     f"got shape {list(x.shape)}")


def _binary(*xs: np.ndarray) -> bool:
    return all(x.shape[0] == 1 and bool(np.isin(x, (0.0, 1.0)).all()) for x in xs)


def _value(stat: Callable, x: np.ndarray) -> float | None:
    return float(stat(x)) if x.shape[1] else None


# --- bootstrap and exact intervals ----------------------------------------------------------------------------

def _bootstrap(fn: Callable[..., np.ndarray], sizes: Sequence[int], value: float | None, n: int,
               label: str, level: float = LEVEL) -> Interval:
    """BCa bootstrap of ``fn(*unit_indices)`` over resampled unit indices (one index array per sample)."""
    data = tuple(np.arange(size) for size in sizes)

    def statistic(*idx: np.ndarray, axis: int = -1) -> np.ndarray:
        return fn(*(np.asarray(i).astype(np.intp) for i in idx))

    from scipy import stats  # imported on use: a stage that only checks params does not pay for it

    with warnings.catch_warnings():  # degenerate or tiny samples: BCa warns and returns NaN; handled below
        warnings.simplefilter("ignore")
        res = stats.bootstrap(data, statistic, n_resamples=RESAMPLES, vectorized=True, paired=False,
                              confidence_level=level, method="BCa", rng=np.random.default_rng(SEED))
    dist = np.asarray(res.bootstrap_distribution)
    if not np.isfinite(dist).all():
        return _undefined(value, n, "non-finite values in the resamples")
    if np.ptp(dist) == 0:
        return _undefined(value, n, "no variation between units")
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if math.isfinite(lo) and math.isfinite(hi):
        return Interval(value, lo, hi, n, f"bootstrap-bca{label}")
    tail = (1 - level) / 2
    lo, hi = (float(q) for q in np.quantile(dist, [tail, 1 - tail]))
    return Interval(value, lo, hi, n, f"bootstrap-percentile{label}")


def _clopper_pearson(k: int, n: int, level: float) -> tuple[float, float]:
    from scipy import stats

    ci = stats.binomtest(k, n).proportion_ci(confidence_level=level, method="exact")
    return float(ci.low), float(ci.high)


def metric_value(key: str, samples: Sequence) -> float | None:
    """The metric's value from its per-unit samples (the statistic of :func:`metric_interval`, without bounds)."""
    x = unit_columns(samples, key)  # [k, n]
    return _value(STATISTICS[statistic_name(key, x.shape[0])], x)


def metric_interval(key: str, samples: Sequence, blocks: Sequence[int] | None = None) -> Interval:
    """The metric's value and 95% interval from its per-unit samples (see the module docstring).

    Args:
        key: the metric's key in its task's result (``perplexity``, ``acc`` ...), which picks the statistic.
        samples: one value or ``[numerator, denominator]`` pair per unit.
        blocks: one block id per unit: a bootstrap resamples whole blocks (None: every unit its own block).
    """
    x = unit_columns(samples, key)  # [k, n]
    n, stat = x.shape[1], STATISTICS[statistic_name(key, x.shape[0])]
    value = _value(stat, x)
    if n < 2:
        return _undefined(value, n, "fewer than 2 units")
    if not np.isfinite(x).all():
        return _undefined(value, n, "non-finite unit values")
    if _binary(x):
        lo, hi = _clopper_pearson(int(x.sum()), n, LEVEL)
        return Interval(value, lo, hi, n, "clopper-pearson")
    sums = block_sums(x, blocks)  # [2, m]
    if sums.shape[1] < 2:
        return _undefined(value, n, "fewer than 2 blocks")
    exponential = statistic_name(key, x.shape[0]) == "exp_ratio"
    return _block_bootstrap((sums[0], sums[1]), statistic_of_totals(exponential), value, n, "", LEVEL)


def _block_bootstrap(columns: tuple[np.ndarray, ...], statistic, value: float | None, n: int, label: str,
                     level: float, changed: int | None = None) -> Interval:
    """The BCa interval (percentile where BCa is undefined) of ``statistic`` over resampled blocks (``columns``,
    each ``[m]``: block sums), or undefined when the resamples do not vary or are not finite."""
    bounds, dist = bootstrap_bounds(columns, statistic, [level])
    m = len(columns[0])
    if not np.isfinite(dist).all():
        return _undefined(value, n, "non-finite values in the resamples")
    if np.ptp(dist) == 0:
        return _undefined(value, n, "no variation between blocks" if m < n else "no variation between units")
    lo, hi, bca = (float(np.asarray(v).reshape(-1)[0]) for v in bounds[level])
    kind = "bca" if bca else "percentile"
    over = f" over {m} blocks" if m < n else ""
    return Interval(value, lo, hi, n, f"bootstrap-{kind}{label}{over}", blocks=m, changed=changed, level=level)


def _change(relative: bool) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    if relative:
        return lambda point, full: point / np.where(full == 0, np.nan, full) - 1.0
    return lambda point, full: full - point


def _exact_drop(xp: np.ndarray, xf: np.ndarray, value: float, level: float = LEVEL) -> Interval:
    """The drop of an accuracy, exact and conservative: discordant units when paired, two binomials otherwise."""
    level = 1 - (1 - level) / 2  # two intervals at 97.5% hold jointly with probability ≥ 95%
    p, f = xp[0], xf[0]
    if len(p) == len(f):
        n = len(p)
        (b_lo, b_hi), (c_lo, c_hi) = (_clopper_pearson(int(((f == 1) & (p == 0)).sum()), n, level),
                                      _clopper_pearson(int(((f == 0) & (p == 1)).sum()), n, level))
        return Interval(value, b_lo - c_hi, b_hi - c_lo, n, "exact-paired (discordant units, Clopper-Pearson)")
    (f_lo, f_hi), (p_lo, p_hi) = (_clopper_pearson(int(f.sum()), len(f), level),
                                  _clopper_pearson(int(p.sum()), len(p), level))
    return Interval(value, f_lo - p_hi, f_hi - p_lo, min(len(p), len(f)),
                    f"exact-unpaired (Clopper-Pearson, n {len(p)} vs {len(f)})")


def _frozen(samples: Sequence, key: str) -> tuple:
    """Samples as nested tuples (hashable, for the cache); anything but numbers and pairs is refused."""
    out = tuple(tuple(v) if isinstance(v, list | tuple) else v for v in samples)
    if not all(isinstance(v, int | float | tuple) for v in out):
        raise ValueError(f"samples of {key!r} must be all numbers or all [numerator, denominator] pairs")
    return out


def share_bound(n: int, level: float = LEVEL) -> float:
    """The exact (Clopper–Pearson) 95% upper bound on the share of units that differ when 0 of ``n`` do:
    ``1 − 0.025^(1/n)`` (one-sided at 97.5%, as the two-sided interval's upper end)."""
    return 1.0 - ((1 - level) / 2) ** (1.0 / n) if n > 0 else 1.0


def changed_units(xp: np.ndarray, xf: np.ndarray, noise: float = 0.0) -> int | None:
    """How many paired units ``[k, n]`` differ beyond ``noise`` (in the numerator; a denominator must be equal);
    None when the runs have different unit counts (not paired)."""
    if xp.shape != xf.shape:
        return None
    moved = np.abs(xp[0] - xf[0]) > noise
    if xp.shape[0] == 2:
        moved |= xp[1] != xf[1]
    return int(moved.sum())


def change_interval(key: str, point: Sequence, full: Sequence, relative: bool,
                    bound_units: int | None = None, level: float = LEVEL, noise: float = 0.0,
                    blocks: Sequence[int] | None = None) -> Interval:
    """The change of a point against full depth, with its 95% interval over the shared units.

    Args:
        key: the metric's key in its task's result (picks the statistic).
        point, full: per-unit samples of the point's run and of the full-depth run.
        relative: True for a lower-better metric (relative rise ``s_p / s_f − 1``), False for a higher-better one
            (absolute drop ``s_f − s_p``).
        bound_units: when every paired unit is equal, the units the share bound runs over (None: no bound, the
            interval is undefined); see the module docstring.
        noise: a paired unit whose value moved by at most this much is equal (the float noise of two runs that
            compute the same thing; :attr:`emad.evaluation.metrics.QualityMetric.noise`).
        blocks: one block id per paired unit: a paired bootstrap resamples whole blocks (None: every unit its own
            block); the exact methods count units.
    """
    # the report asks for the same change several times (verdicts per family, domain-shift table): computed once
    ids = None if blocks is None else tuple(int(b) for b in blocks)
    return _change_interval(key, _frozen(point, key), _frozen(full, key), relative, bound_units, level, noise, ids)


@lru_cache(maxsize=4096)
def _change_interval(key: str, point: tuple, full: tuple, relative: bool, bound_units: int | None,
                     level: float, noise: float, blocks: tuple | None = None) -> Interval:
    xp, xf = unit_columns(point, key), unit_columns(full, key)  # [k, n_p], [k, n_f]
    if xp.shape[0] != xf.shape[0]:
        raise ValueError(f"samples of {key!r} differ in kind between the point and full depth (numbers vs pairs)")
    stat, change = STATISTICS[statistic_name(key, xp.shape[0])], _change(relative)
    np_, nf = xp.shape[1], xf.shape[1]
    value = float(change(stat(xp), stat(xf))) if np_ and nf else None
    changed = changed_units(xp, xf, noise)
    if np_ and changed == 0:  # every paired unit equal: only a share of them is ruled out
        within = f" (within float noise {noise:g})" if noise and not np.array_equal(xp, xf) else ""
        if bound_units is None:
            return _undefined(value, np_, EQUAL_UNBOUNDED + within)
        bound = share_bound(bound_units, level)
        return Interval(value, -bound, bound, np_, f"exact: 0 of {bound_units} differ{within} ({level:.1%} bound on "
                        f"the share that differ {bound:.2%})", all_equal=True, changed=0, level=level)
    if min(np_, nf) < 2:
        return _undefined(value, min(np_, nf), "fewer than 2 units")
    if not (np.isfinite(xp).all() and np.isfinite(xf).all()):
        return _undefined(value, min(np_, nf), "non-finite unit values")
    if _binary(xp, xf) and not relative:
        return replace(_exact_drop(xp, xf, value, level), changed=changed, level=level)
    if np_ == nf:
        if blocks is not None and len(blocks) != np_:
            raise ValueError(f"samples of {key!r}: {len(blocks)} block ids for {np_} paired units")
        ps, fs = block_sums(xp, blocks), block_sums(xf, blocks)  # [2, m] each
        if ps.shape[1] < 2:
            return _undefined(value, np_, "fewer than 2 blocks")
        exponential = statistic_name(key, xp.shape[0]) == "exp_ratio"
        return _block_bootstrap((ps[0], ps[1], fs[0], fs[1]), paired_change_of_totals(exponential, relative),
                                value, np_, ", paired", level, changed)
    return _bootstrap(lambda i, j: change(stat(xp[:, i]), stat(xf[:, j])), [np_, nf], value, min(np_, nf),
                      f", unpaired (n {np_} vs {nf})", level)


def ratio_interval(ratios: Sequence[float], level: float = LEVEL) -> Interval:
    """The geometric mean of positive ratios (a point's tokens/s over full depth's, one per timed pair) with its 95%
    Student-t interval on the log scale: timings are noisy multiplicatively, and a handful of pairs is too few for
    a bootstrap. Undefined with fewer than 2 ratios or a ratio that is not positive and finite; equal ratios give
    a zero-width interval (the timings agree exactly)."""
    x = np.asarray(ratios, dtype=np.float64)
    n = len(x)
    if n == 0 or not (np.isfinite(x).all() and (x > 0).all()):
        return _undefined(None, n, "no pairs" if n == 0 else "a ratio that is not positive and finite")
    logs = np.log(x)
    value = float(np.exp(logs.mean()))
    if n < 2:
        return _undefined(value, n, "fewer than 2 pairs")
    from scipy import stats

    half = float(stats.t.ppf(1 - (1 - level) / 2, n - 1) * logs.std(ddof=1) / math.sqrt(n))
    return Interval(value, float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half)), n,
                    "student-t on log ratios", level=level)


def floor_state(interval: Interval, floor: float) -> State:
    """:data:`MET` when the interval lies at or above ``floor`` (a speed-up that must reach it), :data:`VIOLATED`
    when it lies wholly below, :data:`UNRESOLVED` when it straddles it or is undefined."""
    if not interval.defined:
        return UNRESOLVED
    if interval.lo >= floor - EPS:
        return MET
    if interval.hi < floor - EPS:
        return VIOLATED
    return UNRESOLVED


def tolerance_state(interval: Interval, tolerance: float) -> State:
    """:data:`MET` when the interval of a change lies within ``tolerance`` (a change above it is worse),
    :data:`VIOLATED` when it lies wholly above, :data:`UNRESOLVED` when it straddles it or is undefined.
    A slack of :data:`EPS` lets a bound exactly at the tolerance count as within."""
    if not interval.defined:
        return UNRESOLVED
    if interval.hi <= tolerance + EPS:
        return MET
    if interval.lo > tolerance + EPS:
        return VIOLATED
    return UNRESOLVED
