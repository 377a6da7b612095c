"""The overview's zoomed panels: quality within a few percent of full depth against FLOPs ratios near 1, where
the wide panels' log axis (up to 10⁶) hides where each family leaves the tolerance.

A zoomed panel has fixed limits (:func:`zoom_window`): FLOPs ratio 0.6–1.05 and quality within ±5% of full depth
(perplexity as a ratio on a log axis, 0.95–1.05; accuracies as a change of ±5 points), with the tolerance band,
full depth, the oracle bounds in the window and the FLOPs reduction the verdict asks for (a vertical line at
1 − ``min_flops_reduction``). Points outside the window keep their place: the lines run out through the edge and
the axes clip them, so the limits never move.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from emad.evaluation.checks import Thresholds
from emad.report.figures.draw import Drawn, draw_reference, series_scale
from emad.report.figures.lines import Line, QualityScale, full_of, lines
from emad.report.figures.style import Style
from emad.report.frontier import ParetoSeries

ZOOM_QUALITY = 0.05  # ± this share of full depth's quality (± 5 points for accuracies)
ZOOM_FLOPS = (0.6, 1.05)  # FLOPs ratios shown
REDUCTION_COLOUR = "#444444"
REDUCTION_GID = "flops-reduction"  # the gid of the vertical line at 1 − min_flops_reduction
ZOOM_LABEL = "zoom"  # the label of a zoomed Axes


@dataclass(frozen=True)
class Window:
    """A zoomed panel's limits: ``x`` (FLOPs ratio) and ``y`` (on the panel's quality scale), and ``text``
    saying them in words."""

    x: tuple[float, float]
    y: tuple[float, float]
    text: str = ""


def reduction_ratio(thr: Thresholds) -> float:
    """The FLOPs ratio C1 asks a point to reach: 1 − ``min_flops_reduction``."""
    return 1.0 - thr.min_flops_reduction


def zoom_window(scale: QualityScale, thr: Thresholds, quality: float = ZOOM_QUALITY,
                flops: tuple[float, float] = ZOOM_FLOPS) -> Window | None:
    """The limits of a zoomed panel on ``scale``: ``flops`` on x and ± ``quality`` of full depth on y, both widened
    where the thresholds' tolerance or reduction would not fit inside; None without a full-depth run."""
    if scale.kind == "ratio":
        half = max(quality, 2 * thr.ppl_rel_tol)
        y, within = (1.0 - half, 1.0 + half), f"±{half:.0%}"
    elif scale.kind == "points":
        half = 100.0 * max(quality, 2 * thr.acc_abs_tol)
        y, within = (-half, half), f"±{half:g} points"
    else:
        return None
    x = (min(flops[0], reduction_ratio(thr) - 0.1), max(flops[1], 1.05))
    return Window(x, y, f"FLOPs ratio {x[0]:g}–{x[1]:g}, quality {within} of full depth")


def _beyond(values: Sequence[float], window: Window) -> list[float]:
    """Values with the non-finite ones (diverged or missing) moved far past the worst edge, so their segments
    leave the window there; finite ones as they are (the axes clip them)."""
    lo, hi = window.y
    far_hi, far_lo = (hi * 1e3, lo / 1e3) if lo > 0 else (hi + 1e3, lo - 1e3)
    return [v if math.isfinite(v) else far_hi if v > 0 or math.isnan(v) else far_lo for v in values]


def _ticks(ax, scale: QualityScale, window: Window) -> None:
    """Plain ticks on y: a log axis this narrow would otherwise label only its minor ticks in powers of ten."""
    lo, hi = window.y
    step = 0.02 if scale.kind == "ratio" else 2.0
    ticks = np.arange(math.ceil(lo / step - 1e-9) * step, hi + 1e-9, step)
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    fmt = "{:.2f}" if scale.kind == "ratio" else "{:+.0f}"
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt.format(v).replace("+0", "0")))


def _draw_reduction(ax, thr: Thresholds) -> None:
    x = reduction_ratio(thr)
    ax.axvline(x, color=REDUCTION_COLOUR, lw=1.1, ls="--", zorder=1, gid=REDUCTION_GID)
    ax.annotate(f"≥ {thr.min_flops_reduction:.0%} fewer FLOPs", (x, 0.0), xycoords=("data", "axes fraction"),
                xytext=(-3, 3), textcoords="offset points", ha="right", va="bottom", fontsize=7,
                color=REDUCTION_COLOUR)


def _draw_screen(ax, series: ParetoSeries, scale: QualityScale, window: Window, styles: dict[str, Style]) -> None:
    """The screened values inside the window, faint, in their family's colour."""
    rows = [r for r in series.screen if r["family"] in styles and r["flops_ratio"] is not None]
    pts = [(r["flops_ratio"], scale(r["quality"], series.full_quality), styles[r["family"]].colour) for r in rows]
    pts = [p for p in pts if window.x[0] <= p[0] <= window.x[1] and window.y[0] <= p[1] <= window.y[1]]
    if pts:
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=7, lw=0, alpha=0.3, zorder=2,
                   color=[p[2] for p in pts])


def _draw_lines(ax, line_list: Sequence[Line], scale: QualityScale, full_quality: float | None, window: Window,
                styles: dict[str, Style]) -> None:
    """One line per :class:`Line` through its points, in its family's style; the axes clip what leaves the
    window."""
    for c in line_list:
        st = styles[c.family]
        xs = [r["flops_ratio"] for r in c.points]
        ys = _beyond([scale(r["quality"], full_of(r, full_quality)) for r in c.points], window)
        ax.plot(xs, ys, ls="-" if c.in_domain else "--", lw=1.5, color=st.colour, marker=st.marker, ms=5,
                mfc=st.colour if c.in_domain else "white", mew=1.2, zorder=4, alpha=0.9)


def draw_zoom_panel(ax, series: ParetoSeries, thr: Thresholds, styles: dict[str, Style], drawn: Drawn,
                    window: Window | None = None) -> Window | None:
    """Draw ``series`` against the FLOPs ratio on ``ax`` within its :func:`zoom_window` (or ``window``):
    tolerance band, full depth, oracle bounds in the window, the reduction line and one line per family.

    Returns:
        The window drawn; None (a note on the panel instead) when the series has no full-depth run.
    """
    scale = series_scale(series, thr)
    window = window or zoom_window(scale, thr)
    ax.set_label(ZOOM_LABEL)
    if window is None:
        ax.text(0.5, 0.5, "no full-depth run to zoom on", ha="center", va="center", transform=ax.transAxes,
                fontsize=8, color="grey")
        ax.set_xticks([])
        ax.set_yticks([])
        return None
    if scale.log:
        ax.set_yscale("log")
    ax.set_xlim(*window.x)
    ax.set_ylim(*window.y)
    _ticks(ax, scale, window)
    draw_reference(ax, series, "flops_ratio", scale, window.y, drawn, x_window=window.x)
    _draw_reduction(ax, thr)
    _draw_screen(ax, series, scale, window, styles)
    cs = lines(series.rows, "flops_ratio", series.model, series.domain)
    _draw_lines(ax, cs, scale, series.full_quality, window, styles)
    drawn.families |= {c.family for c in cs}
    drawn.shifted |= any(not c.in_domain for c in cs)
    ax.set_xlabel("FLOPs ratio (vs full depth)")
    ax.set_ylabel(f"{series.metric}{scale.label}" if len(series.metric) < 14 else series.metric, fontsize=8)
    ax.grid(alpha=0.25, which="major")
    return window


def reduction_handle(thr: Thresholds) -> Line2D:
    """The legend entry of the reduction line."""
    return Line2D([], [], color=REDUCTION_COLOUR, ls="--", lw=1.1,
                  label=f"{thr.min_flops_reduction:.0%} fewer FLOPs (C1)")
