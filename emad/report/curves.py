"""Pure data preparation for the curve figures: family styles, the quality scale, and curves through the points.

Nothing here draws. :func:`family_style` gives every family a fixed (colour, marker) pair, so a family looks the
same in every figure; :class:`QualityScale` maps a series' quality to what the figures show (perplexity as a ratio
to full depth on a log axis, other metrics as a change in points); :func:`curves` groups the rows of a
:class:`~emad.report.pareto.ParetoSeries` into one :class:`Curve` per sweep × calibration, ordered by cost.

Rows may carry ``curve``, ``knob``, ``value``, ``readout`` and ``domain`` (sweeps); without them every family ×
calibration is one curve.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

FULL, ORACLE = "full", "oracle"

# Base method -> colour (matplotlib tab10 / tab20, all distinct) and one marker per readout.
_METHOD_COLOURS = {"emad": "#d62728", "fixed": "#1f77b4", "confidence": "#ff7f0e", "softmax": "#2ca02c",
                   "contrastive": "#9467bd", "ead": "#8c564b", "speculative": "#e377c2", "calm": "#17becf",
                   "related": "#bcbd22"}
_TUNED_COLOURS = {"emad": "#7f0000", "fixed": "#08306b", "confidence": "#a63603", "softmax": "#00441b",
                  "contrastive": "#3f007d", "ead": "#4a2b20", "speculative": "#8e0152", "calm": "#0b5c66",
                  "related": "#6b6b00"}
_READOUT_MARKERS = {"logit": "o", "tuned": "s"}
_FIXED_STYLES = {FULL: ("black", "*"), ORACLE: ("#2ca02c", "x")}
# Fallback combinations for families not in the table: probed in order from a hash of the name.
_SPARE_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                  "#bcbd22", "#17becf")
_SPARE_MARKERS = ("^", "v", "D", "P", "X", "<", ">", "h", "p", "d")


@dataclass(frozen=True)
class Style:
    """How one family is drawn: line and marker colour, and marker."""

    colour: str
    marker: str


def split_family(family: str) -> tuple[str, str]:
    """``("emad", "tuned")`` for ``"emad+tuned"``, ``("emad", "logit")`` for ``"emad"``."""
    method, _, readout = family.partition("+")
    return method, readout or "logit"


def _table_style(family: str) -> Style | None:
    if family in _FIXED_STYLES:
        return Style(*_FIXED_STYLES[family])
    method, readout = split_family(family)
    if method not in _METHOD_COLOURS or readout not in _READOUT_MARKERS:
        return None
    colours = _METHOD_COLOURS if readout == "logit" else _TUNED_COLOURS
    return Style(colours[method], _READOUT_MARKERS[readout])


def family_styles(families: Iterable[str]) -> dict[str, Style]:
    """A distinct :class:`Style` for every family: from the fixed table when known (the same in every figure),
    else the first free spare combination from a hash of the name (deterministic for a given set of families)."""
    names = sorted(set(families))
    out = {f: s for f in names if (s := _table_style(f)) is not None}
    taken = {(s.colour, s.marker) for s in out.values()}
    spare = [(c, m) for m in _SPARE_MARKERS for c in _SPARE_COLOURS]
    for f in names:
        if f in out:
            continue
        start = zlib.crc32(f.encode()) % len(spare)
        for k in range(len(spare)):
            combo = spare[(start + k) % len(spare)]
            if combo not in taken:
                break
        taken.add(combo)
        out[f] = Style(*combo)
    return out


def family_style(family: str, others: Sequence[str] = ()) -> tuple[str, str]:
    """(marker, colour) of ``family`` among ``others`` (the families of the same figure)."""
    s = family_styles([*others, family])[family]
    return s.marker, s.colour


def finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


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


def in_domain(calibration: str | None, domain: str) -> bool:
    """True when the calibration source is the evaluated domain, or there is no calibration (no profile)."""
    if not calibration:
        return True
    return calibration.split("+")[0] == domain


@dataclass
class Curve:
    """One family's points of one sweep and calibration source, ordered by ascending cost."""

    family: str
    curve: str
    calibration: str | None
    in_domain: bool
    knob: str | None = None
    points: list[dict[str, Any]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.family if not self.calibration else f"{self.family} (cal {self.calibration})"


def curves(rows: Sequence[dict[str, Any]], x_key: str, domain: str) -> list[Curve]:
    """One :class:`Curve` per (family, ``curve``, calibration) of ``rows`` whose ``x_key`` is finite, skipping
    full-depth and oracle rows; points ordered by ``x_key`` then knob value; curves ordered by family, curve,
    calibration (in-domain first)."""
    groups: dict[tuple, Curve] = {}
    for r in rows:
        family = r.get("family") or "?"
        if family in (FULL, ORACLE) or not finite(r.get(x_key)):
            continue
        cal = r.get("calibration")
        name = r.get("curve") or family
        key = (family, name, cal)
        if key not in groups:
            groups[key] = Curve(family, name, cal, in_domain(cal, r.get("domain") or domain), r.get("knob"))
        groups[key].points.append(r)
    for c in groups.values():
        c.points.sort(key=lambda r: (r[x_key], r.get("value") if finite(r.get("value")) else 0.0))
    return sorted(groups.values(), key=lambda c: (c.family, c.curve, not c.in_domain, c.calibration or ""))


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


def plot_fields(series, row: dict[str, Any], ppl_rel_tol: float = 0.01, acc_abs_tol: float = 0.01) -> dict[str, Any]:
    """Fields the ``dvc plots`` template draws with, for one row of ``series.plot_rows()``.

    Returns:
        ``quality_vs_full`` (the quality as the figures show it: ratio to full depth for lower-better metrics,
        change in points otherwise; the raw quality without a full-depth run; None when not finite),
        ``tolerance_vs_full`` (the verdict's tolerance on that scale; None without a full-depth run),
        ``calibration_kind`` (``in-domain``, ``shifted`` or ``none``) and ``line`` (the curve the row belongs to).
    """
    scale = quality_scale(series.metric, series.higher_better, series.full_quality, ppl_rel_tol, acc_abs_tol)
    shown = scale(row.get("quality"), series.full_quality)
    family, cal = row.get("family") or "?", row.get("calibration")
    kind = "none" if not cal else "in-domain" if in_domain(cal, row.get("domain") or series.domain) else "shifted"
    name = row.get("point") if family in (FULL, ORACLE) else row.get("curve") or family
    return {"quality_vs_full": shown if finite(shown) else None, "tolerance_vs_full": scale.tolerance,
            "calibration_kind": kind, "line": f"{family} | {name} | {cal or '-'}"}
