"""Tolerance checks of the verdict: one quality metric of one point on one domain against the full-depth run.

The change is the relative rise of a lower-better metric (perplexity) or the absolute drop of a higher-better one
(accuracies in [0, 1]), against full depth **on the same units**: a point scored on fewer units than full depth
(token by token on the leading perplexity windows, ``decode.unserved_tokens``) is compared with full depth on
those units (:func:`full_on_units`). Its 95% interval is paired over them
(:func:`emad.evaluation.intervals.change_interval`, from the per-unit ``samples`` in the run files). A check is

- ``met`` when the whole interval lies within the tolerance; when every paired unit is equal, only when the exact
  95% bound on the share of differing units (finest unit: tokens where a task counts them) is within it;
- ``violated`` when the interval lies wholly beyond the tolerance, or the point lacks a metric full depth has;
- ``unresolved`` when it straddles the tolerance or cannot be computed (no samples in a run file);
- ``identical by construction`` for a point that never exits (every token ran every layer: its results are full
  depth's), whatever the sample size;
- ``not counted (n < 8)`` on fewer than :data:`MIN_UNITS` units: shown, but in no count, curve or verdict
  (DESIGN.md §4). A point none of whose checks is counted is unresolved.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from emad.evaluation.intervals import (
    MET,
    UNRESOLVED,
    VIOLATED,
    Interval,
    change_interval,
    metric_value,
    tolerance_state,
)
from emad.evaluation.metrics import METRICS, quality_of, relative_tolerance, samples_of

MIN_UNITS = 8  # no check in the verdict rests on fewer units
MIN_SPEED_PROMPTS = 8  # C2 reads a speed-up only from this many distinct prompts per domain
IDENTICAL = "identical by construction"  # a point that never exits: full depth's results
NOT_COUNTED = f"not counted (n < {MIN_UNITS})"
STATE_RANK = {NOT_COUNTED: -1, IDENTICAL: 0, MET: 0, UNRESOLVED: 1, VIOLATED: 2}


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
        """The tolerance is met at this sample size (or the point is full depth by construction)."""
        return self.state in (MET, IDENTICAL)

    @property
    def counted(self) -> bool:
        """Enters counts, curves and the verdict: every state but :data:`NOT_COUNTED`."""
        return self.state != NOT_COUNTED

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
        if self.method.startswith("exact: 0 of"):  # every paired unit equal: the bound on the share that differ
            return f"{self.method.removeprefix('exact: ')}, n {self.n}"
        if self.relative:
            return f"95% CI {self.lo:+.2%} to {self.hi:+.2%}, n {self.n}"
        return f"95% CI {-100 * self.hi:+.2f} to {-100 * self.lo:+.2f}, n {self.n}"  # as value − full, in points

    def describe(self) -> str:
        if self.value is None:
            return f"{self.metric} on {self.domain}: {self.method.removeprefix('undefined: ')}: {self.state}"
        if self.relative:
            return (f"{self.metric} on {self.domain} {self.change:+.2%} ({self.interval_text()}; "
                    f"{self.full:.4g} → {self.value:.4g}; tolerance +{self.tolerance:.0%}): {self.state}")
        return (f"{self.metric} on {self.domain} {100 * (self.value - self.full):+.2f} points "
                f"({self.interval_text()}; {self.full:.4f} → {self.value:.4f}; "
                f"tolerance −{100 * self.tolerance:g} point): {self.state}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "change": self.change if math.isfinite(self.change) else None, "ok": self.ok,
                "counted": self.counted}


def never_exits(run: dict) -> bool:
    """Every token of ``run`` ran all ``n_layers`` layers (its exit-depth histogram holds L alone)."""
    depths = {int(d) for d, n in (run.get("depth_histogram") or {}).items() if n}
    return bool(depths) and run.get("n_layers") is not None and depths == {int(run["n_layers"])}


def _same_units(metric: str, point_run: dict, full_run: dict) -> tuple[str, list, list] | None:
    """``(key, point samples, full depth's samples on the point's units)``; None when a run kept none. A point
    with fewer units scored full depth's leading ones (:meth:`emad.tasks.registry.Task.fewer`)."""
    point, full = samples_of(point_run.get("tasks", {}), metric), samples_of(full_run.get("tasks", {}), metric)
    if point is None or full is None:
        return None
    return point[0], point[1], full[1][:len(point[1])] if len(point[1]) < len(full[1]) else full[1]


def full_on_units(metric: str, point_run: dict, full_run: dict) -> float | None:
    """Full depth's ``metric`` on the units ``point_run`` scored (its whole value when they share all units);
    None when full depth lacks the metric."""
    if metric not in full_run.get("quality", {}):
        return None
    same = _same_units(metric, point_run, full_run)
    if same is None or len(same[2]) == len(samples_of(full_run["tasks"], metric)[1]):
        return float(full_run["quality"][metric])
    return metric_value(same[0], same[2])


def change_of(metric: str, point_run: dict, full_run: dict) -> Interval | None:
    """The change of ``metric`` from ``full_run`` to ``point_run`` on the point's units (relative rise of a
    lower-better metric, absolute drop of a higher-better one) with its paired 95% interval; None when a run kept
    no samples of it."""
    return _interval(metric, point_run, full_run, relative_tolerance(metric))


def _interval(metric: str, point_run: dict, full_run: dict, relative: bool) -> Interval | None:
    """The paired interval of the change on the point's units, or None when a run file kept no samples."""
    same = _same_units(metric, point_run, full_run)
    if same is None:
        return None
    key, point, full = same
    task = METRICS.get(metric).task
    finest = point_run["tasks"][task].get("finest_units", {}).get(key)
    try:
        return change_interval(key, point, full, relative, finest)
    except ValueError as err:
        raise ValueError(f"{point_run['run_id']} vs {full_run['run_id']}: {err}") from None


def build_check(domain: str, metric: str, point_run: dict, full_run: dict, tolerance: float) -> Check:
    """The check of ``metric`` for ``point_run`` against ``full_run`` (same model and domain) on the point's
    units."""
    relative = relative_tolerance(metric)
    full = full_on_units(metric, point_run, full_run)
    value = point_run.get("quality", {}).get(metric)
    if value is None:  # a task the point did not run (the teacher-forced screen ruled it out), or a metric missing
        task = METRICS.get(metric).task
        why = "not run: " + point_run["not_run"][task] if task in point_run.get("not_run", {}) else "metric missing"
        return Check(domain, metric, full, None, math.inf, tolerance, relative, method=f"undefined: {why}",
                     state=VIOLATED)
    value = float(value)
    if relative:
        change = value / full - 1.0 if full else (0.0 if value == full else math.inf)
    else:
        change = full - value
    iv = _interval(metric, point_run, full_run, relative)
    if iv is None:
        missing = [r["run_id"] for r in (point_run, full_run) if samples_of(r.get("tasks", {}), metric) is None]
        check = Check(domain, metric, full, value, change, tolerance, relative,
                      method=f"undefined: no per-unit samples in {', '.join(missing)}", state=UNRESOLVED)
    else:
        check = Check(domain, metric, full, value, change, tolerance, relative, iv.lo, iv.hi, iv.n, iv.method,
                      tolerance_state(iv, tolerance))
    if never_exits(point_run):
        check.state = IDENTICAL
    elif check.n is not None and check.n < MIN_UNITS:
        check.state = NOT_COUNTED
    return check


def checks_against(domain: str, tasks: dict[str, dict], reference: dict[str, dict],
                   tolerance: Callable[[str], float]) -> list[Check]:
    """Every check of a point's results (``tasks``, a run record's ``tasks``) against full depth's on the same units
    (``reference``) on ``domain``, as the verdict will judge them; ``tolerance`` of a metric name."""
    point, full = {"run_id": "point", "tasks": tasks, "quality": quality_of(tasks)}, \
        {"run_id": "full depth", "tasks": reference, "quality": quality_of(reference)}
    return [build_check(domain, m, point, full, tolerance(m)) for m in sorted(full["quality"])]


def screen(domain: str, tasks: dict[str, dict], reference: dict[str, dict],
           tolerance: Callable[[str], float]) -> list[Check]:
    """The counted checks of :func:`checks_against` that a point's teacher-forced results violate. Empty: the
    point may still decide the verdict (the decode stage then times it precisely)."""
    return [c for c in checks_against(domain, tasks, reference, tolerance) if c.counted and c.state == VIOLATED]


def combined_state(checks: list[Check]) -> str:
    """The state of a set of checks, from those that enter the verdict (:attr:`Check.counted`): ``violated`` if
    one is, ``met`` if every one is met or identical by construction, else ``unresolved`` (also when none
    enters)."""
    states = {MET if c.state == IDENTICAL else c.state for c in checks if c.counted}
    return VIOLATED if VIOLATED in states else UNRESOLVED if UNRESOLVED in states or not states else MET


def tolerance_used(checks: list[Check]) -> float | None:
    """The largest ``change / tolerance`` among the ``checks`` that enter the verdict (1 = at the tolerance, above 1
    beyond it, ≤ 0 no worse than full depth); None without such checks."""
    return max((c.severity for c in checks if c.counted), default=None)
