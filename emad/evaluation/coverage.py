"""Whether an interval's side can carry a label, and at which level: the coverage each side of an interval method
was measured to have (``benchmarks/bench_coverage.py``, ``reports/bench/coverage.json``), by metric, method,
number of units, number of changed units, level and side.

A check is *met* when its interval's upper bound lies within the tolerance and *violated* when its lower bound lies
beyond: each label rests on one side. A two-sided interval at level L promises each side 1 − (1 − L)/2; a bootstrap
(BCa, or the percentile interval it falls back to) or a Student-t interval keeps that promise only where the data
are not too uneven — on a few units of which one changed a lot, BCa's upper bound covers a third of the time. The
simulation places the true change where labels flip (at the tolerance, and at half and twice it), on paired
differences drawn from the run's own (``reports/bench/coverage_samples.json``, resampled in the split's blocks),
with q of the units changed for q from 0.005 to 1, and records at each simulated level how often each side held the
truth, by n and by how many units of the sample changed. A cell's coverage is decided on its Monte Carlo lower
bound (one-sided 95% Clopper–Pearson over its replicates), the smallest over the simulated shapes.

A side *covers* at level L where that lower bound reaches :func:`target` (L): a miss rate at most :data:`SLACK`
times the nominal one (96% at 95%), and at least :data:`ABSOLUTE_SLACK` above it (99.5% at 99.5%, where 1.6 times
the nominal rate could not be told apart in a simulation of a few thousand samples). Where it does not, the check is *calibrated* (:meth:`Coverage.calibrated`):
judged at the smallest simulated level above L whose side reaches the target of L — a wider bound that covers as
the label needs; only when no simulated level reaches it is the label withheld (the check is underpowered). The
cell read is the one at the largest simulated n not above the check's and the bin of its changed units
(:data:`CHANGED_BINS`; every bin at that n when the check does not say). Exact methods (Clopper–Pearson, the
discordant-unit interval, the share bound when every unit is equal) cover by construction.

The table in force is set for a block of work (:func:`using`), as the aggregate stage does with the committed
``reports/bench/coverage.json``; without one (:func:`active` is None) intervals are taken at face value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

LEVELS = (0.95, 0.975, 0.98333, 0.9875, 0.99, 0.995, 0.998, 0.999)  # simulated two-sided levels (Bonferroni's
# 1 − 0.05/m for m = 1, 2, 3, 4, 5, 10, 25, 50)
SLACK = 1.6  # a side may miss up to this many times its nominal rate: 96% at 95% (nominally 97.5%) ...
ABSOLUTE_SLACK = 0.0025  # ... and at least this much more than it: a few thousand simulated samples cannot tell
# a miss rate of 0.08% from one of 0.2%, so the stricter levels of many candidates would otherwise never cover
MC_CONFIDENCE = 0.95  # a cell's coverage is read at its one-sided Monte Carlo lower bound at this confidence
CHANGED_BINS = ((1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, None))  # changed units of a sample
ALL_BINS = "all"  # the bin of a method that does not depend on changed units (C2's t interval)
SIDES = ("lower", "upper")
EXACT = "exact"  # methods that cover by construction
SPEED = "speed"  # the metric name of C2's speed-up in the table
THRESHOLD = 1.0 - SLACK * (1.0 - 0.95) / 2  # the target at 95%: 0.96


def target(level: float) -> float:
    """The coverage a side of a two-sided interval at ``level`` must reach to carry a label: a miss rate at most
    :data:`SLACK` times the nominal ``(1 − level) / 2``, and at least :data:`ABSOLUTE_SLACK` above it."""
    nominal = (1.0 - level) / 2
    return 1.0 - max(SLACK * nominal, nominal + ABSOLUTE_SLACK)


def lower_bound(covered: int, replicates: int, confidence: float = MC_CONFIDENCE) -> float:
    """One-sided Clopper–Pearson lower bound on a coverage seen in ``covered`` of ``replicates`` samples."""
    if replicates <= 0 or covered <= 0:
        return 0.0
    from scipy import stats  # imported on use

    return float(stats.beta.ppf(1.0 - confidence, covered, replicates - covered + 1))


def bin_label(lo: int, hi: int | None) -> str:
    """``1``, ``2-3``, ``64+``: a bin of :data:`CHANGED_BINS` as the table names it."""
    return f"{lo}+" if hi is None else str(lo) if lo == hi else f"{lo}-{hi}"


def changed_bin(changed: int) -> str | None:
    """The bin of ``changed`` units (None: none changed, no bootstrap)."""
    for lo, hi in CHANGED_BINS:
        if changed >= lo and (hi is None or changed <= hi):
            return bin_label(lo, hi)
    return None


def family(method: str) -> str:
    """The interval method of an :class:`~emad.evaluation.intervals.Interval`'s ``method`` text: ``bootstrap``
    (BCa, or its percentile fallback), ``t-log`` (Student t on log ratios) or :data:`EXACT`."""
    if method.startswith("bootstrap"):
        return "bootstrap"
    if method.startswith("student-t"):
        return "t-log"
    return EXACT


def _level_key(level: float) -> float:
    return round(level, 5)


@dataclass(frozen=True)
class Cell:
    """One side at one level: ``covered`` of ``replicates`` simulated samples held the truth, in the worst simulated
    ``shape``; ``lower`` its Monte Carlo lower bound, on which it is decided."""

    covered: int
    replicates: int
    shape: str = ""

    @property
    def coverage(self) -> float:
        return self.covered / self.replicates if self.replicates else math.nan

    @cached_property
    def lower(self) -> float:
        return lower_bound(self.covered, self.replicates)


Key = tuple[str, str, int, str, float, str]  # metric, method, n, changed bin, level, side


@dataclass(frozen=True)
class Coverage:
    """Measured coverage, ``cells[(metric, method, n, changed bin, level, side)]`` (the worst shape's), read as
    the module docstring says.

    Attributes:
        source: where the table was read from (named in the report).
        samples_sha256: the sha256 of the samples file it was simulated from.
    """

    cells: dict[Key, Cell] = field(default_factory=dict)
    source: str = ""
    samples_sha256: str | None = None
    threshold: float = THRESHOLD  # the target at 95%, as the report states it

    @classmethod
    def from_dict(cls, data: dict, source: str = "") -> Coverage:
        """From ``reports/bench/coverage.json``: its ``table`` (``columns`` and one row per cell)."""
        table = data["table"]
        rows = [dict(zip(table["columns"], row)) for row in table["rows"]]
        cells = {(r["metric"], r["method"], int(r["n"]), str(r["changed"]), _level_key(float(r["level"])),
                  r["side"]): Cell(int(r["covered"]), int(r["replicates"]), r.get("shape", "")) for r in rows}
        return cls(cells, source, data.get("samples_sha256"))

    @classmethod
    def load(cls, path: Path | str) -> Coverage:
        """Read ``reports/bench/coverage.json``.

        Raises:
            ValueError: the file is missing or holds no ``table`` of cells (naming the file and how to make it).
        """
        path = Path(path)
        try:
            return cls.from_dict(json.loads(path.read_text()), str(path))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{path}: not a coverage table ({err}); make it with python "
                             f"benchmarks/bench_coverage.py") from None

    @cached_property
    def _index(self) -> dict[tuple[str, str], dict[int, dict[tuple[float, str], dict[str, Cell]]]]:
        """``{(metric, method): {n: {(level, side): {changed bin: cell}}}}``."""
        out: dict = {}
        for (metric, method, n, changed, level, side), c in self.cells.items():
            out.setdefault((metric, method), {}).setdefault(n, {}).setdefault((level, side), {})[changed] = c
        return out

    def sizes(self, metric: str, method: str) -> list[int]:
        """The simulated sizes of ``metric``'s ``method``, ascending."""
        return sorted(self._index.get((metric, method), {}))

    @cached_property
    def _levels(self) -> list[float]:
        return sorted({k[4] for k in self.cells})

    def levels(self) -> list[float]:
        """The simulated levels, ascending."""
        return self._levels

    def cell(self, metric: str, method: str, n: int, side: str, level: float,
             changed: int | None = None) -> Cell | None:
        """The cell a check of ``n`` units (``changed`` of them changed) reads: at the largest simulated size ≤ ``n``,
        in its changed bin — the worst bin there when ``changed`` is None, the one bin of a method that does not
        depend on it; None where nothing was simulated."""
        below = [s for s in self.sizes(metric, method) if s <= n]
        if not below:
            return None
        found = self._index[(metric, method)][max(below)].get((_level_key(level), side), {})
        if ALL_BINS in found:
            return found[ALL_BINS]
        if changed is None:
            return min(found.values(), key=lambda c: c.lower, default=None)
        return found.get(changed_bin(changed)) if changed > 0 else None

    def nearest(self, metric: str, method: str, n: int, side: str, level: float,
                changed: int | None = None) -> tuple[float, Cell] | None:
        """The cell a check judged at ``level`` reads first: at the smallest simulated level not below it (None:
        nothing simulated there)."""
        for at in (lvl for lvl in self.levels() if lvl >= _level_key(level) - 1e-9):
            found = self.cell(metric, method, n, side, at, changed)
            if found is not None:
                return at, found
        return None

    def coverage(self, metric: str, method: str, n: int, side: str, level: float = 0.95,
                 changed: int | None = None) -> float | None:
        """The measured coverage of that cell (None: not simulated)."""
        found = self.cell(metric, method, n, side, level, changed)
        return None if found is None else found.coverage

    def covers(self, metric: str, method: str, n: int, side: str, level: float, at: float,
               changed: int | None = None) -> bool:
        """Whether the side at simulated level ``at`` reaches the target of a check judged at ``level``."""
        found = self.cell(metric, method, n, side, at, changed)
        return found is not None and found.lower >= target(level) - 1e-12

    def calibrated(self, metric: str, method: str, n: int, side: str, level: float,
                   changed: int | None = None) -> float | None:
        """The level to judge a check at ``level`` on: the smallest simulated level ≥ ``level`` whose ``side``
        reaches :func:`target` (``level``); ``level`` itself for an exact method; None when no simulated level
        does (the label is withheld)."""
        if method == EXACT:
            return level
        for at in (lvl for lvl in self.levels() if lvl >= _level_key(level) - 1e-9):
            if self.covers(metric, method, n, side, level, at, changed):
                return max(at, level)
        return None

    def trusted(self, metric: str, method: str, n: int, side: str, level: float = 0.95,
                changed: int | None = None) -> bool:
        """Whether a label resting on ``side`` of ``method``'s interval at ``level`` over ``n`` units stands as it
        is (without widening)."""
        found = self.calibrated(metric, method, n, side, level, changed)
        return found is not None and found <= _level_key(level) + 1e-9

    def _binned(self, metric: str, method: str) -> bool:
        """Whether ``metric``'s ``method`` was simulated by bins of changed units (not one bin for all)."""
        return any(changed != ALL_BINS for by_size in self._index.get((metric, method), {}).values()
                   for cells in by_size.values() for changed in cells)

    def reach(self, metric: str, method: str, n: int, side: str, level: float = 0.95) -> tuple[int, float] | None:
        """From how many changed units a label resting on ``side`` stands over ``n`` units, and the widest level it
        is judged at from there: the smallest changed count from which every bin of changed units a sample of ``n``
        can have is simulated and covers at some simulated level (``(0, level)`` for a method that does not depend
        on changed units; None: not even where every unit changed)."""
        if not self._binned(metric, method):
            found = self.calibrated(metric, method, n, side, level)
            return None if found is None else (0, found)
        bins = [lo for lo, _ in CHANGED_BINS if lo <= n]
        levels = [self.calibrated(metric, method, n, side, level, lo) for lo in bins]
        start = len(bins)
        while start > 0 and levels[start - 1] is not None:
            start -= 1
        return None if start == len(bins) else (bins[start], max(levels[start:]))

    def needs(self, metric: str, method: str, side: str, level: float = 0.95,
              changed: int | None = None) -> int | None:
        """The smallest simulated size from which ``side`` reaches the target of ``level`` at some simulated level
        at every larger simulated size (None: at none)."""
        need = None
        for n in reversed(self.sizes(metric, method)):
            if self.calibrated(metric, method, n, side, level, changed) is None:
                break
            need = n
        return need


_ACTIVE: ContextVar[Coverage | None] = ContextVar("emad_coverage", default=None)


def active() -> Coverage | None:
    """The coverage table in force (None: intervals taken at face value)."""
    return _ACTIVE.get()


@contextmanager
def using(coverage: Coverage | None) -> Iterator[Coverage | None]:
    """Judge every check inside the block against ``coverage``."""
    token = _ACTIVE.set(coverage)
    try:
        yield coverage
    finally:
        _ACTIVE.reset(token)
