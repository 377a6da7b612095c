"""Pareto figures: quality against FLOPs ratio and against speed-up, one PNG per model × domain × metric.

Each family has its own marker and colour; the frontier of each panel is a line; the full-depth quality and its
tolerance (as in the verdict) are horizontal lines; the oracle bound is a vertical dashed line on the FLOPs panel
with a cross at the full-depth quality.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from emad.report.pareto import ParetoSeries, frontier
from emad.report.plots import plt, save_figure
from emad.report.verdict import Thresholds

_STYLE = {"full": ("*", "black"), "fixed": ("s", "C0"), "confidence": ("^", "C1"), "emad": ("o", "C3")}
_MARKERS = "DvP<>hX"


def family_style(family: str, others: Sequence[str]) -> tuple[str, str]:
    """(marker, colour) of a family; families beyond the known ones get the next free marker and colour."""
    if family in _STYLE:
        return _STYLE[family]
    i = sorted(others).index(family) if family in others else 0
    return _MARKERS[i % len(_MARKERS)], f"C{(4 + i) % 10}"


def _tolerance_line(series: ParetoSeries, thr: Thresholds) -> float | None:
    q = series.full_quality
    if q is None:
        return None
    return q - thr.acc_abs_tol if series.higher_better else q * (1.0 + thr.ppl_rel_tol)


def _panel(ax, series: ParetoSeries, x_key: str, lower_better_x: bool, thr: Thresholds) -> None:
    rows = [r for r in series.rows if r[x_key] is not None]
    others = sorted({r["family"] for r in series.rows} - set(_STYLE))
    for family in sorted({r["family"] for r in rows}, key=lambda f: (f != "full", f)):
        pts = [r for r in rows if r["family"] == family]
        marker, colour = family_style(family, others)
        ax.scatter([r[x_key] for r in pts], [r["quality"] for r in pts], marker=marker, color=colour,
                   s=90 if family == "full" else 40, label=family, zorder=3)
    front = frontier(rows, x_key, "quality", series.higher_better, cost_lower_better=lower_better_x)
    if len(front) > 1:
        ax.plot([r[x_key] for r in front], [r["quality"] for r in front], "-", color="grey", lw=1,
                label="Pareto frontier", zorder=2)
    if series.full_quality is not None:
        ax.axhline(series.full_quality, color="black", ls=":", lw=0.8, label="full depth")
        ax.axhline(_tolerance_line(series, thr), color="red", ls=":", lw=0.8, label="tolerance")
    if not rows:
        ax.text(0.5, 0.5, "no full-depth tokens/s to compare with", ha="center", va="center",
                transform=ax.transAxes)


def _oracle(ax, series: ParetoSeries) -> None:
    for cal, ratio in series.oracle.items():
        ax.axvline(ratio, color="green", ls="--", lw=0.8, label=f"oracle bound (cal {cal})")
        if series.full_quality is not None:
            ax.scatter([ratio], [series.full_quality], marker="x", color="green", zorder=3)


def pareto_figure(series: ParetoSeries, thresholds: Thresholds | None = None):
    """The figure of one series: quality vs FLOPs ratio (left) and quality vs speed-up (right)."""
    thr = thresholds or Thresholds()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    _panel(left, series, "flops_ratio", True, thr)
    _oracle(left, series)
    _panel(right, series, "speedup", False, thr)
    ylabel = f"{series.metric} ({'higher' if series.higher_better else 'lower'} is better)"
    left.set(xlabel="FLOPs ratio (vs full depth)", ylabel=ylabel, title="quality vs compute")
    right.set(xlabel="speed-up (tokens/s vs full depth)", ylabel=ylabel, title="quality vs speed")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"{series.model} · {series.domain} · {series.metric}")
    return fig


def write_pareto_figures(series_list: Sequence[ParetoSeries], out_dir: str | Path,
                         thresholds: Thresholds | None = None) -> list[dict[str, Any]]:
    """Write ``<out_dir>/<series.name>.png`` for every series.

    Returns:
        The figures index: one dict per figure, ``{path, name, model, domain, metric, run_ids,
        mlflow_run_ids}`` (``path`` as written, a string), in the order of ``series_list``.
    """
    index = []
    for s in series_list:
        path = save_figure(pareto_figure(s, thresholds), Path(out_dir) / f"{s.name}.png")
        index.append({"path": str(path), "name": s.name, "model": s.model, "domain": s.domain,
                      "metric": s.metric, "run_ids": s.run_ids(), "mlflow_run_ids": s.mlflow_run_ids()})
    return index
