"""Axes-level drawing of curve panels: quality (on its :class:`~emad.report.figures.lines.QualityScale`) against
a cost.

On one matplotlib Axes: the tolerance band, the full-depth level and point (:func:`draw_reference`), one line per
:class:`~emad.report.figures.lines.Line` (:func:`draw_lines`: solid when calibrated in-domain or without a
profile, dashed when the calibration is shifted), the oracle bounds, points beyond the chart limits at the edge
with their value, the axes (:func:`finish_axes`) and the legend entries (:func:`legend_handles`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from emad.evaluation.checks import Thresholds
from emad.report.figures.lines import Line, QualityScale, clip, full_of, quality_scale, y_limits
from emad.report.figures.style import Style
from emad.report.frontier import FULL, ORACLE, finite

X_LABELS = {"flops_ratio": "FLOPs ratio (vs full depth)", "speedup": "speed-up (tokens/s vs full depth)"}
BAND = "#2ca02c"


def series_scale(series, thr: Thresholds) -> QualityScale:
    """The y scale of ``series`` with the verdict's tolerances."""
    return quality_scale(series.metric, series.higher_better, series.full_quality, thr.ppl_rel_tol,
                         thr.acc_abs_tol)


@dataclass
class Drawn:
    """What a panel drew, for the figure's legend."""

    families: set[str] = field(default_factory=set)
    shifted: bool = False
    full: bool = False
    tolerance: bool = False
    oracle: bool = False


def _fmt(v: float, scale: QualityScale) -> str:
    if math.isnan(v):
        return "n/a"
    if math.isinf(v):
        return "∞" if v > 0 else "−∞"
    if scale.kind == "points":
        return f"{v:+.0f} pts"
    return f"×{v:.0e}".replace("e+0", "e").replace("e+", "e") if scale.kind == "ratio" else f"{v:.3g}"


def _annotate_clipped(ax, xs, ys_raw, ys, moved, colour, scale: QualityScale, lim: tuple[float, float]) -> None:
    """Write the true value beside each point drawn at the edge (one label per x position)."""
    seen: list[float] = []
    span = (ax.get_xlim()[1] - ax.get_xlim()[0]) or 1.0
    for x, raw, y, m in zip(xs, ys_raw, ys, moved):
        if not m or any(abs(x - s) < 0.04 * span for s in seen):
            continue
        seen.append(x)
        top = y >= lim[1]
        ax.annotate(_fmt(raw, scale), (x, y), xytext=(0, -9 if top else 9), textcoords="offset points",
                    ha="center", va="top" if top else "bottom", fontsize=6.5, color=colour, rotation=0,
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8}, zorder=6)


def edge_limits(lim: tuple[float, float], scale: QualityScale) -> tuple[float, float]:
    """Where clipped points are drawn: just inside the axes limits."""
    lo, hi = lim
    if scale.log:
        return lo * 1.15, hi / 1.15
    pad = 0.02 * (hi - lo)
    return lo + pad, hi - pad


def draw_lines(ax, line_list: Sequence[Line], x_key: str, scale: QualityScale, full_quality: float | None,
                lim: tuple[float, float], style_of: Callable[[Line], Style], label_values: bool = False) -> None:
    """One line per :class:`Line` through its points (markers at the measured points)."""
    edge = edge_limits(lim, scale)
    for c in line_list:
        st = style_of(c)
        xs = [r[x_key] for r in c.points]
        raw = [scale(r["quality"], full_of(r, full_quality)) for r in c.points]
        ys, moved = clip(raw, *edge)
        ax.plot(xs, ys, ls="-" if c.in_domain else "--", lw=1.5, color=st.colour, marker=st.marker, ms=5,
                mfc=st.colour if c.in_domain else "white", mew=1.2, zorder=4, alpha=0.9)
        if any(moved):
            _annotate_clipped(ax, xs, raw, ys, moved, st.colour, scale, edge)
        if label_values:
            for x, y, r in zip(xs, ys, c.points):
                if finite(r.get("value")):
                    ax.annotate(f"{r['value']:g}", (x, y), xytext=(3, 3), textcoords="offset points",
                                fontsize=6, color=st.colour)


def _rows_with(series, x_key: str, family: str) -> list[dict]:
    rows = series.plot_rows() if hasattr(series, "plot_rows") else series.rows
    return [r for r in rows if r.get("family") == family and finite(r.get(x_key))]


def draw_reference(ax, series, x_key: str, scale: QualityScale, lim: tuple[float, float], drawn: Drawn,
                   oracle_keys: Callable[[str], bool] | None = None,
                   x_window: tuple[float, float] | None = None) -> None:
    """Tolerance band and line, full-depth level and point, and (FLOPs axis) the oracle bounds (only those within
    ``x_window`` when given: their labels would otherwise be written outside the axes)."""
    if scale.tolerance is not None:
        lo, hi = (lim[0], scale.tolerance) if scale.log else (scale.tolerance, lim[1])
        ax.axhspan(lo, hi, color=BAND, alpha=0.08, lw=0, zorder=0)
        ax.axhline(scale.tolerance, color=BAND, lw=0.9, ls="-", zorder=1)
        drawn.tolerance = True
    if scale.full is not None:
        ax.axhline(scale.full, color="black", lw=0.8, ls=":", zorder=1)
        for r in _rows_with(series, x_key, FULL):
            ax.plot([r[x_key]], [scale.full], marker="*", ms=13, color="black", ls="none", zorder=5)
            drawn.full = True
    if x_key != "flops_ratio":
        return
    for r in _rows_with(series, x_key, ORACLE):
        key = r.get("calibration") or ""
        if oracle_keys is not None and not oracle_keys(key):
            continue
        if x_window is not None and not x_window[0] <= r[x_key] <= x_window[1]:
            continue
        ax.axvline(r[x_key], color="#555555", lw=0.8, ls=(0, (1, 2)), zorder=1)
        ax.annotate(f"oracle {key}", (r[x_key], 1.0), xycoords=("data", "axes fraction"), xytext=(2, -3),
                    textcoords="offset points", rotation=90, ha="left", va="top", fontsize=6.5, color="#555555")
        drawn.oracle = True


def finish_axes(ax, scale: QualityScale, lim: tuple[float, float], x_key: str, xs: Sequence[float],
                metric: str = "quality") -> None:
    """Scales, limits, labels and grid of one panel."""
    if scale.log:
        ax.set_yscale("log")
    ax.set_ylim(*lim)
    xs = [x for x in xs if finite(x)] or [1.0]
    if x_key == "flops_ratio":
        ax.set_xlim(0.0, max(1.05, max(xs) * 1.05))
    else:
        lo, hi = min(xs + [1.0]), max(xs + [1.0])
        pad = 0.06 * (hi - lo or 1.0)
        ax.set_xlim(max(0.0, lo - pad), hi + pad)
    ax.set_xlabel(X_LABELS.get(x_key, x_key))
    text = f"{metric}{scale.label}" if len(metric) < 14 else f"{metric}\n{scale.label.lstrip(': ')}"
    ax.set_ylabel(text, fontsize=8)
    ax.grid(alpha=0.25, which="major")


def panel_limits(series, line_list: Sequence[Line], scale: QualityScale,
                 ratio_cap: float) -> tuple[float, float]:
    """y limits of a panel from its lines' shown values and the full-depth level."""
    vals = [scale(r["quality"], full_of(r, series.full_quality)) for c in line_list for r in c.points]
    return y_limits(vals, scale, ratio_cap=ratio_cap)


def legend_handles(styles: dict[str, Style], drawn: Drawn) -> list:
    """Few entries: one per family, then full depth, calibration line styles, tolerance and oracle."""
    hs: list = [Line2D([], [], color=styles[f].colour, marker=styles[f].marker, lw=1.5, ms=5, label=f)
                for f in sorted(drawn.families)]
    if drawn.full:
        hs.append(Line2D([], [], color="black", marker="*", ms=11, ls=":", lw=0.8, label="full depth"))
    if drawn.shifted:
        hs += [Line2D([], [], color="grey", ls="-", label="calibrated in-domain"),
               Line2D([], [], color="grey", ls="--", marker="o", mfc="white", label="calibration shifted")]
    if drawn.tolerance:
        hs.append(Patch(facecolor=BAND, alpha=0.25, edgecolor=BAND, label="within tolerance"))
    if drawn.oracle:
        hs.append(Line2D([], [], color="#555555", ls=(0, (1, 2)), label="oracle bound"))
    return hs
