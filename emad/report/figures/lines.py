"""What a curve panel shows: the quality scale, the lines through the points, the axis limits, and the same
fields for ``dvc plots``.

:class:`QualityScale` maps a series' quality to what the figures show (perplexity as a ratio to full depth on a log
axis, other metrics as a change in points); :func:`lines` groups the rows of a
:class:`~emad.report.frontier.ParetoSeries` into one :class:`Line` per curve × sweep, ordered by cost. Nothing here
draws.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from emad.evaluation.identity import CurveId, profile_in_domain
from emad.report.frontier import FULL, ORACLE, finite


@dataclass(frozen=True)
class QualityScale:
    """What a figure's y axis shows for one series.

    ``kind`` is ``ratio`` (lower-better metric over its full-depth value, log axis), ``points`` (change vs full
    depth, in points = 0.01), ``log`` or ``raw`` (no full-depth run to compare with).
    """

    kind: str
    full: float | None
    tolerance: float | None
    label: str  # follows the metric's name on the axis

    @property
    def log(self) -> bool:
        return self.kind in ("ratio", "log")

    def __call__(self, quality: Any, full_quality: float | None) -> float:
        """The shown value of ``quality`` (inf / nan kept: the figure puts them at the edge)."""
        if not finite(quality):  # missing or diverged: the worst end of the axis
            return math.inf if self.log else -math.inf
        if self.kind == "ratio":
            return quality / full_quality
        if self.kind == "points":
            return 100.0 * (quality - full_quality)
        return float(quality)


def quality_scale(metric: str, higher_better: bool, full_quality: float | None, ppl_rel_tol: float,
                  acc_abs_tol: float) -> QualityScale:
    """The y scale of a series and where full depth and the tolerance (as the verdict reads it) sit on it."""
    has_full = finite(full_quality) and full_quality > 0
    if not higher_better:
        if has_full:
            return QualityScale("ratio", 1.0, 1.0 + ppl_rel_tol,
                                " ÷ full depth (log scale; lower is better)")
        return QualityScale("log", None, None, " (log scale; lower is better)")
    if finite(full_quality):
        return QualityScale("points", 0.0, -100.0 * acc_abs_tol,
                            ": change vs full depth (points; higher is better)")
    return QualityScale("raw", None, None, " (higher is better)")


@dataclass
class Line:
    """One curve's points (named by a :class:`~emad.evaluation.identity.CurveId`) of one sweep (``sweep``: the
    base point's name), ordered by ascending cost: one line of a panel."""

    family: str
    sweep: str
    calibration: str | None
    in_domain: bool
    knob: str | None = None
    points: list[dict[str, Any]] = field(default_factory=list)


def lines(rows: Sequence[dict[str, Any]], x_key: str, model: str, domain: str) -> list[Line]:
    """One :class:`Line` per (curve, sweep) of ``rows`` (one series of ``model`` on ``domain``) whose ``x_key``
    is finite, skipping full-depth and oracle rows; points ordered by ``x_key`` then knob value; lines ordered by
    family, sweep, calibration (in-domain first)."""
    groups: dict[tuple, Line] = {}
    for r in rows:
        family = r.get("family") or "?"
        if family in (FULL, ORACLE) or not finite(r.get(x_key)):
            continue
        cid = CurveId.of_run({**r, "model": model, "domain": r.get("domain") or domain, "readout": None})
        key = (cid.family, r.get("curve") or family, cid.calibration)
        if key not in groups:
            groups[key] = Line(cid.family, key[1], cid.calibration, cid.in_domain, r.get("knob"))
        groups[key].points.append(r)
    for c in groups.values():
        c.points.sort(key=lambda r: (r[x_key], r.get("value") if finite(r.get("value")) else 0.0))
    return sorted(groups.values(), key=lambda c: (c.family, c.sweep, not c.in_domain, c.calibration or ""))


def clip(values: Sequence[float], lo: float, hi: float) -> tuple[list[float], list[bool]]:
    """``values`` clamped into [lo, hi] (non-finite ones to the nearer edge) and a flag per value that moved."""
    out, moved = [], []
    for v in values:
        c = hi if (math.isnan(v) or v > hi) else lo if v < lo else v
        out.append(c)
        moved.append(c != v)
    return out, moved


def y_limits(values: Iterable[float], scale: QualityScale, ratio_cap: float = 1e6, ratio_floor: float = 0.1,
             points_floor: float = -100.0) -> tuple[float, float]:
    """Axis limits that hold every finite shown value, the full-depth level and the tolerance (padded), within
    [``ratio_floor``, ``ratio_cap``] for ratios (points beyond go to the edge) and above ``points_floor``."""
    vals = [v for v in values if finite(v)]
    marks = [v for v in (scale.full, scale.tolerance) if v is not None]
    if scale.log:
        pos = [v for v in vals + marks if v > 0] or [1.0]
        lo, hi = min(pos), max(pos)
        if scale.kind == "ratio":
            lo, hi = max(lo, ratio_floor), min(hi, ratio_cap)
        return lo / 1.6, hi * 1.6
    allv = vals + marks or [0.0]
    lo, hi = max(min(allv), points_floor), max(allv)
    pad = max(0.06 * (hi - lo), 0.5 if scale.kind == "points" else 0.02)
    return lo - pad, hi + pad


def full_of(row: dict[str, Any], full_quality: float | None) -> float | None:
    """Full depth's quality on the units ``row`` was scored on (``full_quality`` of its series when the row has
    none): what the row is shown against."""
    own = row.get("full_quality")
    return own if finite(own) else full_quality


def plot_fields(series, row: dict[str, Any], ppl_rel_tol: float = 0.01, acc_abs_tol: float = 0.01) -> dict[str, Any]:
    """Fields the ``dvc plots`` template draws with, for one row of ``series.plot_rows()``.

    Returns:
        ``quality_vs_full`` (the quality as the figures show it, against full depth on the same units: ratio for
        lower-better metrics, change in points otherwise; the raw quality without a full-depth run; None when not finite),
        ``tolerance_vs_full`` (the verdict's tolerance on that scale; None without a full-depth run),
        ``calibration_kind`` (``in-domain``, ``shifted`` or ``none``) and ``line`` (the curve the row belongs to).
    """
    scale = quality_scale(series.metric, series.higher_better, series.full_quality, ppl_rel_tol, acc_abs_tol)
    shown = scale(row.get("quality"), full_of(row, series.full_quality))
    family, cal = row.get("family") or "?", row.get("calibration")
    kind = ("none" if not cal else "in-domain" if profile_in_domain(cal, row.get("domain") or series.domain)
            else "shifted")
    name = row.get("point") if family in (FULL, ORACLE) else row.get("curve") or family
    return {"quality_vs_full": shown if finite(shown) else None, "tolerance_vs_full": scale.tolerance,
            "calibration_kind": kind, "line": f"{family} | {name} | {cal or '-'}"}
