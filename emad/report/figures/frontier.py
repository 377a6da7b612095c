"""Curve figures of the aggregate stage (PNG): every family's sweep as a line through its operating points.

* :func:`pareto_figure` / :func:`write_pareto_figures`: one PNG per model × domain × metric, quality against the
  FLOPs ratio (left) and against the speed-up (right).
* :func:`overview_figure` / :func:`write_overview_figure`: small multiples, one panel per model × domain, the
  headline metric (perplexity) against the FLOPs ratio, each with a panel under it zoomed on full depth's
  tolerance band (:mod:`.zoom`) — the README's figure.
* :func:`domain_shift_figure` / :func:`write_domain_shift_figure`: each profile-based family calibrated in-domain
  (solid) and on shifted sources (dashed), one panel per domain × family.

Quality is shown relative to full depth (perplexity as a ratio on a log axis, other metrics as a change in points),
with the full-depth point, the verdict's tolerance band and the oracle bound. Each family has one colour × marker in
every figure (:func:`emad.report.figures.style.family_styles`).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from emad.evaluation.checks import Thresholds
from emad.evaluation.identity import split_family, split_profile
from emad.report.figures.draw import (
    Drawn,
    draw_lines,
    draw_reference,
    edge_limits,
    finish_axes,
    legend_handles,
    panel_limits,
    series_scale,
)
from emad.report.figures.lines import Line, clip, lines
from emad.report.figures.style import Style, family_styles
from emad.report.figures.zoom import draw_zoom_panel, reduction_handle
from emad.report.frontier import FULL, ORACLE, ParetoSeries
from emad.report.plots import plt, save_figure

NOTE_WIDTH = 64  # characters of a panel's verdict note per line (8.5 pt fits ~70 in a panel)

RATIO_CAP = 1e6  # perplexity ratios beyond this are drawn at the top edge, their value written beside


def _families(series_list: Sequence[ParetoSeries]) -> list[str]:
    return sorted({r.get("family") or "?" for s in series_list for r in s.rows} - {FULL, ORACLE})


def draw_panel(ax, series: ParetoSeries, x_key: str, thr: Thresholds, styles: dict[str, Style], drawn: Drawn,
               *, family: str | None = None, source_colours: dict[str, str] | None = None,
               ratio_cap: float = RATIO_CAP) -> list[Line]:
    """Draw one series on ``ax``: every line against ``x_key`` in its family's style, or only the lines of
    ``family`` coloured by calibration source (``source_colours``); returns the lines drawn, in order."""
    scale = series_scale(series, thr)
    cs = [c for c in lines(series.rows, x_key, series.model, series.domain)
          if family is None or c.family == family]
    if family is not None:
        cs = [c for c in cs if not c.in_domain] + [c for c in cs if c.in_domain]  # drawing order
    lim = panel_limits(series, cs, scale, ratio_cap)
    full_x = [r[x_key] for r in series.rows if r.get("family") == FULL and r.get(x_key) is not None]
    finish_axes(ax, scale, lim, x_key, [r[x_key] for c in cs for r in c.points] + full_x, series.metric)
    if family is None:
        keys = None
    else:  # the oracle bounds of profiles read through the family's own readout
        readout = split_family(family)[1]
        def keys(profile: str) -> bool:
            return split_profile(profile)[1] == readout
    draw_reference(ax, series, x_key, scale, lim, drawn, keys)
    if x_key == "flops_ratio":
        _draw_screen(ax, series, scale, lim, styles, family)
    if family is None:
        draw_lines(ax, cs, x_key, scale, series.full_quality, lim, lambda c: styles[c.family])
    else:
        sources = source_colours or {}
        def style_of(c: Line) -> Style:
            return Style(sources.get(c.calibration or "", "C7"), styles[family].marker)
        draw_lines(ax, [c for c in cs if not c.in_domain], x_key, scale, series.full_quality, lim, style_of)
        draw_lines(ax, [c for c in cs if c.in_domain], x_key, scale, series.full_quality, lim, style_of,
                    label_values=True)  # the knob values along the in-domain curve
    drawn.families |= {c.family for c in cs}
    drawn.shifted |= any(not c.in_domain for c in cs)
    if not cs and not full_x:
        ax.text(0.5, 0.5, "no points with this axis\n(no full-depth tokens/s to compare with)"
                if x_key == "speedup" else "no points", ha="center", va="center", transform=ax.transAxes,
                fontsize=8, color="grey")
    return cs


def _draw_screen(ax, series: ParetoSeries, scale, lim: tuple[float, float], styles: dict[str, Style],
                 family: str | None) -> None:
    """The screened values of the series' sweeps (teacher forced), faint dots in their family's colour behind the
    kept points."""
    rows = [r for r in series.screen if (family is None or r["family"] == family) and r["family"] in styles
            and r["flops_ratio"] is not None]
    if not rows:
        return
    ys, _ = clip([scale(r["quality"], series.full_quality) for r in rows], *edge_limits(lim, scale))
    ax.scatter([r["flops_ratio"] for r in rows], ys, s=7, lw=0, alpha=0.3, zorder=2,
               color=[styles[r["family"]].colour for r in rows])


def _legend(fig, styles: dict[str, Style], drawn: Drawn, extra: Sequence[Any] = ()) -> None:
    handles = [*legend_handles(styles, drawn), *extra]
    if handles:
        fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)


def pareto_figure(series: ParetoSeries, thresholds: Thresholds | None = None, *, ratio_cap: float = RATIO_CAP):
    """The figure of one series: quality vs FLOPs ratio (left) and vs speed-up (right), legend at the right."""
    thr = thresholds or Thresholds()
    styles = family_styles(_families([series]))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.3), layout="constrained")
    drawn = Drawn()
    draw_panel(left, series, "flops_ratio", thr, styles, drawn, ratio_cap=ratio_cap)
    draw_panel(right, series, "speedup", thr, styles, drawn, ratio_cap=ratio_cap)
    left.set_title("quality vs compute", fontsize=10)
    right.set_title("quality vs speed", fontsize=10)
    _legend(fig, styles, drawn)
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


def _grid(n_rows: int, n_cols: int, w: float = 4.2, h: float = 3.4):
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(w * n_cols, h * n_rows), squeeze=False,
                             layout="constrained")
    return fig, axes


def overview_figure(series_list: Sequence[ParetoSeries], metric: str = "perplexity",
                    thresholds: Thresholds | None = None, *, ratio_cap: float = RATIO_CAP,
                    notes: dict[str, str] | None = None):
    """Small multiples of ``metric`` against the FLOPs ratio: two rows per model, one column per domain — the
    whole sweep (up to ``ratio_cap``) and under it the same zoomed on full depth's tolerance band
    (:mod:`.zoom`: ±5% of full depth, FLOPs ratio 0.6–1.05, with the FLOPs reduction C1 asks for); ``notes``
    (model → text, e.g. its verdict) is printed under each of the model's wide panel titles.

    Raises:
        ValueError: no series of ``metric``.
    """
    chosen = [s for s in series_list if s.metric == metric]
    if not chosen:
        raise ValueError(f"no series of metric {metric!r} to draw")
    thr = thresholds or Thresholds()
    models = sorted({s.model for s in chosen})
    domains = sorted({s.domain for s in chosen})
    styles = family_styles(_families(chosen))
    fig, axes = plt.subplots(2 * len(models), len(domains), squeeze=False, layout="constrained",
                             figsize=(4.2 * len(domains), 6.6 * len(models)),
                             gridspec_kw={"height_ratios": [3.4, 3.2] * len(models)})
    drawn = Drawn()
    for ax in axes.flat:
        ax.set_visible(False)
    zoomed = None
    for s in chosen:
        row, col = 2 * models.index(s.model), domains.index(s.domain)
        ax, zoom = axes[row][col], axes[row + 1][col]
        ax.set_visible(True)
        zoom.set_visible(True)
        draw_panel(ax, s, "flops_ratio", thr, styles, drawn, ratio_cap=ratio_cap)
        note = (notes or {}).get(s.model)
        note = "\n".join(textwrap.wrap(note, NOTE_WIDTH)) if note else ""  # a long note would run into the legend
        ax.set_title(f"{s.model} · {s.domain}" + (f"\n{note}" if note else ""), fontsize=10 if not note else 8.5)
        window = draw_zoom_panel(zoom, s, thr, styles, drawn)
        zoomed = zoomed or window
        zoom.set_title(f"{s.model} · {s.domain}, zoomed" + (f"\n{window.text}" if window else ""), fontsize=8)
    _legend(fig, styles, drawn, [reduction_handle(thr)] if zoomed else [])
    fig.suptitle(f"{metric} against compute: one line per method family, each panel zoomed below it")
    return fig


def _profile_families(series_list: Sequence[ParetoSeries]) -> list[str]:
    return sorted({r["family"] for s in series_list for r in s.rows
                   if r.get("calibration") and r.get("family") not in (FULL, ORACLE)})


def domain_shift_figure(series_list: Sequence[ParetoSeries], metric: str = "perplexity",
                        thresholds: Thresholds | None = None, *, ratio_cap: float = RATIO_CAP):
    """Each profile-based family (one with calibrated runs) per model × domain: its curve calibrated on the domain
    itself (solid) and on other sources (dashed, one colour per source), knob values written at the points.

    Raises:
        ValueError: no series of ``metric`` with calibrated runs.
    """
    chosen = [s for s in series_list if s.metric == metric]
    families = _profile_families(chosen)
    if not families:
        raise ValueError(f"no calibrated runs of metric {metric!r} to draw")
    thr = thresholds or Thresholds()
    styles = family_styles(_families(chosen))
    sources = sorted({r.get("calibration") or "" for s in chosen for r in s.rows if r.get("calibration")})
    colours = {src: f"C{i % 10}" for i, src in enumerate(sources)}  # one colour per source in every panel
    fig, axes = _grid(len(chosen), len(families), w=3.8, h=3.2)
    drawn = Drawn()
    for i, s in enumerate(chosen):
        for j, family in enumerate(families):
            ax = axes[i][j]
            cs = draw_panel(ax, s, "flops_ratio", thr, styles, drawn, family=family, source_colours=colours,
                            ratio_cap=ratio_cap)
            knob = next((c.knob for c in cs if c.knob), None)
            ax.set_title(f"{family}\n{s.model} · {s.domain}" + (f"  (labels: {knob})" if knob else ""),
                         fontsize=8)
            if not cs:  # this family did not run on this model and domain
                ax.clear()
                ax.axis("off")
                ax.text(0.5, 0.5, f"{family}\nnot run on {s.model} · {s.domain}", ha="center", va="center",
                        transform=ax.transAxes, fontsize=8, color="grey")
            else:
                ax.legend(handles=[plt.Line2D([], [], color=line.get_color(), ls=line.get_linestyle(),
                                              marker=line.get_marker(), label=f"cal {c.calibration or '—'}")
                                   for c, line in zip(cs, ax.get_lines()[-len(cs):])],
                          fontsize=6.5, loc="best", frameon=True, framealpha=0.8)
    drawn.families = set()  # the panel titles name the family; the colours name the calibration source
    _legend(fig, styles, drawn)
    fig.suptitle(f"{metric}: calibrated in-domain (solid) vs shifted (dashed)")
    return fig


def write_overview_figure(series_list: Sequence[ParetoSeries], path: str | Path, metric: str = "perplexity",
                          thresholds: Thresholds | None = None, notes: dict[str, str] | None = None) -> Path | None:
    """Write :func:`overview_figure` to ``path``; None (nothing written) when no series has ``metric``."""
    if not any(s.metric == metric for s in series_list):
        return None
    return save_figure(overview_figure(series_list, metric, thresholds, notes=notes), path)


def write_domain_shift_figure(series_list: Sequence[ParetoSeries], path: str | Path, metric: str = "perplexity",
                              thresholds: Thresholds | None = None) -> Path | None:
    """Write :func:`domain_shift_figure` to ``path``; None (nothing written) without calibrated runs of
    ``metric``."""
    if not _profile_families([s for s in series_list if s.metric == metric]):
        return None
    return save_figure(domain_shift_figure(series_list, metric, thresholds), path)
