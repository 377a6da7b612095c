"""Tolerance checks of the verdict: one quality metric of one point on one domain against the full-depth run.

The change is the relative rise of a lower-better metric (perplexity) or the absolute drop of a higher-better one
(scores in [0, 1]), against full depth **on the same units**, in the metric's own unit
(:data:`emad.evaluation.metrics.METRICS`), on one split of them (:mod:`emad.evaluation.units`: the verdict judges
the confirmation split, the screen and C2's early stop choose on the selection split). A point scored on fewer
units than full depth (token by token on the leading perplexity windows, ``decode.unserved_tokens``) is compared
with full depth on those units. Its 95% interval is paired over them
(:func:`emad.evaluation.intervals.change_interval`, from the per-unit ``samples`` in the run files). A check is

- ``met`` when the whole interval lies within the tolerance; when every paired unit is equal, only when the exact
  95% bound on the share of differing units (in the metric's own unit) is within it — never for a relative metric;
- ``violated`` when the interval lies wholly beyond the tolerance;
- ``unresolved`` when it straddles the tolerance or cannot be computed (no samples, a metric missing);
- ``identical by construction`` where the run file's proof (:mod:`emad.evaluation.proof`) says its output is full
  depth's, whatever the sample size;
- ``not counted (n < 8)`` on fewer than :data:`MIN_UNITS` units: shown, but in no count, curve or verdict;
- ``ruled out by the screen`` for a task the point did not run because a teacher-forced check ruled it out: no
  measurement of its own (the point's measured teacher-forced violation stands for it).

A check also states its power: the units it would need to be met with every unit equal (:attr:`Check.needs`, 368
for one point at 95%, more at the stricter level of a claim resting on several points) against those it has, and
whether the side of its interval a label rests on covers at its size (:mod:`emad.evaluation.coverage`: the coverage
table in force; a bootstrap's upper bound on a few units of which one changed a lot does not). One that cannot be
met at its size, or whose label its interval cannot carry there, is *underpowered*: kept out of the gate (its reason
said), unless its data show it violated with a lower bound that covers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from emad.evaluation import coverage
from emad.evaluation.intervals import (
    LEVEL,
    Interval,
    change_interval,
    metric_value,
    tolerance_state,
)
from emad.evaluation.metrics import METRICS, quality_of, relative_tolerance, samples_of
from emad.evaluation.states import (
    IDENTICAL,
    MET,
    MIN_UNITS,
    NOT_COUNTED,
    RULED_OUT,
    UNRESOLVED,
    VIOLATED,
    State,
)
from emad.evaluation.units import ALL, CONFIRMATION, SELECTION, Units

MIN_SPEED_PROMPTS = 8  # C2 reads a speed-up only from this many distinct prompts per domain

STATE_RANK = {NOT_COUNTED: -1, IDENTICAL: 0, MET: 0, UNRESOLVED: 1, VIOLATED: 2, RULED_OUT: 2}


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
    """One quality metric of one point on one domain against the full-depth run, on one split of its units.

    ``full`` and ``value`` are the metric on the judged units; ``change`` is the relative rise (lower-better
    metric) or the absolute drop (higher-better metric), None without a measurement; ``lo``/``hi`` its 95% interval
    over ``n`` units (None when undefined, with the reason in ``method``); ``unit`` what one sample is (a
    token-level metric's prompt); ``needs``/``has`` the units a check needs to be met with every unit equal and
    those it has (None: no such bound, a relative metric); ``units`` the split judged; ``untrusted``: why the label
    its interval reads was withheld (the side it rests on does not cover at this size, :mod:`emad.evaluation.coverage`)
    and ``covers_from`` the size from which it would.
    """

    domain: str
    metric: str
    full: float | None
    value: float | None
    change: float | None
    tolerance: float
    relative: bool
    lo: float | None = None
    hi: float | None = None
    n: int | None = None
    method: str = "undefined: no per-unit samples"
    state: State = UNRESOLVED
    unit: str = "unit"
    needs: int | None = None
    has: int | None = None
    units: str = CONFIRMATION
    level: float = LEVEL
    all_equal: bool = False
    untrusted: str | None = None
    covers_from: int | None = None
    blocks: int | None = None
    changed: int | None = None
    nominal: float | None = None  # the level it was to be judged at, where it was judged at a wider ``level``

    @property
    def ok(self) -> bool:
        """The tolerance is met at this sample size (or the point is full depth by construction)."""
        return self.state in (MET, IDENTICAL)

    @property
    def measured(self) -> bool:
        """The point has a value of this metric (its task ran)."""
        return self.change is not None

    @property
    def underpowered(self) -> bool:
        """Cannot be decided at its size: fewer units than :attr:`needs`, or a label withheld because its interval
        does not cover there (:attr:`untrusted`) (not for a check identical by construction)."""
        if self.state == IDENTICAL:
            return False
        return self.untrusted is not None or (self.needs is not None and self.has is not None
                                              and self.has < self.needs)

    @property
    def counted(self) -> bool:
        """Enters the gate, counts and curves: measured, on ≥ :data:`MIN_UNITS` units, and not underpowered —
        unless its data show it violated."""
        if self.state == IDENTICAL:
            return True
        if not self.measured or self.state == NOT_COUNTED:
            return False
        return self.state == VIOLATED or not self.underpowered

    @property
    def severity(self) -> float | None:
        """``change / tolerance`` of the point estimates (above 1: beyond the tolerance); None when not measured."""
        if self.change is None:
            return None
        return self.change / self.tolerance if self.tolerance > 0 else (math.inf if self.change > 1e-9 else 0.0)

    @property
    def rank(self) -> tuple[int, float]:
        """Order of badness: the state first (violated > unresolved > met), then the severity."""
        return STATE_RANK[self.state], self.severity if self.severity is not None else -math.inf

    def power_text(self) -> str:
        """``needs ≥ 368 prompts with every one equal; has 24``, or why its interval carries no label at its size
        (or why it has no such bound)."""
        if self.untrusted is not None:
            wants = f"; covers from n {self.covers_from}" if self.covers_from else "; at no simulated size"
            return f"{self.untrusted}{wants}"
        if self.needs is None:
            return "met only by a paired interval (or identity by construction)"
        return f"needs ≥ {self.needs} {self.unit}s with every one equal; has {self.has}"

    def interval_text(self) -> str:
        """``95% CI a to b, n N`` in the units of :meth:`describe`, or why it is undefined."""
        if self.lo is None or self.hi is None:
            why = self.method.removeprefix("undefined: ")
            return f"95% CI n/a: {why}" + (f", n {self.n}" if self.n is not None else "")
        if self.all_equal:  # every paired unit equal: the bound on the share that differ
            return f"{self.method.removeprefix('exact: ')}, n {self.n}"
        ci = f"{100 * self.level:.4g}% CI"
        if self.nominal is not None:
            ci += f" (calibrated from {100 * self.nominal:.4g}%)"
        n = f"n {self.n}" + (f" in {self.blocks} blocks" if self.blocks is not None and self.blocks < self.n else "")
        if self.relative:
            return f"{ci} {self.lo:+.2%} to {self.hi:+.2%}, {n}"
        return f"{ci} {-100 * self.hi:+.2f} to {-100 * self.lo:+.2f}, {n}"  # as value − full, in points

    @property
    def half(self) -> str:
        """Which half of the units the check reads: ``confirmation half``, ``selection half`` or ``every unit``."""
        for which in (CONFIRMATION, SELECTION):
            if which in self.units:
                return f"{which} half"
        return "every unit"

    def describe(self) -> str:
        state = f"{self.state}, underpowered ({self.power_text()})" if self.underpowered else str(self.state)
        where = f"{self.metric} on {self.domain} ({self.half})"
        if self.value is None or self.full is None:
            return f"{where}: {self.method.removeprefix('undefined: ')}: {state}"
        if self.relative:
            return (f"{where} {self.change:+.2%} ({self.interval_text()} {self.unit}s; "
                    f"{self.full:.4g} → {self.value:.4g}; tolerance +{self.tolerance:.0%}): {state}")
        return (f"{where} {100 * (self.value - self.full):+.2f} points "
                f"({self.interval_text()} {self.unit}s; {self.full:.4f} → {self.value:.4f}; "
                f"tolerance −{100 * self.tolerance:g} point): {state}")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["state"] = str(self.state)
        if self.change is not None and not math.isfinite(self.change):
            out["change"] = None
        return {**out, "ok": self.ok, "counted": self.counted, "underpowered": self.underpowered}


def paired_units(metric: str, point_run: dict, full_run: dict, units: Units
                 ) -> tuple[str, list, list, list[int]] | None:
    """``(key, point samples, full depth's samples, block of each unit)`` on the same units of ``units``' split;
    None when a run kept none. A point with fewer units scored full depth's leading ones
    (:meth:`emad.tasks.registry.Task.fewer`). The blocks are the split's (:data:`emad.evaluation.units.BLOCK`
    consecutive units), which a bootstrap resamples whole."""
    point, full = samples_of(point_run.get("tasks", {}), metric), samples_of(full_run.get("tasks", {}), metric)
    if point is None or full is None:
        return None
    task = METRICS.get(metric).task
    leading = full[1][:len(point[1])]
    return point[0], units.take(task, point[1]), units.take(task, leading), units.blocks(task, len(point[1]))


def full_on_units(metric: str, point_run: dict, full_run: dict, units: Units = Units(ALL)) -> float | None:
    """Full depth's ``metric`` on the units ``point_run`` scored, in ``units``' split (its whole value when they
    share every unit); None when full depth lacks the metric."""
    if metric not in full_run.get("quality", {}):
        return None
    same = paired_units(metric, point_run, full_run, units)
    if same is None or (units.which == ALL and len(same[2]) == len(samples_of(full_run["tasks"], metric)[1])):
        return float(full_run["quality"][metric])
    return metric_value(same[0], same[2])


def change_of(metric: str, point_run: dict, full_run: dict, units: Units = Units(ALL)) -> Interval | None:
    """The change of ``metric`` from ``full_run`` to ``point_run`` on the point's units (relative rise of a
    lower-better metric, absolute drop of a higher-better one) with its paired 95% interval; None when a run kept
    no samples of it."""
    return _interval(metric, point_run, full_run, units)


def _interval(metric: str, point_run: dict, full_run: dict, units: Units, level: float = LEVEL) -> Interval | None:
    """The paired interval of the change on the point's units, or None when a run file kept no samples."""
    same = paired_units(metric, point_run, full_run, units)
    if same is None:
        return None
    key, point, full, blocks = same
    m = METRICS.get(metric)
    try:
        return change_interval(key, point, full, m.tolerance == "relative", m.bound_units(point), level, m.noise,
                               blocks)
    except ValueError as err:
        raise ValueError(f"{point_run['run_id']} vs {full_run['run_id']}: {err}") from None


def proved_identical(run: dict) -> bool:
    """The run file's proof says its output is full depth's (:mod:`emad.evaluation.proof`)."""
    return bool((run.get("identity") or {}).get("proved"))


def build_check(domain: str, metric: str, point_run: dict, full_run: dict, tolerance: float,
                units: Units | None = None, level: float = LEVEL) -> Check:
    """The check of ``metric`` for ``point_run`` against ``full_run`` (same model and domain) on the point's
    units in ``units``' split (default: the confirmation split under the point's recorded seed), its interval at
    ``level`` (above 95% where one claim rests on several points)."""
    units = units or Units(CONFIRMATION, int((point_run.get("split") or {}).get("seed", 0)))
    m = METRICS.get(metric)
    relative = relative_tolerance(metric)
    base = dict(unit=m.sampled, needs=m.needs(tolerance, level), units=units.describe(), level=level)
    value = point_run.get("quality", {}).get(metric)
    if value is None:  # a task the point did not run (the teacher-forced screen ruled it out), or a metric missing
        not_run = point_run.get("not_run", {}).get(m.task)
        if not_run is not None:
            return Check(domain, metric, None, None, None, tolerance, relative, method=f"undefined: not run: {not_run}",
                         state=RULED_OUT, **base)
        return Check(domain, metric, None, None, None, tolerance, relative, method="undefined: metric missing",
                     state=UNRESOLVED, **base)
    same = paired_units(metric, point_run, full_run, units)
    if same is None:
        missing = [r["run_id"] for r in (point_run, full_run) if samples_of(r.get("tasks", {}), metric) is None]
        full, value = full_on_units(metric, point_run, full_run), float(value)
        change = value / full - 1.0 if relative and full else full - value if not relative else math.inf
        check = Check(domain, metric, full, value, change, tolerance, relative,
                      method=f"undefined: no per-unit samples in {', '.join(missing)}", state=UNRESOLVED, **base)
    else:
        key, point, reference, _ = same
        iv = _interval(metric, point_run, full_run, units, level)
        full, value = metric_value(key, reference), metric_value(key, point)
        check = Check(domain, metric, full, value, iv.value, tolerance, relative, iv.lo, iv.hi, iv.n, iv.method,
                      tolerance_state(iv, tolerance), has=m.bound_units(point) if point else 0,
                      all_equal=iv.all_equal, blocks=iv.blocks, changed=iv.changed, **base)
    if proved_identical(point_run):
        check.state = IDENTICAL
    elif check.n is not None and check.n < MIN_UNITS:
        check.state = NOT_COUNTED
    else:
        _calibrate(check, coverage.active(), lambda at: _interval(metric, point_run, full_run, units, at))
    return check


def _calibrate(check: Check, table: coverage.Coverage | None, at_level: Callable[[float], Interval | None]) -> None:
    """A met (violated) label rests on its interval's upper (lower) side. Where that side does not cover at the
    check's size and changed units under ``table``, the check is judged at the smallest simulated level where it
    does (``at_level`` recomputes its interval there; the label stands only if the wider bound still carries it);
    where no simulated level covers, the label is withheld: the check becomes unresolved and says why
    (:attr:`Check.untrusted`)."""
    if table is None or check.state not in (MET, VIOLATED) or check.all_equal or check.n is None:
        return
    method, side = coverage.family(check.method), "upper" if check.state == MET else "lower"
    found = table.calibrated(check.metric, method, check.n, side, check.level, check.changed)
    if found is None:
        near = table.nearest(check.metric, method, check.n, side, check.level, check.changed)
        measured = (f"covers {near[1].coverage:.1%} at {100 * near[0]:.4g}% (Monte Carlo lower bound "
                    f"{near[1].lower:.1%})" if near else "was not simulated")
        check.untrusted = (f"{check.state} withheld: the {side} bound of its {method} interval {measured} at n "
                           f"{check.n}" + (f" with {check.changed} changed" if check.changed is not None else "")
                           + f", and at no simulated level reaches {coverage.target(check.level):.1%}")
        check.covers_from = table.needs(check.metric, method, side, check.level, check.changed)
        check.state = UNRESOLVED
        return
    if found <= check.level + 1e-9:
        return
    wider = at_level(found)
    if wider is None or not wider.defined:
        return
    check.nominal, check.level, check.lo, check.hi, check.method = check.level, found, wider.lo, wider.hi, wider.method
    check.state = tolerance_state(wider, check.tolerance)


def checks_against(domain: str, tasks: dict[str, dict], reference: dict[str, dict],
                   tolerance: Callable[[str], float], units: Units, identity: dict | None = None) -> list[Check]:
    """Every check of a point's results (``tasks``, a run record's ``tasks``) against full depth's on the same units
    (``reference``) on ``domain``, in ``units``' split; ``tolerance`` of a metric name; ``identity``: the point's
    proof as its run file records it (:func:`emad.evaluation.proof.prove_identical`)."""
    point, full = {"run_id": "point", "tasks": tasks, "quality": quality_of(tasks), "identity": identity}, \
        {"run_id": "full depth", "tasks": reference, "quality": quality_of(reference)}
    return [build_check(domain, m, point, full, tolerance(m), units) for m in sorted(full["quality"])]


def screen(domain: str, tasks: dict[str, dict], reference: dict[str, dict],
           tolerance: Callable[[str], float], seed: int) -> list[Check]:
    """The counted checks of :func:`checks_against` on the selection split that a point's teacher-forced results
    violate. Empty: the point may still decide the verdict (the decode stage then times it precisely)."""
    return [c for c in checks_against(domain, tasks, reference, tolerance, Units(SELECTION, seed))
            if c.counted and c.state == VIOLATED]


def combined_state(checks: list[Check]) -> State:
    """The state of a set of checks: ``ruled out by the screen`` if one is; else from those that enter the gate
    (:attr:`Check.counted`): ``violated`` if one is, ``met`` if every one is met or identical by construction,
    else ``unresolved`` (also when none enters)."""
    if any(c.state == RULED_OUT for c in checks):
        return RULED_OUT
    states = {MET if c.state == IDENTICAL else c.state for c in checks if c.counted}
    return VIOLATED if VIOLATED in states else UNRESOLVED if UNRESOLVED in states or not states else MET


def tolerance_used(checks: list[Check]) -> float | None:
    """The largest ``change / tolerance`` among the ``checks`` that enter the verdict (1 = at the tolerance, above 1
    beyond it, ≤ 0 no worse than full depth); None without such checks."""
    return max((c.severity for c in checks if c.counted and c.severity is not None), default=None)
