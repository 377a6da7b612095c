"""Tolerance checks of the verdict: one quality metric of one point on one domain against the full-depth run.

The change is the relative rise of a lower-better metric (perplexity) or the absolute drop of a higher-better one
(accuracies in [0, 1]); its 95% interval is paired over the units both runs share
(:func:`emad.evaluation.intervals.change_interval`, from the per-unit ``samples`` in the run files). A check is
``met`` when the whole interval lies within the tolerance, ``violated`` when it lies wholly beyond it, and
``unresolved`` when it straddles the tolerance or cannot be computed (fewer than 2 units, no samples in a run
file). When every paired unit is equal the interval is exactly {0}: met. A metric the full run has and the point
lacks is violated: it cannot be shown to hold. A check on fewer than :data:`MIN_UNITS` units is shown but does not
enter a point's state (DESIGN.md §4); a point none of whose checks enters is unresolved.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from emad.evaluation.intervals import MET, UNRESOLVED, VIOLATED, Interval, change_interval, tolerance_state
from emad.evaluation.metrics import quality_of, relative_tolerance, samples_of

STATE_RANK = {MET: 0, UNRESOLVED: 1, VIOLATED: 2}
MIN_UNITS = 8  # no check in the verdict rests on fewer units


@dataclass(frozen=True)
class Thresholds:
    """The paper's tolerances; see the module docstring."""

    min_flops_reduction: float = 0.15
    ppl_rel_tol: float = 0.01
    acc_abs_tol: float = 0.01
    min_speed_gain: float = 0.10

    def tolerance(self, metric: str) -> float:
        """``ppl_rel_tol`` for a lower-better metric (relative rise), ``acc_abs_tol`` otherwise (absolute drop)."""
        return self.ppl_rel_tol if relative_tolerance(metric) else self.acc_abs_tol


@dataclass
class Check:
    """One quality metric of one point on one domain against the full-depth run.

    ``change`` is the relative rise (lower-better metric) or the absolute drop (higher-better metric), ``inf``
    when the point lacks the metric; ``lo``/``hi`` its 95% interval over ``n`` units (None when undefined, with
    the reason in ``method``); ``state`` is ``met``, ``violated`` or ``unresolved``.
    """

    domain: str
    metric: str
    full: float
    value: float | None
    change: float
    tolerance: float
    relative: bool
    lo: float | None = None
    hi: float | None = None
    n: int | None = None
    method: str = "undefined: no per-unit samples"
    state: str = UNRESOLVED

    @property
    def ok(self) -> bool:
        """The tolerance is met at this sample size (the whole interval is within it)."""
        return self.state == MET

    @property
    def counted(self) -> bool:
        """Enters the verdict: the metric is missing (violated), or its interval rests on ≥ MIN_UNITS units."""
        return self.value is None or (self.n or 0) >= MIN_UNITS

    @property
    def severity(self) -> float:
        """``change / tolerance`` of the point estimates: above 1 is beyond the tolerance."""
        return self.change / self.tolerance if self.tolerance > 0 else (math.inf if self.change > 1e-9 else 0.0)

    @property
    def rank(self) -> tuple[int, float]:
        """Order of badness: the state first (violated > unresolved > met), then the severity."""
        return STATE_RANK[self.state], self.severity

    def interval_text(self) -> str:
        """``95% CI a to b, n N`` in the units of :meth:`describe`, or why it is undefined."""
        if self.lo is None or self.hi is None:
            why = self.method.removeprefix("undefined: ")
            return f"95% CI n/a: {why}" + (f", n {self.n}" if self.n is not None else "")
        if self.relative:
            return f"95% CI {self.lo:+.2%} to {self.hi:+.2%}, n {self.n}"
        return f"95% CI {-100 * self.hi:+.2f} to {-100 * self.lo:+.2f}, n {self.n}"  # as value − full, in points

    def describe(self) -> str:
        if self.value is None:
            return f"{self.metric} on {self.domain} is missing: {self.state}"
        aside = "" if self.counted else f" (not counted: fewer than {MIN_UNITS} units)"
        if self.relative:
            return (f"{self.metric} on {self.domain} {self.change:+.2%} ({self.interval_text()}; "
                    f"{self.full:.4g} → {self.value:.4g}; tolerance +{self.tolerance:.0%}): {self.state}{aside}")
        return (f"{self.metric} on {self.domain} {100 * (self.value - self.full):+.2f} points "
                f"({self.interval_text()}; {self.full:.4f} → {self.value:.4f}; "
                f"tolerance −{100 * self.tolerance:g} point): {self.state}{aside}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "change": self.change if math.isfinite(self.change) else None, "ok": self.ok,
                "counted": self.counted}


def change_of(metric: str, point_run: dict, full_run: dict) -> Interval | None:
    """The change of ``metric`` from ``full_run`` to ``point_run`` (relative rise of a lower-better metric,
    absolute drop of a higher-better one) with its paired 95% interval; None when a run kept no samples of it."""
    return _interval(metric, point_run, full_run, relative_tolerance(metric))


def _interval(metric: str, point_run: dict, full_run: dict, relative: bool) -> Interval | None:
    """The paired interval of the change, or None when a run file kept no samples of ``metric``."""
    point, full = samples_of(point_run.get("tasks", {}), metric), samples_of(full_run.get("tasks", {}), metric)
    if point is None or full is None:
        return None
    try:
        return change_interval(point[0], point[1], full[1], relative)
    except ValueError as err:
        raise ValueError(f"{point_run['run_id']} vs {full_run['run_id']}: {err}") from None


def build_check(domain: str, metric: str, point_run: dict, full_run: dict, tolerance: float) -> Check:
    """The check of ``metric`` for ``point_run`` against ``full_run`` (same model and domain)."""
    relative = relative_tolerance(metric)
    full = float(full_run["quality"][metric])
    value = point_run.get("quality", {}).get(metric)
    if value is None:
        return Check(domain, metric, full, None, math.inf, tolerance, relative, method="undefined: metric missing",
                     state=VIOLATED)
    value = float(value)
    if relative:
        change = value / full - 1.0 if full else (0.0 if value == full else math.inf)
    else:
        change = full - value
    iv = _interval(metric, point_run, full_run, relative)
    if iv is None:
        missing = [r["run_id"] for r in (point_run, full_run) if samples_of(r.get("tasks", {}), metric) is None]
        return Check(domain, metric, full, value, change, tolerance, relative,
                     method=f"undefined: no per-unit samples in {', '.join(missing)}", state=UNRESOLVED)
    return Check(domain, metric, full, value, change, tolerance, relative, iv.lo, iv.hi, iv.n, iv.method,
                 tolerance_state(iv, tolerance))


def screen(domain: str, tasks: dict[str, dict], reference: dict[str, dict],
           tolerance: Callable[[str], float]) -> list[Check]:
    """The counted checks a point's teacher-forced results (``tasks``, a run record's ``tasks``) violate against
    full depth's on the same units (``reference``) on ``domain``, as the verdict will judge them; ``tolerance`` of
    a metric name. Empty: the point may still decide the verdict (the decode stage then times it precisely)."""
    point, full = {"run_id": "point", "tasks": tasks, "quality": quality_of(tasks)}, \
        {"run_id": "full depth", "tasks": reference, "quality": quality_of(reference)}
    checks = [build_check(domain, m, point, full, tolerance(m)) for m in sorted(full["quality"])]
    return [c for c in checks if c.counted and c.state == VIOLATED]


def combined_state(checks: list[Check]) -> str:
    """The state of a set of checks, from those that enter the verdict (:attr:`Check.counted`): ``violated`` if
    one is, ``met`` if every one is, else ``unresolved`` (also when none enters)."""
    states = {c.state for c in checks if c.counted}
    return VIOLATED if VIOLATED in states else UNRESOLVED if UNRESOLVED in states or not states else MET


def tolerance_used(checks: list[Check]) -> float | None:
    """The largest ``change / tolerance`` among the ``checks`` that enter the verdict (1 = at the tolerance, above 1
    beyond it, ≤ 0 no worse than full depth); None without such checks."""
    return max((c.severity for c in checks if c.counted), default=None)
