"""Curves read at equal FLOPs: every operating point of a family as quality against FLOPs, and its envelope.

A sweep gives a family (``emad``, ``emad+tuned``, ``fixed``, ...) many operating points along one knob (run fields
``curve``, ``knob``, ``value``). A :class:`Curve` is every operating point of one family for one model, as pairs
``(flops_ratio, y)``, named by its :class:`~emad.evaluation.identity.CurveId`:

- on the model (``domain`` None): the verdict's points (:class:`~emad.report.verdict.PointAssessment`: evaluated on
  every domain of the model, FLOPs token-weighted over them, every calibration source), so its readings sit beside
  C1 and C2;
- on one domain and one calibration source (``calibration`` None for families without a profile): that domain's
  FLOPs ratio and checks of the same points.

``y`` is a degradation against full depth, positive = worse: the *tolerance used* — the largest ``change /
tolerance`` over the point's measured checks on ≥ 8 units (counted, or underpowered: a reading that carries no
label; 1 = at the tolerance), zero for a point proved identical to full depth — or one metric's change (relative
rise of perplexity, absolute drop of an accuracy; the worst domain on the model).

Envelope. A curve is read along its lower frontier (its monotone envelope): the points that no other point of the
family beats on both axes (at most as many FLOPs and at most as much degradation, strictly less of one), sorted by
FLOPs ratio, so that degradation falls strictly as FLOPs rise; equal points keep the first label. Between
consecutive frontier points it is a straight line; above the costliest frontier point it stays flat (that point is
available at any larger budget); below the cheapest it is undefined. So its value at a FLOPs ratio ``x`` exists
exactly when some point spends at most ``x`` ("the curve reaches ``x``"), and is never worse than a measured point
spending at most ``x``. The measured frontier points on either side are given with it: ``cheaper`` (the costliest
at ≤ ``x``) and ``costlier`` (the cheapest at ≥ ``x``; None on the flat part); both are the point itself when one
sits at ``x``; when the curve does not reach ``x``, ``cheaper`` is None and ``costlier`` is its cheapest point.
The straight line between two points is an interpolation, not an operating point anyone ran.

The target is ``x = 1 − aggregate.min_flops_reduction`` (0.85: 15% fewer FLOPs). The largest reduction within
tolerance is the point with the largest FLOPs reduction whose checks are all met or unresolved (none violated;
``largest_met``: all met), measured, not interpolated.

Domain shift: each per-domain curve calibrated on another source is read beside the in-domain curve of the same
model, family and domain (calibration source = domain) at common FLOPs ratios (:data:`SHIFT_RATIOS` and the target).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from emad.evaluation.checks import Check, combined_state
from emad.evaluation.identity import CurveId, split_family
from emad.evaluation.judge import gate_state
from emad.evaluation.states import IDENTICAL, MET, NOT_COUNTED, UNRESOLVED, UNTESTED
from emad.report.frontier import finite
from emad.report.verdict import ModelVerdict, PointAssessment

EPS = 1e-9
TOLERANCE_USED = "tolerance_used"
SHIFT_RATIOS = (0.95, 0.9, 0.85, 0.8, 0.7)


@dataclass(frozen=True)
class CurvePoint:
    """One measured operating point on a curve: ``value`` is the degradation (positive = worse), ``state`` the
    combined state of its checks (``met``, ``unresolved``, ``violated``; None when not judged)."""

    label: str
    flops_ratio: float
    value: float
    state: str | None = None

    @property
    def reduction(self) -> float:
        return 1.0 - self.flops_ratio

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "flops_reduction": self.reduction}


@dataclass(frozen=True)
class AtFlops:
    """A curve read at ``flops_ratio``: ``value`` on its envelope (None when the curve does not reach it) with the
    measured frontier points on either side (see the module docstring)."""

    flops_ratio: float
    value: float | None
    cheaper: CurvePoint | None
    costlier: CurvePoint | None

    def to_dict(self) -> dict[str, Any]:
        return {"flops_ratio": self.flops_ratio, "value": self.value,
                "cheaper": self.cheaper.to_dict() if self.cheaper else None,
                "costlier": self.costlier.to_dict() if self.costlier else None}


def envelope(points: Iterable[CurvePoint]) -> list[CurvePoint]:
    """The lower frontier of ``points`` sorted by ascending FLOPs ratio (degradation strictly falling); points
    with a non-finite FLOPs ratio or value are left out."""
    valid = sorted((p for p in points if finite(p.flops_ratio) and finite(p.value)),
                   key=lambda p: (p.flops_ratio, p.value, p.label))
    out: list[CurvePoint] = []
    for p in valid:  # at equal cost the best comes first; a later point must be strictly better to stay
        if not out or p.value < out[-1].value:
            out.append(p)
    return out


def at_flops(points: Iterable[CurvePoint], flops_ratio: float) -> AtFlops:
    """The envelope of ``points`` read at ``flops_ratio`` (see the module docstring)."""
    env = envelope(points)
    if not env or env[0].flops_ratio > flops_ratio + EPS:
        return AtFlops(flops_ratio, None, None, env[0] if env else None)
    cheaper = [p for p in env if p.flops_ratio <= flops_ratio + EPS][-1]
    if abs(cheaper.flops_ratio - flops_ratio) <= EPS:
        return AtFlops(flops_ratio, cheaper.value, cheaper, cheaper)
    costlier = next((p for p in env if p.flops_ratio > flops_ratio), None)
    if costlier is None:
        return AtFlops(flops_ratio, cheaper.value, cheaper, None)
    t = (flops_ratio - cheaper.flops_ratio) / (costlier.flops_ratio - cheaper.flops_ratio)
    return AtFlops(flops_ratio, cheaper.value + t * (costlier.value - cheaper.value), cheaper, costlier)


def largest_reduction(points: Iterable[CurvePoint],
                      states: Sequence[str] = (MET, UNTESTED, UNRESOLVED)) -> CurvePoint | None:
    """The point with the largest positive FLOPs reduction whose state is in ``states`` (ties: the smaller
    degradation, then the label); None when there is none (a point costing full depth or more reduces nothing)."""
    ok = [p for p in points if p.state in states and finite(p.flops_ratio) and p.flops_ratio < 1.0]
    return min(ok, key=lambda p: (p.flops_ratio, p.value if finite(p.value) else math.inf, p.label), default=None)


@dataclass
class Curve:
    """One family's curve for one model: on the model (``domain`` None) or on one domain and calibration source.

    ``points``: the tolerance used per point; ``metrics``: ``{metric: points}`` with that metric's change;
    ``target``: the FLOPs ratio of C1 (1 − min_flops_reduction).
    """

    model: str
    family: str
    domain: str | None
    calibration: str | None
    target: float
    points: list[CurvePoint] = field(default_factory=list)
    metrics: dict[str, list[CurvePoint]] = field(default_factory=dict)

    @classmethod
    def of(cls, cid: CurveId, target: float) -> Curve:
        """The empty curve named by ``cid``."""
        return cls(cid.model, cid.family, cid.domain, cid.calibration, target)

    @property
    def id(self) -> CurveId:
        return CurveId(self.model, *split_family(self.family), calibration=self.calibration, domain=self.domain)

    def at(self, flops_ratio: float, metric: str = TOLERANCE_USED) -> AtFlops:
        """The tolerance used (or ``metric``'s change) read at ``flops_ratio``."""
        return at_flops(self.points if metric == TOLERANCE_USED else self.metrics.get(metric, []), flops_ratio)

    @property
    def at_target(self) -> AtFlops:
        return self.at(self.target)

    @property
    def largest_ok(self) -> CurvePoint | None:
        """The largest FLOPs reduction with every check met, untested at this size or unresolved."""
        return largest_reduction(self.points)

    @property
    def largest_met(self) -> CurvePoint | None:
        """The largest FLOPs reduction with every check met."""
        return largest_reduction(self.points, (MET,))

    def to_dict(self) -> dict[str, Any]:
        ok, met = self.largest_ok, self.largest_met
        return {"model": self.model, "family": self.family, "domain": self.domain, "calibration": self.calibration,
                "target_flops_ratio": self.target, "at_target": self.at_target.to_dict(),
                "metrics_at_target": {m: self.at(self.target, m).to_dict() for m in sorted(self.metrics)},
                "largest_ok": ok.to_dict() if ok else None, "largest_met": met.to_dict() if met else None,
                "points": [p.to_dict() for p in sorted(self.points, key=lambda p: (p.flops_ratio, p.label))]}


def _curve(cid: CurveId, target: float, assessed: Sequence[PointAssessment]) -> Curve:
    curve, domain = Curve.of(cid, target), cid.domain
    for p in assessed:
        # measured checks on ≥ 8 units of the confirmation half enter a curve — counted, or underpowered (a measured
        # change whose interval carries no label at its size is still a reading; the point's state says it is no
        # label): one resting on fewer units is no reading, and the selection half's screen violations are another
        # half's numbers
        mine_all = [c for c in p.checks if domain is None or c.domain == domain]
        checks: list[Check] = [c for c in mine_all if c.counted or (c.measured and c.state != NOT_COUNTED)]
        flops = p.flops_ratio if domain is None else p.flops_by_domain.get(domain)
        # a point the engine proved identical to full depth stands at zero change: a proven value, not a missing one
        proved = bool(mine_all) and all(c.state == IDENTICAL for c in mine_all)
        used = 0.0 if proved else max((c.severity for c in checks if c.severity is not None), default=None)
        if flops is None or used is None:
            continue
        curve.points.append(CurvePoint(p.label, flops, used, gate_state(mine_all)))
        # a metric's curve reads measured changes, and zero where the check is identical by construction (its judged
        # half may hold no units of that metric)
        for metric in sorted({c.metric for c in checks if c.change is not None or c.state == IDENTICAL}):
            mine = [c for c in checks if c.metric == metric and (c.change is not None or c.state == IDENTICAL)]
            change = max(0.0 if c.state == IDENTICAL else c.change for c in mine)
            curve.metrics.setdefault(metric, []).append(CurvePoint(p.label, flops, change, combined_state(mine)))
    return curve


def _verdicts(family_verdicts: Mapping[str, Mapping[str, ModelVerdict]]) -> list[tuple[CurveId, ModelVerdict]]:
    """Each verdict with the identity of its curve on the model (every domain, no calibration source)."""
    return [(CurveId(model, *split_family(family)), v) for family, per in family_verdicts.items()
            for model, v in per.items()]


def model_curves(family_verdicts: Mapping[str, Mapping[str, ModelVerdict]]) -> list[Curve]:
    """One curve per model × family over the verdict's points (``{family: {model: ModelVerdict}}``, as from
    :func:`emad.report.verdict.family_verdicts`), sorted by (model, family)."""
    out = [_curve(cid, 1.0 - v.thresholds.min_flops_reduction, v.points) for cid, v in _verdicts(family_verdicts)]
    return sorted(out, key=lambda c: (c.model, c.family))


def domain_curves(family_verdicts: Mapping[str, Mapping[str, ModelVerdict]]) -> list[Curve]:
    """One curve per model × family × calibration source × domain, sorted in that order (no source first)."""
    out = []
    for cid, v in _verdicts(family_verdicts):
        target = 1.0 - v.thresholds.min_flops_reduction
        for cal in sorted({p.calibration for p in v.points}, key=lambda c: c or ""):
            mine = [p for p in v.points if p.calibration == cal]
            out += [_curve(cid.calibrated_on(cal).on(d), target, mine) for d in v.domains]
    return sorted(out, key=lambda c: (c.model, c.family, c.calibration or "", c.domain or ""))


def _difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def domain_shift_curves(curves: Sequence[Curve], ratios: Sequence[float] = SHIFT_RATIOS) -> list[dict[str, Any]]:
    """Each shifted per-domain curve (calibration source ≠ domain) beside the in-domain one at equal FLOPs.

    Returns:
        One row per shifted curve, sorted by (model, family, domain, calibration): ``model, family, domain,
        calibration, in_domain`` (whether an in-domain curve exists), ``at``: per FLOPs ratio (``ratios`` and the
        target, descending) ``{flops_ratio, in_domain, shifted, difference}`` of the tolerance used (difference =
        shifted − in-domain; None where a curve does not reach the ratio), ``metrics``: the same per metric, and
        ``largest_ok``: ``{in_domain, shifted}`` FLOPs reductions within tolerance (None: no such point).
    """
    in_dom = {c.id: c for c in curves if c.domain and c.calibration == c.domain}
    rows = []
    for c in curves:
        if not c.calibration or c.id.in_domain:
            continue
        ref = in_dom.get(c.id.calibrated_on(c.domain))
        grid = sorted({*ratios, c.target}, reverse=True)

        def read(metric: str, ref: Curve | None = ref, c: Curve = c, grid: list[float] = grid) -> list[dict]:
            cells = []
            for x in grid:
                a = ref.at(x, metric).value if ref else None
                b = c.at(x, metric).value
                cells.append({"flops_ratio": x, "in_domain": a, "shifted": b, "difference": _difference(a, b)})
            return cells

        ok_ref, ok = (ref.largest_ok if ref else None), c.largest_ok
        rows.append({"model": c.model, "family": c.family, "domain": c.domain, "calibration": c.calibration,
                     "in_domain": ref is not None, "at": read(TOLERANCE_USED),
                     "metrics": {m: read(m) for m in sorted(c.metrics)},
                     "largest_ok": {"in_domain": ok_ref.reduction if ok_ref else None,
                                    "shifted": ok.reduction if ok else None}})
    return sorted(rows, key=lambda r: (r["model"], r["family"], r["domain"], r["calibration"]))
