"""Whether an interval can carry a label at its size: the coverage each side of an interval method was measured to
have (``benchmarks/bench_coverage.py``, ``reports/bench/coverage.json``), by metric, method and number of units.

A check is *met* when its interval's upper bound lies within the tolerance, *violated* when its lower bound lies
beyond: each label rests on one side of the interval. A two-sided 95% interval promises each side 97.5%; a bootstrap
(BCa, or the percentile interval it falls back to) or a Student-t interval keeps that promise only at sizes where
the data are not too uneven — on a few units of which one changed a lot, BCa's upper bound covers a third of the
time. The simulation measures, on paired differences shaped like the run files' own (most units unchanged, a few
with large changes), how often each side covers the true change at each size; a label is given only where the side
it rests on covered at least :data:`THRESHOLD` of the time, at the largest simulated size not above the check's.
Elsewhere the check is *underpowered* and says the size it would need. Exact methods (Clopper–Pearson, the
discordant-unit interval, the share bound when every unit is equal) cover by construction.

The table in force is set for a block of work (:func:`using`), as the aggregate stage does with the committed
``reports/bench/coverage.json``; without one (:func:`active` is None) intervals are taken at face value.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

THRESHOLD = 0.96  # a side of a two-sided 95% interval covers 97.5% nominally; below this it carries no label
SIDES = ("lower", "upper")
EXACT = "exact"  # methods that cover by construction
SPEED = "speed"  # the metric name of C2's speed-up in the table


def family(method: str) -> str:
    """The interval method of an :class:`~emad.evaluation.intervals.Interval`'s ``method`` text: ``bootstrap``
    (BCa, or its percentile fallback), ``t-log`` (Student t on log ratios) or :data:`EXACT`."""
    if method.startswith("bootstrap"):
        return "bootstrap"
    if method.startswith("student-t"):
        return "t-log"
    return EXACT


@dataclass(frozen=True)
class Coverage:
    """Measured coverage: ``table[metric][method][n][side]`` (side ``lower`` or ``upper``), the share of simulated
    samples of ``n`` units whose bound on that side held the true value (the smallest over the simulated shapes).

    Attributes:
        threshold: the coverage a side needs to carry a label.
        source: where the table was read from (named in the report).
    """

    table: dict[str, dict[str, dict[int, dict[str, float]]]] = field(default_factory=dict)
    threshold: float = THRESHOLD
    source: str = ""

    @classmethod
    def from_dict(cls, data: dict, source: str = "") -> Coverage:
        """From the ``coverage`` part of ``reports/bench/coverage.json`` (its sizes are JSON keys: strings)."""
        table = {metric: {method: {int(n): dict(sides) for n, sides in sizes.items()}
                          for method, sizes in methods.items()} for metric, methods in data["table"].items()}
        return cls(table, float(data.get("threshold", THRESHOLD)), source)

    @classmethod
    def load(cls, path: Path | str) -> Coverage:
        """Read ``reports/bench/coverage.json``.

        Raises:
            ValueError: the file is missing or holds no ``table`` (naming the file and how to make it).
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text())
            return cls.from_dict(data, str(path))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}: not a coverage table ({err}); make it with python "
                             f"benchmarks/bench_coverage.py") from None

    def coverage(self, metric: str, method: str, n: int, side: str) -> float | None:
        """The measured coverage of ``side`` at the largest simulated size ≤ ``n`` (None: none simulated there)."""
        sizes = self.table.get(metric, {}).get(method, {})
        below = [s for s in sizes if s <= n]
        return sizes[max(below)][side] if below else None

    def trusted(self, metric: str, method: str, n: int, side: str) -> bool:
        """Whether a label resting on ``side`` of ``method``'s interval of ``metric`` over ``n`` units may be
        given."""
        if method == EXACT:
            return True
        found = self.coverage(metric, method, n, side)
        return found is not None and found >= self.threshold

    def needs(self, metric: str, method: str, side: str) -> int | None:
        """The smallest simulated size from which ``side`` covers at every larger simulated size (None: at none)."""
        sizes = sorted(self.table.get(metric, {}).get(method, {}).items())
        need = None
        for n, sides in reversed(sizes):
            if sides[side] < self.threshold:
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
