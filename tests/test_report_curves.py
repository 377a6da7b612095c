"""Curves of swept operating points read at equal FLOPs, the headline metrics.json and the run's own speed-up."""

from __future__ import annotations

import json

import pytest

from emad.report import (
    CurvePoint,
    at_flops,
    domain_curves,
    domain_shift_curves,
    envelope,
    family_verdicts,
    largest_reduction,
    metrics_summary,
    model_curves,
    pareto_data,
    report_markdown,
    run_details,
    speedup,
)
from emad.report.tables import fmt_largest
from emad.report.verdict import verdict
from tests.test_report import DOMAINS, full_runs, make_run, noisy_runs


def _sweep(family: str, points: list[tuple[float, float]], *, calibration: str | None = None,
           domains=DOMAINS, knob: str = "margin", **kw) -> list[dict]:
    """One family swept along ``knob``: ``(flops ratio, perplexity)`` per value, the same on every domain."""
    runs = []
    for i, (flops, ppl) in enumerate(points):
        for d in domains:
            run = make_run(f"{family}-v{i}", d, family, calibration=calibration, flops=flops, ppl=ppl, **kw)
            run.update(curve=f"{family}-v", knob=knob, value=float(i), readout="logit")
            runs.append(run)
    return runs


# --- envelope and readings ------------------------------------------------------------------------------------

def test_value_at_085_is_interpolated_linearly_between_the_nearest_points():
    pts = [CurvePoint("a", 0.9, 0.01, "met"), CurvePoint("b", 0.8, 0.03, "unresolved"),
           CurvePoint("c", 0.7, 0.10, "violated")]
    at = at_flops(pts, 0.85)
    assert at.value == pytest.approx(0.02)
    assert (at.cheaper.label, at.costlier.label) == ("b", "a")
    assert at_flops(pts, 0.8).value == pytest.approx(0.03) and at_flops(pts, 0.8).cheaper is at_flops(pts, 0.8).costlier
    assert at_flops(pts, 0.75).value == pytest.approx(0.065)


def test_largest_reduction_is_none_when_only_costlier_points_hold():
    pts = [CurvePoint("never-exits", 1.3, 0.0, "met"), CurvePoint("full-cost", 1.0, 0.0, "met"),
           CurvePoint("c", 0.7, 0.1, "violated")]
    assert largest_reduction(pts) is None and fmt_largest(largest_reduction(pts)) == "none"
    assert largest_reduction(pts + [CurvePoint("b", 0.9, 0.0, "met")]).label == "b"


def test_value_is_none_when_the_curve_never_reaches_085():
    pts = [CurvePoint("a", 0.95, 0.0), CurvePoint("b", 0.9, 0.01), CurvePoint("c", 1.3, 0.0)]
    at = at_flops(pts, 0.85)
    assert at.value is None and at.cheaper is None and at.costlier.label == "b"  # nearest measured point
    assert at_flops([], 0.85).value is None


def test_envelope_drops_dominated_points_and_is_flat_above_the_costliest():
    pts = [CurvePoint("a", 0.9, 0.01), CurvePoint("noisy", 0.86, 0.5), CurvePoint("b", 0.8, 0.03),
           CurvePoint("worse-at-same-cost", 0.8, 0.04), CurvePoint("c", 0.7, 0.1), CurvePoint("inf", 0.6, float("inf"))]
    assert [p.label for p in envelope(pts)] == ["c", "b", "a"]
    assert at_flops(pts, 0.85).value == pytest.approx(0.02)  # the dominated point at 0.86 is not on the envelope
    flat = at_flops([CurvePoint("x", 0.6, 0.2), CurvePoint("y", 0.7, 0.1)], 0.85)
    assert flat.value == pytest.approx(0.1) and flat.cheaper.label == "y" and flat.costlier is None


def test_largest_reduction_within_tolerance_skips_violated_points():
    pts = [CurvePoint("a", 0.9, 0.1, "met"), CurvePoint("b", 0.75, 0.9, "unresolved"),
           CurvePoint("c", 0.5, 5.0, "violated")]
    assert largest_reduction(pts).label == "b"
    assert largest_reduction(pts, ("met",)).label == "a"
    assert largest_reduction([CurvePoint("c", 0.5, 5.0, "violated")]) is None


# --- curves from run records ----------------------------------------------------------------------------------

def test_model_curve_reads_the_tolerance_used_at_the_target_from_swept_runs():
    # perplexity rises 0.2%, 0.6%, 3% at 10%, 20%, 40% fewer FLOPs; tolerance 1% relative, accuracy unchanged
    runs = full_runs(acc=None) + _sweep("emad", [(0.9, 10.02), (0.8, 10.06), (0.6, 10.3)], acc=None)
    (curve,) = model_curves(family_verdicts(runs))
    assert (curve.model, curve.family, curve.domain, curve.target) == ("m", "emad", None, pytest.approx(0.85))
    at = curve.at_target
    assert at.value == pytest.approx(0.4, abs=1e-6)  # halfway between 0.2 and 0.6 of the tolerance
    assert (at.cheaper.label, at.costlier.label) == ("emad-v1", "emad-v0")
    assert curve.at(0.85, "perplexity").value == pytest.approx(0.004, abs=1e-8)
    assert curve.largest_ok.label == "emad-v1" and curve.largest_ok.reduction == pytest.approx(0.2)
    assert curve.largest_met.label == "emad-v1"
    json.dumps(curve.to_dict())


def test_largest_reduction_counts_unresolved_points_but_not_violated_ones(tmp_path):
    runs = full_runs(acc=None) + _sweep("emad", [(0.9, 10.02), (0.6, 10.5)], acc=None) \
        + noisy_runs("emad-open", ppl=10.08, noise=0.05, flops=0.7, acc=None)
    (curve,) = model_curves(family_verdicts(runs))
    assert curve.largest_ok.label == "emad-open" and curve.largest_ok.state == "unresolved"
    assert curve.largest_met.label == "emad-v0"


def test_domain_curves_and_the_domain_shift_comparison_at_equal_flops():
    runs = full_runs()
    # in-domain profiles: perplexity +0.5% at 20% fewer FLOPs; calibrated on the other domain: +2% there
    for cal in DOMAINS:
        for i, flops in enumerate((0.9, 0.8, 0.7)):
            for d in DOMAINS:
                shift = 1.0 if d == cal else 4.0
                run = make_run(f"emad-v{i}", d, "emad", calibration=cal, flops=flops,
                               ppl=10.0 * (1 + shift * 0.0025 * (i + 1)))
                runs.append(run)
    curves = domain_curves(family_verdicts(runs))
    assert [(c.calibration, c.domain) for c in curves] == [(c, d) for c in DOMAINS for d in DOMAINS]
    own = next(c for c in curves if c.calibration == c.domain == "code")
    assert own.at(0.8, "perplexity").value == pytest.approx(0.005, abs=1e-8)
    rows = domain_shift_curves(curves)
    assert [(r["domain"], r["calibration"]) for r in rows] == [("code", "prose"), ("prose", "code")]
    row = rows[0]
    assert row["in_domain"] and [c["flops_ratio"] for c in row["at"]] == [0.95, 0.9, 0.85, 0.8, 0.7]
    at80 = next(c for c in row["metrics"]["perplexity"] if c["flops_ratio"] == 0.8)
    assert at80["in_domain"] == pytest.approx(0.005, abs=1e-8) and at80["shifted"] == pytest.approx(0.02, abs=1e-8)
    assert at80["difference"] == pytest.approx(0.015, abs=1e-8)
    tol85 = next(c for c in row["at"] if c["flops_ratio"] == 0.85)
    assert tol85["shifted"] - tol85["in_domain"] == pytest.approx(tol85["difference"])
    assert row["largest_ok"] == {"in_domain": pytest.approx(0.3), "shifted": pytest.approx(0.1)}
    md = report_markdown(runs, verdict(runs), {}, [], family_verdicts=family_verdicts(runs))
    assert "## Curves at equal FLOPs" in md and "## Domain shift" in md and "| m | emad | code | prose |" in md


def test_domain_shift_without_an_in_domain_curve_keeps_the_shifted_one():
    runs = full_runs() + _sweep("emad", [(0.9, 10.02), (0.8, 10.06)], calibration="prose")
    (row,) = domain_shift_curves(domain_curves(family_verdicts(runs)))
    assert (row["domain"], row["calibration"], row["in_domain"]) == ("code", "prose", False)
    assert all(c["in_domain"] is None and c["difference"] is None for c in row["at"])


# --- speed-up, rows and metrics.json --------------------------------------------------------------------------

def test_speedup_prefers_the_runs_own_measurement():
    base = make_run("full", "code", tps=100.0)
    run = make_run("emad-a", "code", tps=150.0)
    assert speedup(run, base) == pytest.approx(1.5)
    run["cost"]["speedup"] = 1.2
    assert speedup(run, base) == pytest.approx(1.2) and speedup(run, None) == pytest.approx(1.2)
    run["cost"]["speedup"] = None
    assert speedup(run, base) == pytest.approx(1.5)
    run["cost"]["speedup"] = float("nan")
    assert speedup(run, base) == pytest.approx(1.5) and speedup(run, None) is None


def test_verdict_speedup_uses_the_in_process_reference():
    runs = full_runs() + [make_run("emad-a", d, flops=0.8, tps=150.0) for d in DOMAINS]
    for r in runs[2:]:
        r["cost"].update(speedup=1.25, reference_tokens_per_s=120.0)
    assert verdict(runs)["m"].points[0].speedup == pytest.approx(1.25)


def test_rows_carry_curve_knob_value_readout_and_domain():
    runs = full_runs() + _sweep("emad", [(0.9, 10.02)])
    rows = {r["point"]: r for r in pareto_data(runs)[0].rows}
    assert {k: rows["emad-v0"][k] for k in ("curve", "knob", "value", "readout", "domain")} == {
        "curve": "emad-v", "knob": "margin", "value": 0.0, "readout": "logit", "domain": "code"}
    assert rows["full"]["curve"] is None and rows["full"]["knob"] is None


FAMILIES = ("emad", "emad+tuned", "fixed", "confidence", "softmax+tuned", "contrastive", "ead", "speculative+tuned")


def _leaves(d: dict) -> int:
    return sum(_leaves(v) if isinstance(v, dict) else 1 for v in d.values())


def test_metrics_json_holds_few_headline_keys_for_eight_families_of_eight_points():
    runs = full_runs(acc=None)  # perplexity alone: the checks C1 names are all powered
    for f in FAMILIES:
        runs += _sweep(f, [(1.0 - 0.06 * i, 10.0 * (1 + 0.002 * i)) for i in range(1, 9)], acc=None)
    verdicts = verdict(runs)
    metrics = metrics_summary(runs, verdicts)
    assert sorted(metrics["m"]) == sorted(FAMILIES)
    assert _leaves(metrics) <= 76  # ≤ 9.5 a family, of which c1, c1_reason, c2, c2_reason
    emad = metrics["m"]["emad"]
    assert set(emad) <= {"c1", "c1_reason", "c2", "c2_reason", "tolerance_multiple_at_target", "perplexity_change_at_target",
                         "max_reduction_within_tolerance", "max_reduction_unresolved", "max_reduction_untested"}
    assert {"c1", "c1_reason", "c2", "c2_reason", "tolerance_multiple_at_target"} <= set(emad)
    assert emad["c1"] == "pass" and emad["perplexity_change_at_target"] == pytest.approx(0.005, abs=1e-6)
    # 0.2% per 6% of FLOPs: 0.8% at 24% is the last shown within; 1% at 30% straddles the tolerance (unresolved)
    assert emad["max_reduction_within_tolerance"] == pytest.approx(0.24)
    assert emad["max_reduction_unresolved"] == pytest.approx(0.3)
    details = run_details(runs, verdicts)
    assert len(details["models"]["m"]["runs"]) == 8 * 8 + 1 and len(details["curves"]) == 8
    json.dumps(details)


def test_metrics_name_the_judged_method_when_it_spans_families():
    runs = full_runs(acc=None) + _sweep("emad", [(0.8, 10.05)], acc=None) \
        + _sweep("emad+tuned", [(0.7, 10.05)], acc=None)
    metrics = metrics_summary(runs, verdict(runs, ("emad", "emad+tuned")))
    assert sorted(metrics["m"]) == ["emad", "emad (all)", "emad+tuned"]
    assert metrics["m"]["emad (all)"]["max_reduction_within_tolerance"] == pytest.approx(0.3)


def test_a_metric_curve_places_a_check_identical_by_construction_at_zero_without_a_measured_change():
    """A point proved identical counts its checks; a judged half with no units of a metric has no measured change,
    but the proof is the value: that metric's curve places the point at zero, as the others do."""
    from types import SimpleNamespace

    from emad.evaluation.checks import IDENTICAL, Check
    from emad.report.curves import CurveId, _curve

    ppl = Check("d", "perplexity", 10.0, 10.0, 0.0, 0.01, True, state=IDENTICAL)
    cloze = [Check(d, "cloze.accuracy", None, None, None, 0.01, False, state=IDENTICAL) for d in ("d", "e")]
    point = SimpleNamespace(label="p", checks=[ppl, *cloze], flops_ratio=0.8, flops_by_domain={"d": 0.8, "e": 0.8})
    curve = _curve(CurveId("m", "emad"), 0.85, [point])  # over both domains
    assert [p.label for p in curve.points] == ["p"]
    assert set(curve.metrics) == {"perplexity", "cloze.accuracy"}
    assert curve.metrics["perplexity"][0].value == curve.metrics["cloze.accuracy"][0].value == 0.0


def test_a_point_identical_by_construction_stands_on_its_curve_at_zero_change():
    """Speculative decoding proved lossless, on too few windows to count a perplexity check and with no units of a
    metric on its judged half: its curve still holds the point, at zero change (a proven value, not a missing one)."""
    runs = full_runs() + _sweep("speculative", [(1.117, 10.0)])
    for r in runs:
        if r["family"] == "speculative":
            r["identity"] = {"proved": True, "why": "lossless verification"}
            r["tasks"]["perplexity"]["samples"]["perplexity"] = r["tasks"]["perplexity"]["samples"]["perplexity"][:5]
    curves = {c.family: c for c in model_curves(family_verdicts(runs))}
    point, = curves["speculative"].points
    assert point.value == 0.0 and point.state == "met" and point.flops_ratio == pytest.approx(1.117)
    assert all(p.value == 0.0 for pts in curves["speculative"].metrics.values() for p in pts)


def test_a_family_with_judged_runs_never_reads_zero_points():
    """Speculative decoding, not proved identical, every judged unit equal to full depth's but too few to be met
    (underpowered) and its perplexity on too few windows to count: its measured change (0) places it on the curve,
    its state says no label rests on it."""
    runs = full_runs() + _sweep("speculative", [(1.117, 10.0)])
    for r in runs:
        if r["family"] == "speculative":
            r["tasks"]["perplexity"]["samples"]["perplexity"] = r["tasks"]["perplexity"]["samples"]["perplexity"][:5]
    curves = {c.family: c for c in model_curves(family_verdicts(runs))}
    point, = curves["speculative"].points
    assert point.value == pytest.approx(0.0, abs=1e-9) and point.state in ("untested at this size", "unresolved")
