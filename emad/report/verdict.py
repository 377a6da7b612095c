"""The falsification verdict of DESIGN.md §4, per model, from run records.

- Reference: the ``full`` run of the model on each domain.
- Operating point: runs with the same point name and calibration source; only points evaluated on every domain
  of the model count (the others are listed as incomplete).
- FLOPs reduction of a point: ``1 − Σ_d tokens_d · flops_ratio_d / Σ_d tokens_d`` — token-weighted over its
  domains (``cost.tokens``; an unweighted mean when a run lacks a token count).
- Speed-up of a point: time the full-depth runs would take for the point's tokens over the time the point took,
  ``Σ_d (tokens_d / tps_full_d) / Σ_d (tokens_d / tps_d)`` — one wall-clock ratio on the same workload.
- Tolerances, per domain and quality metric present in the full run: a lower-better metric (perplexity) may rise
  by ``ppl_rel_tol`` relative; a higher-better one (accuracies in [0, 1]) may drop by ``acc_abs_tol`` absolute.
  A metric the full run has and the point lacks is a violation (it cannot be shown to hold).
- C1: some point reduces FLOPs by ≥ ``min_flops_reduction`` within every tolerance. Otherwise falsified.
- C2: among points within every tolerance (matched accuracy), the best speed-up is ≥ ``1 + min_speed_gain``.
  Otherwise falsified.
- Literal reading: "some operating point with ≥ 15% reduction degrades more than the tolerance" — true or false,
  with those points (it can be true while C1 passes).

Comparisons allow a slack of 1e-9 so that values exactly at a threshold pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from emad.report.pareto import FULL, baselines, higher_is_better, point_label

EPS = 1e-9


@dataclass(frozen=True)
class Thresholds:
    """The paper's tolerances; see the module docstring."""

    min_flops_reduction: float = 0.15
    ppl_rel_tol: float = 0.01
    acc_abs_tol: float = 0.01
    min_speed_gain: float = 0.10


@dataclass
class Check:
    """One quality metric of one point on one domain against the full-depth run.

    ``change`` is the relative rise (lower-better metric) or the absolute drop (higher-better metric); ``inf``
    when the point lacks the metric.
    """

    domain: str
    metric: str
    full: float
    value: float | None
    change: float
    tolerance: float
    relative: bool

    @property
    def ok(self) -> bool:
        return self.change <= self.tolerance + EPS

    @property
    def severity(self) -> float:
        """``change / tolerance``: above 1 is a violation."""
        return self.change / self.tolerance if self.tolerance > 0 else (math.inf if self.change > EPS else 0.0)

    def describe(self) -> str:
        if self.value is None:
            return f"{self.metric} on {self.domain} is missing"
        if self.relative:
            return (f"{self.metric} on {self.domain} {self.change:+.2%} "
                    f"({self.full:.4g} → {self.value:.4g}; tolerance +{self.tolerance:.0%})")
        return (f"{self.metric} on {self.domain} {100 * (self.value - self.full):+.2f} points "
                f"({self.full:.4f} → {self.value:.4f}; tolerance −{100 * self.tolerance:g} point)")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "change": _num(self.change), "ok": self.ok}


@dataclass
class PointAssessment:
    """One operating point of the model, aggregated over all its domains."""

    label: str
    point: str
    calibration: str | None
    family: str
    domains: list[str]
    run_ids: list[str]
    mlflow_run_ids: list[str]
    flops_ratio: float
    speedup: float | None
    checks: list[Check] = field(default_factory=list)

    @property
    def reduction(self) -> float:
        return 1.0 - self.flops_ratio

    @property
    def within_tolerance(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def worst(self) -> Check | None:
        """The check closest to (or furthest past) its tolerance."""
        return max(self.checks, key=lambda c: c.severity, default=None)

    def to_dict(self) -> dict[str, Any]:
        worst = self.worst
        return {"label": self.label, "point": self.point, "calibration": self.calibration, "family": self.family,
                "domains": self.domains, "run_ids": self.run_ids, "mlflow_run_ids": self.mlflow_run_ids,
                "flops_ratio": self.flops_ratio, "flops_reduction": self.reduction, "speedup": self.speedup,
                "within_tolerance": self.within_tolerance, "worst": worst.describe() if worst else None,
                "checks": [c.to_dict() for c in self.checks]}


@dataclass
class C1Result:
    """C1 and its literal reading. ``deciding``: the passing point with the largest reduction, else the point
    with ≥ the required reduction closest to passing, else the point with the largest reduction."""

    passed: bool
    deciding: PointAssessment | None
    literal: bool
    literal_points: list[str]
    text: str

    @property
    def falsified(self) -> bool:
        return not self.passed

    def sentence(self) -> str:
        return self.text

    def literal_sentence(self, min_reduction: float) -> str:
        head = (f"Literal reading: some operating point with ≥ {min_reduction:.0%} reduction degrades more "
                "than the tolerance")
        return f"{head} — true: {', '.join(self.literal_points)}." if self.literal else f"{head} — false."

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "falsified": self.falsified, "deciding": _label(self.deciding),
                "literal": self.literal, "literal_points": self.literal_points, "text": self.text}


@dataclass
class C2Result:
    """C2. ``deciding``: the point within every tolerance with the best speed-up (None when there is none)."""

    passed: bool
    deciding: PointAssessment | None
    matched: list[str]
    text: str

    @property
    def falsified(self) -> bool:
        return not self.passed

    def sentence(self) -> str:
        return self.text

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "falsified": self.falsified, "deciding": _label(self.deciding),
                "speedup": self.deciding.speedup if self.deciding else None, "matched": self.matched,
                "text": self.text}


@dataclass
class ModelVerdict:
    """C1 and C2 for one model and one set of method families."""

    model: str
    methods: tuple[str, ...]
    domains: list[str]
    thresholds: Thresholds
    points: list[PointAssessment]
    incomplete: list[str]
    c1: C1Result
    c2: C2Result

    def sentence(self) -> str:
        """Human text: one line per criterion, then the literal reading."""
        who = f"{self.model} ({'/'.join(self.methods)})"
        return "\n".join([f"{who} — {self.c1.sentence()}", f"{who} — {self.c2.sentence()}",
                          f"{who} — {self.c1.literal_sentence(self.thresholds.min_flops_reduction)}"])

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "methods": list(self.methods), "domains": self.domains,
                "thresholds": asdict(self.thresholds), "c1": self.c1.to_dict(), "c2": self.c2.to_dict(),
                "incomplete": self.incomplete, "points": [p.to_dict() for p in self.points]}


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _label(p: PointAssessment | None) -> str | None:
    return p.label if p else None


def _check(domain: str, metric: str, full: float, value: float | None, thr: Thresholds) -> Check:
    relative = not higher_is_better(metric)
    tol = thr.ppl_rel_tol if relative else thr.acc_abs_tol
    if value is None:
        change = math.inf
    elif relative:
        change = value / full - 1.0 if full else (0.0 if value == full else math.inf)
    else:
        change = full - value
    return Check(domain, metric, full, value, change, tol, relative)


def _token_weights(runs: Sequence[dict]) -> list[float]:
    tokens = [r.get("cost", {}).get("tokens") for r in runs]
    if all(isinstance(t, int | float) and t > 0 for t in tokens):
        return [float(t) for t in tokens]
    return [1.0] * len(runs)


def _aggregate_speedup(runs: Sequence[dict], bases: Sequence[dict], weights: Sequence[float]) -> float | None:
    try:
        full_time = sum(w / b["cost"]["tokens_per_s"] for w, b in zip(weights, bases))
        time = sum(w / r["cost"]["tokens_per_s"] for w, r in zip(weights, runs))
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    return full_time / time if time > 0 else None


def assess_point(runs: Sequence[dict], base: dict[tuple[str, str], dict], thr: Thresholds) -> PointAssessment:
    """Aggregate one operating point's runs (one per domain) and check every tolerance."""
    runs = sorted(runs, key=lambda r: r["domain"])
    bases = [base[(r["model"], r["domain"])] for r in runs]
    weights = _token_weights(runs)
    flops = sum(w * r["cost"]["flops_ratio"] for w, r in zip(weights, runs)) / sum(weights)
    checks = [_check(r["domain"], m, float(full), r.get("quality", {}).get(m), thr)
              for r, b in zip(runs, bases) for m, full in sorted(b.get("quality", {}).items())]
    first = runs[0]
    return PointAssessment(point_label(first), first["point"], first.get("calibration"),
                           "/".join(sorted({r["family"] for r in runs})), [r["domain"] for r in runs],
                           [r["run_id"] for r in runs], [r["mlflow_run_id"] for r in runs if r.get("mlflow_run_id")],
                           flops, _aggregate_speedup(runs, bases, weights), checks)


def _c1(points: list[PointAssessment], thr: Thresholds, methods: str, domains: list[str]) -> C1Result:
    need = thr.min_flops_reduction
    big = [p for p in points if p.reduction >= need - EPS]
    passing = sorted((p for p in big if p.within_tolerance), key=lambda p: (-p.reduction, p.label))
    literal = sorted(p.label for p in big if not p.within_tolerance)
    if passing:
        p, w = passing[0], passing[0].worst
        text = (f"C1 passes (not falsified): {p.label} cuts FLOPs by {p.reduction:.1%} (token-weighted over "
                f"{len(p.domains)} domains) within every tolerance" + (f"; tightest check: {w.describe()}." if w else "."))
        return C1Result(True, p, bool(literal), literal, text)
    if big:
        p = min(big, key=lambda p: (p.worst.severity, -p.reduction, p.label))
        text = (f"C1 fails (falsified): no operating point with ≥ {need:.0%} FLOP reduction stays within the "
                f"tolerances; closest: {p.label} ({p.reduction:.1%} reduction), worst violation: "
                f"{p.worst.describe()}.")
        return C1Result(False, p, True, literal, text)
    if points:
        p = min(points, key=lambda p: (-p.reduction, p.label))
        text = (f"C1 fails (falsified): no operating point reaches a {need:.0%} FLOP reduction; the largest is "
                f"{p.label} with {p.reduction:.1%}.")
        return C1Result(False, p, False, [], text)
    text = (f"C1 fails (falsified): no operating point of family {methods} was evaluated on every domain "
            f"({', '.join(domains)}).")
    return C1Result(False, None, False, [], text)


def _c2(points: list[PointAssessment], thr: Thresholds) -> C2Result:
    need = 1.0 + thr.min_speed_gain
    matched = [p for p in points if p.within_tolerance]
    labels = sorted(p.label for p in matched)
    timed = sorted((p for p in matched if p.speedup is not None), key=lambda p: (-p.speedup, p.label))
    if not matched:
        return C2Result(False, None, [], "C2 fails (falsified): no operating point stays within the quality "
                                         "tolerances.")
    if not timed:
        return C2Result(False, None, labels, "C2 fails (falsified): no tokens/s measurement for the points "
                                             f"within the tolerances ({', '.join(labels)}).")
    p = timed[0]
    ok = p.speedup >= need - EPS
    verb = "passes (not falsified)" if ok else "fails (falsified)"
    cmp = "≥" if ok else "<"
    text = (f"C2 {verb}: at matched accuracy the best point, {p.label}, runs {p.speedup:.2f}× the full-depth "
            f"tokens/s (gain {p.speedup - 1:+.1%} {cmp} {thr.min_speed_gain:.0%}).")
    return C2Result(ok, p, labels, text)


def _model_domains(runs: Sequence[dict], base: dict, model: str) -> list[str]:
    domains = sorted({r["domain"] for r in runs if r["model"] == model})
    missing = [d for d in domains if (model, d) not in base]
    if missing:
        raise ValueError(f"no full-depth run for model {model!r} on domain(s) {', '.join(missing)}: the verdict "
                         "compares every operating point against it (add a `full` point to decode.points)")
    return domains


def model_verdict(runs: Sequence[dict], model: str, methods: Sequence[str] = ("emad",),
                  thresholds: Thresholds | None = None) -> ModelVerdict:
    """C1 and C2 for one model; only runs whose family is in ``methods`` count as operating points.

    Raises:
        ValueError: the model has no runs, or lacks a full-depth run on one of its domains.
    """
    thr = thresholds or Thresholds()
    base = baselines(runs)
    if not any(r["model"] == model for r in runs):
        raise ValueError(f"no runs for model {model!r}")
    domains = _model_domains(runs, base, model)
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        if r["model"] == model and r.get("family") in methods:
            groups.setdefault((r["point"], r.get("calibration") or ""), []).append(r)
    complete = {k: g for k, g in groups.items() if sorted(r["domain"] for r in g) == domains}
    incomplete = sorted(point_label(g[0]) for k, g in groups.items() if k not in complete)
    points = sorted((assess_point(g, base, thr) for g in complete.values()), key=lambda p: p.label)
    fam = "/".join(methods)
    return ModelVerdict(model, tuple(methods), domains, thr, points, incomplete,
                        _c1(points, thr, fam, domains), _c2(points, thr))


def verdict(runs: Sequence[dict], methods: Sequence[str] = ("emad",), *, min_flops_reduction: float = 0.15,
            ppl_rel_tol: float = 0.01, acc_abs_tol: float = 0.01,
            min_speed_gain: float = 0.10) -> dict[str, ModelVerdict]:
    """The verdict per model (sorted by name) for the method families ``methods``.

    Args:
        runs: run records (:mod:`emad.evaluation.runfile`).
        methods: families that count as "the method" (the verdict is about EMAD by default).
        min_flops_reduction: C1's FLOP reduction (0.15 = 15%).
        ppl_rel_tol: allowed relative rise of perplexity (0.01 = 1%).
        acc_abs_tol: allowed absolute drop of a higher-better metric (0.01 = 1 point).
        min_speed_gain: C2's tokens/s gain (0.10 = 10%).

    Raises:
        ValueError: no runs, no full-depth run at all, or a model × domain without one.
    """
    if not runs:
        raise ValueError("no run records: nothing to judge (run the decode stage first)")
    if not any(r.get("family") == FULL for r in runs):
        raise ValueError("no full-depth run (family 'full') among the runs: the verdict needs one per model and "
                         "domain as the reference")
    thr = Thresholds(min_flops_reduction, ppl_rel_tol, acc_abs_tol, min_speed_gain)
    return {m: model_verdict(runs, m, methods, thr) for m in sorted({r["model"] for r in runs})}


def family_verdicts(runs: Sequence[dict], **thresholds: float) -> dict[str, dict[str, ModelVerdict]]:
    """:func:`verdict` for each non-full family present, alone: ``{family: {model: ModelVerdict}}``."""
    families = sorted({r["family"] for r in runs if r.get("family") and r["family"] != FULL})
    return {f: verdict(runs, (f,), **thresholds) for f in families}
