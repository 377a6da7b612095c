"""Curve figures (emad.report.figures) on synthetic Pareto series: lines, limits, styles, overview, domain shift."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from emad.evaluation.checks import Thresholds
from emad.report import ParetoSeries
from emad.report.figures.frontier import (
    domain_shift_figure,
    overview_figure,
    pareto_figure,
    write_domain_shift_figure,
    write_overview_figure,
    write_pareto_figures,
)
from emad.report.figures.lines import lines, plot_fields, quality_scale
from emad.report.figures.style import family_styles
from emad.report.figures.zoom import REDUCTION_GID, ZOOM_LABEL
from emad.report.heatmap import heatmap_html
from emad.report.plots import plt, profile_figure

FAMILIES = ("emad", "fixed", "confidence+tuned")
KNOBS = {"emad": "margin", "fixed": "depth", "confidence": "h0"}
FULL_PPL = 10.0


def _row(family: str, i: int, n: int, domain: str, calibration: str | None, ppl: float, sweep: bool,
         metric_value: float | None = None) -> dict:
    flops = 0.15 + 0.85 * i / max(n - 1, 1)
    point = f"{family.split('+')[0]}-{i}"
    row = {"run_id": f"m--{point}--{calibration}--{domain}--{family}", "point": point, "family": family,
           "calibration": calibration, "flops_ratio": flops, "bytes_ratio": flops, "speedup": 1.6 - 0.6 * flops,
           "tokens_per_s": 100.0, "quality": ppl if metric_value is None else metric_value,
           "on_frontier_flops": False, "on_frontier_speed": False, "mlflow_run_id": None}
    if sweep:
        method = family.split("+")[0]
        row |= {"curve": f"{method}-base", "knob": KNOBS.get(method, "k"), "value": float(i),
                "readout": family.partition("+")[2] or "logit", "domain": domain}
    return row


def _full_row(quality: float) -> dict:
    return {"run_id": "m--full", "point": "full", "family": "full", "calibration": None, "flops_ratio": 1.0,
            "bytes_ratio": 1.0, "speedup": 1.0, "tokens_per_s": 100.0, "quality": quality,
            "on_frontier_flops": True, "on_frontier_speed": True, "mlflow_run_id": "ml-full"}


def synthetic_series(domain: str = "prose", n: int = 8, families=FAMILIES, metric: str = "perplexity",
                     sweep: bool = True, shifted: str | None = "code", ppl_max: float = 1e8) -> ParetoSeries:
    """``families`` × ``n`` points from ``ppl_max`` (cheapest) down to just above full depth, plus shifted
    calibration curves for the profile families (emad*, confidence*)."""
    rows = [_full_row(FULL_PPL if metric == "perplexity" else 0.8)]
    for k, family in enumerate(families):
        cals = [domain, shifted] if family.split("+")[0] in ("emad", "confidence") and shifted else [None]
        for cal in cals:
            for i in range(n):
                t = i / max(n - 1, 1)
                span = (1 - t) ** (1 + k) * (math.log(ppl_max) - math.log(FULL_PPL)) * (1 - 0.06 * k)
                ppl = FULL_PPL * 1.002 * math.exp(span)
                if cal not in (None, domain):
                    ppl *= 1.5
                acc = None if metric == "perplexity" else 0.8 - 0.6 * (1 - t) ** (2 + k) - 0.004 * k
                rows.append(_row(family, i, n, domain, cal, ppl, sweep, acc))
    hb = metric != "perplexity"
    oracle = {domain: 0.42, f"{domain}+tuned": 0.35}
    return ParetoSeries("m", domain, metric, hb, rows, rows[0]["quality"], oracle)


def _curve_lines(ax) -> list:
    """The lines drawn through measured points (markers, not the full-depth star or reference lines)."""
    return [ln for ln in ax.get_lines() if ln.get_marker() not in ("None", "", None, "*") and len(ln.get_xdata()) > 1]


@pytest.mark.parametrize("sweep", [True, False])
def test_each_family_draws_one_line_through_its_points(sweep):
    s = synthetic_series(families=("fixed",), n=7, sweep=sweep)
    fig = pareto_figure(s)
    ax = fig.axes[0]
    lines = _curve_lines(ax)
    assert len(lines) == 1 and len(lines[0].get_xdata()) == 7
    assert list(lines[0].get_xdata()) == sorted(lines[0].get_xdata())  # ordered by cost
    plt.close(fig)


def test_calibrations_are_separate_lines_solid_in_domain_dashed_shifted():
    s = synthetic_series(families=("emad",), n=5)
    fig = pareto_figure(s)
    lines = _curve_lines(fig.axes[0])
    assert sorted(ln.get_linestyle() for ln in lines) == ["-", "--"]
    assert all(len(ln.get_xdata()) == 5 for ln in lines)
    plt.close(fig)


def test_perplexities_from_10_to_1e8_stay_inside_the_axes():
    s = synthetic_series(ppl_max=1e8)
    fig = pareto_figure(s)
    for ax in fig.axes[:2]:
        lo, hi = ax.get_ylim()
        assert ax.get_yscale() == "log"
        for ln in _curve_lines(ax):
            assert all(lo <= y <= hi for y in ln.get_ydata())
    plt.close(fig)


def test_accuracies_are_changes_in_points_around_zero():
    s = synthetic_series(metric="fidelity.token_agreement")
    scale = quality_scale(s.metric, s.higher_better, s.full_quality, 0.01, 0.01)
    assert scale.kind == "points" and scale(0.75, 0.8) == pytest.approx(-5.0) and scale.tolerance == -1.0
    fig = pareto_figure(s)
    lo, hi = fig.axes[0].get_ylim()
    assert fig.axes[0].get_yscale() == "linear" and lo <= -60 and hi >= 0
    plt.close(fig)


def test_no_two_families_share_colour_and_marker():
    methods = ("emad", "fixed", "confidence", "softmax", "contrastive", "ead", "speculative")
    families = [m + r for m in methods for r in ("", "+tuned")] + ["full", "oracle", "calm", "lookahead",
                                                                    "mystery+tuned", "emad+other"]
    styles = family_styles(families)
    assert len(styles) == len(families) >= 14
    assert len({(s.colour, s.marker) for s in styles.values()}) == len(families)
    assert family_styles(["emad", "x"])["emad"] == styles["emad"]  # the same in every figure


def test_curves_group_by_sweep_and_calibration():
    s = synthetic_series()
    cs = lines(s.rows, "flops_ratio", s.model, s.domain)
    assert len(cs) == 5 and all(len(c.points) == 8 for c in cs)
    assert {(c.family, c.in_domain) for c in cs} >= {("emad", True), ("emad", False), ("fixed", True)}


def test_overview_and_domain_shift_figures_build(tmp_path):
    series = [synthetic_series("prose"), synthetic_series("code", shifted="prose"),
              synthetic_series("prose", metric="fidelity.token_agreement")]
    fig = overview_figure(series)
    assert sum(ax.get_visible() for ax in fig.axes) == 2 * 2  # each perplexity panel and its zoom
    plt.close(fig)
    fig = domain_shift_figure(series)
    assert len(fig.axes) == 2 * 2  # two domains × two profile families
    plt.close(fig)
    for write in (write_overview_figure, write_domain_shift_figure):
        path = write(series, tmp_path / f"{write.__name__}.png")
        assert path is not None and path.read_bytes()[:4] == b"\x89PNG"
    assert write_domain_shift_figure([synthetic_series(families=("fixed",))], tmp_path / "none.png") is None
    assert write_overview_figure(series[2:], tmp_path / "none.png") is None


def _zooms(fig) -> list:
    return [ax for ax in fig.axes if ax.get_visible() and ax.get_label() == ZOOM_LABEL]


def _at(ax, x: float | None = None, y: float | None = None) -> list:
    """Reference lines of ``ax``: vertical at ``x`` or horizontal at ``y``."""
    data = [(ln, ln.get_xdata(), ln.get_ydata()) for ln in ax.get_lines()]
    return [ln for ln, xs, ys in data if len(xs) == 2 and (
        (x is not None and list(xs) == pytest.approx([x, x])) or (y is not None and list(ys) == pytest.approx([y, y])))]


def test_overview_zooms_on_the_tolerance_band_under_each_wide_panel():
    series = [synthetic_series("prose"), synthetic_series("code", shifted="prose")]
    series[0].rows[3]["quality"] = math.inf  # diverged: leaves the window without moving its limits
    fig = overview_figure(series, thresholds=Thresholds())
    wide = [ax for ax in fig.axes if ax.get_visible() and ax.get_label() != ZOOM_LABEL]
    zooms = _zooms(fig)
    assert len(wide) == len(zooms) == 2
    assert all(ax.get_ylim()[1] >= 1e6 for ax in wide)  # the wide panels keep the whole sweep
    for ax in zooms:
        assert ax.get_xlim() == pytest.approx((0.6, 1.05)) and ax.get_ylim() == pytest.approx((0.95, 1.05))
        assert ax.get_yscale() == "log"  # perplexity as a ratio to full depth, as in the wide panels
        reduction = [ln for ln in ax.get_lines() if ln.get_gid() == REDUCTION_GID]
        assert len(reduction) == 1 and list(reduction[0].get_xdata()) == pytest.approx([0.85, 0.85])
        assert _at(ax, y=1.01) and _at(ax, y=1.0)  # the tolerance and full depth's level
        assert any(ln.get_marker() == "*" and list(ln.get_xdata()) == [1.0] for ln in ax.get_lines())
        curves = _curve_lines(ax)
        assert len(curves) == 5 and all(len(ln.get_xdata()) == 8 for ln in curves)  # every point, clipped by the axes
        looks = {(ln.get_color(), ln.get_marker()) for ln in curves}
        assert len(looks) == 3  # three families, none sharing colour and marker (calibrations differ in dash)
    assert "15% fewer FLOPs (C1)" in [t.get_text() for t in fig.legends[0].get_texts()]
    plt.close(fig)


def test_overview_zoom_reads_the_thresholds_and_shows_accuracies_in_points():
    thr = Thresholds(min_flops_reduction=0.3, acc_abs_tol=0.01)
    fig = overview_figure([synthetic_series(metric="fidelity.token_agreement")], "fidelity.token_agreement",
                          thresholds=thr)
    (ax,) = _zooms(fig)
    assert ax.get_yscale() == "linear" and ax.get_ylim() == pytest.approx((-5.0, 5.0))
    assert ax.get_xlim()[0] <= 0.6 and ax.get_xlim()[1] == pytest.approx(1.05)
    reduction = [ln for ln in ax.get_lines() if ln.get_gid() == REDUCTION_GID]
    assert list(reduction[0].get_xdata()) == pytest.approx([0.7, 0.7]) and _at(ax, y=-1.0)
    assert "30% fewer FLOPs (C1)" in [t.get_text() for t in fig.legends[0].get_texts()]
    plt.close(fig)


def test_pareto_figures_index_keeps_its_form(tmp_path):
    index = write_pareto_figures([synthetic_series()], tmp_path)
    assert index[0]["name"] == "m--prose--perplexity" and index[0]["mlflow_run_ids"] == ["ml-full"]


def test_plot_fields_put_quality_on_the_figures_scale():
    s = synthetic_series(families=("emad",), n=3)
    rows = s.plot_rows()
    fields = [plot_fields(s, r) for r in rows]
    full = fields[0]
    assert full["quality_vs_full"] == 1.0 and full["tolerance_vs_full"] == pytest.approx(1.01)
    assert {f["calibration_kind"] for f in fields} == {"none", "in-domain", "shifted"}
    assert len({f["line"] for f, r in zip(fields, rows) if r["family"] == "emad"}) == 2
    acc = synthetic_series(families=("fixed",), n=3, metric="fidelity.token_agreement")
    assert plot_fields(acc, acc.rows[1])["quality_vs_full"] == pytest.approx(100 * (acc.rows[1]["quality"] - 0.8))


def test_frontier_template_draws_lines_per_family_offline():
    text = (Path(__file__).parents[1] / ".dvc" / "plots" / "frontier.json").read_text()
    spec = json.loads(text)
    assert "<script" not in text and "<DVC_METRIC_DATA>" in text and "<DVC_METRIC_ZOOM_AND_PAN>" in text
    screen = spec["layer"][0]  # the screened values, faint, drawn first (behind the kept points)
    assert "datum.screened === true" in screen["transform"][0]["filter"] and screen["mark"]["opacity"] < 0.5
    assert "datum.screened !== true" in spec["layer"][1]["transform"][0]["filter"]
    curves_layer = spec["layer"][1]["layer"]
    assert curves_layer[0]["mark"]["type"] == "line" and curves_layer[1]["mark"]["type"] == "point"
    enc = curves_layer[0]["encoding"]
    assert enc["color"]["field"] == "family" and enc["strokeDash"]["field"] == "calibration_kind"
    assert {d["field"] for d in enc["detail"]} >= {"line", "rev"}


def test_heatmap_sets_prompt_apart_and_shows_full_depth_beside():
    tokens = [("Once", None), (" upon", 0), (" a", 3), (" <time>", 30)]
    page = heatmap_html([tokens], 30, "r")
    body = page.split("<body>")[1]
    assert 'class="prompt"' in body and '<span class="p">Once</span>' in body and "&lt;time&gt;" in body
    assert 'title="layer 3"' in body and 'title="layer 0"' not in body and "full depth</b>" not in body
    page = heatmap_html([tokens[2:]], 30, "r", prompts=["Tell me:"], full_depth=[[" a", " b"]])
    assert "Tell me:" in page and "adaptive depth" in page and "full depth</b>" in page and " a b" in page
    ticks = page.split('class="ticks">')[1].split("</div>")[0]
    assert ticks.count("<span") == 6  # 1, 6, 12, 18, 24, 30: each positioned apart


def test_profile_figure_draws_global_prominently_with_a_short_legend():
    layers = [3, 6, 9, 12]
    names = [f"pos{i}" for i in range(6)]
    raw = {n: [5.0 - 0.3 * k + 0.1 * i for k in range(4)] for i, n in enumerate(names)}
    prof = SimpleNamespace(probe_layers=layers, strata=SimpleNamespace(names=lambda: names), raw=raw, tau=raw,
                           count={n: [10.0] * 4 for n in names}, agreement=[0.1, 0.3, 0.6, 1.0],
                           oracle=[0.1, 0.2, 0.3, 0.4])
    fig = profile_figure(prof, "t")
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(labels) <= 4 and labels[0] == "global raw"
    widths = sorted(ln.get_linewidth() for ln in ax.get_lines())
    assert widths[-1] >= 2 * widths[0]  # the global τ stands out of the strata
    plt.close(fig)


def test_ratios_far_below_full_depth_and_infinite_ones_stay_inside():
    s = synthetic_series(families=("fixed",), n=4)
    s.rows[1]["quality"], s.rows[2]["quality"] = 1e-9, math.inf
    fig = pareto_figure(s)
    ax = fig.axes[0]
    lo, hi = ax.get_ylim()
    ys = _curve_lines(ax)[0].get_ydata()
    assert all(lo <= y <= hi for y in ys) and lo >= 0.01
    assert any(t.get_text() == "∞" for t in ax.texts)
    plt.close(fig)


def test_screened_values_are_drawn_faintly_behind_the_kept_points_on_the_flops_axis_only():
    s = synthetic_series(families=("fixed",), n=4)
    s.screen = [{"family": "fixed", "curve": "fixed-base", "calibration": None, "value": float(v),
                 "flops_ratio": 0.1 + 0.03 * v, "quality": FULL_PPL * (1 + 1 / (v + 1)), "kept": v % 5 == 0}
                for v in range(30)]
    fig = pareto_figure(s)
    left, right = fig.axes[:2]
    faint = [c for c in left.collections if len(c.get_offsets()) == 30]
    assert len(faint) == 1 and faint[0].get_alpha() < 0.5 and faint[0].get_zorder() < 4  # behind the lines
    assert not [c for c in right.collections if len(c.get_offsets()) == 30]  # the speed axis has no screen
    plt.close(fig)
